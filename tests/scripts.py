"""Load a benchmark (``benchmarks/``) or a kernel-development tool (``tools/``) as a module."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = (ROOT / "benchmarks", ROOT / "tools")


def load_script(name: str, module_name: str | None = None):
    """``benchmarks/<name>.py`` or ``tools/<name>.py`` as a module, both folders on the path (as
    when a script runs: tools import the benchmarks' helpers)."""
    for folder in FOLDERS:
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    path = next((f / f"{name}.py" for f in FOLDERS if (f / f"{name}.py").exists()), None)
    if path is None:
        raise FileNotFoundError(f"no script {name}.py in benchmarks/ or tools/")
    spec = importlib.util.spec_from_file_location(module_name or name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a dataclass in the script looks its module up
    spec.loader.exec_module(mod)
    return mod
