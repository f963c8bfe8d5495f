"""Taint by storage: which storages hold data that stands for device data.

A storage is tainted as a whole (every view of it reads tainted data) and its taint dies with
it: entries hold weak references to torch's storage objects, which live exactly as long as
the storage, so a new tensor at a reused address starts clean.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch


def tensors_in(obj) -> Iterator[torch.Tensor]:
    """Tensors inside `obj` (a tensor, or lists, tuples, dicts and slices holding them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)
    elif isinstance(obj, slice):
        for o in (obj.start, obj.stop, obj.step):
            yield from tensors_in(o)


def storage_of(t: torch.Tensor):
    """The tensor's untyped storage object (shared by all its views), or None if it has none."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, some subclasses
        return None


def storage_objects_are_preserved() -> bool:
    """Whether torch hands back one storage object per storage (torch >= 2.1), which the
    weak references here rely on."""
    t = torch.zeros(2)
    return t.untyped_storage() is t[1:].untyped_storage()


class TaintSet:
    """Tainted storages, by identity; an entry dies with its storage."""

    def __init__(self) -> None:
        self._live: dict[int, weakref.ref] = {}

    def __len__(self) -> int:
        return sum(1 for ref in self._live.values() if ref() is not None)

    def add(self, t: torch.Tensor) -> bool:
        """Taint `t`'s storage; True if it was clean before."""
        s = storage_of(t)
        if s is None:
            return False
        key = id(s)
        ref = self._live.get(key)
        if ref is not None and ref() is s:
            return False
        live = self._live

        def _drop(r, key=key, live=live):
            if live.get(key) is r:
                del live[key]

        live[key] = weakref.ref(s, _drop)
        return True

    def __contains__(self, t: object) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        s = storage_of(t)
        if s is None:
            return False
        ref = self._live.get(id(s))
        return ref is not None and ref() is s

    def any(self, obj) -> bool:
        """Whether any tensor inside `obj` is tainted."""
        return any(t in self for t in tensors_in(obj))

    def add_all(self, obj) -> int:
        """Taint every tensor inside `obj`; returns how many storages were newly tainted."""
        return sum(self.add(t) for t in tensors_in(obj))
