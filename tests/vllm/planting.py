"""A pytest plugin (``-p planting``) that imports one vLLM module from an edited copy of its source,
compiled under the module's real file name: a planted host read, or a shifted line, without
touching site-packages. For subprocess runs only (a module is planted for the whole process).

Configured by the environment:

- ``VSS_PLANT_MODULE``: the module (``vllm.v1.attention.backends.mla.indexer``);
- ``VSS_PLANT_BEFORE``: the stripped text of the line(s) to insert before (every occurrence);
- ``VSS_PLANT_LINE``: the line to insert, indented like the line it precedes.

The edited source is put in `linecache` under the real file name, so reports show the planted
code at its planted line, as they would for a real edit.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import os
import sys


def plant(source: str, before: str, line: str) -> tuple[str, list[int]]:
    """`source` with `line` inserted before each line whose stripped text is `before`; returns the
    new source and the 1-based numbers of the inserted lines."""
    out, planted = [], []
    for text in source.splitlines(keepends=True):
        if text.strip() == before:
            indent = text[: len(text) - len(text.lstrip())]
            out.append(f"{indent}{line}\n")
            planted.append(len(out))
        out.append(text)
    if not planted:
        raise ValueError(f"no line {before!r} to plant before")
    return "".join(out), planted


class _Loader(importlib.abc.Loader):
    def __init__(self, origin: str, before: str, line: str):
        self.origin, self.before, self.line = origin, before, line

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(self.origin) as f:
            source, _ = plant(f.read(), self.before, self.line)
        lines = source.splitlines(keepends=True)
        linecache.cache[self.origin] = (len(source), None, lines, self.origin)  # kept: no mtime
        module.__file__ = self.origin
        exec(compile(source, self.origin, "exec", dont_inherit=True), module.__dict__)  # its own futures


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, before: str, line: str):
        self.name, self.before, self.line = name, before, line

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin:
            return None
        return importlib.util.spec_from_file_location(fullname, spec.origin,
                                                      loader=_Loader(spec.origin, self.before, self.line))


def _install() -> None:
    name = os.environ.get("VSS_PLANT_MODULE")
    if not name:
        return
    if name in sys.modules:
        raise RuntimeError(f"planting: {name} was imported before the plant could be installed")
    sys.meta_path.insert(0, _Finder(name, os.environ["VSS_PLANT_BEFORE"], os.environ["VSS_PLANT_LINE"]))


_install()
