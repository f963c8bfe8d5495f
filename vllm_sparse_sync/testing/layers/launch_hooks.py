"""Triton launches seen by the sentinel: a launch with a tainted argument taints every tensor
argument (the kernel may write any of them), and the launch itself runs with the sentinel
paused (the interpreter's own host copies are emulation, not the caller's host reads).

`kernel[grid](...)` goes through `KernelInterface.__getitem__`; the hook wraps it once per
process, as soon as Triton is imported (checked when a watcher starts and on each torch call
it sees: a kernel module calls torch before it launches), and costs one thread-local lookup per
launch when no sentinel runs on the thread. Triton is never imported here.
"""

from __future__ import annotations

import sys
import threading
from typing import Protocol

from .taint import tensors_in


class LaunchWatcher(Protocol):
    def on_launch(self, tensors: list) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


_local = threading.local()
_lock = threading.Lock()
_installed = False


def _watchers() -> list[LaunchWatcher]:
    w = getattr(_local, "watchers", None)
    if w is None:
        w = _local.watchers = []
    return w


def _launch(launch, args, kwargs):
    watchers = list(_watchers())
    if not watchers:
        return launch(*args, **kwargs)
    tensors = list(tensors_in(list(args))) + list(tensors_in(kwargs))
    for w in watchers:
        w.on_launch(tensors)
        w.pause()
    try:
        return launch(*args, **kwargs)
    finally:
        for w in watchers:
            w.resume()


def _wrap_getitem(orig):
    def __getitem__(self, grid):
        launch = orig(self, grid)
        return lambda *args, **kwargs: _launch(launch, args, kwargs)

    __getitem__._vllm_sparse_sync_hook = True  # type: ignore[attr-defined]
    return __getitem__


def installed() -> bool:
    return _installed


def install() -> bool:
    """Hook Triton's launch entry if Triton is imported; False while it is not."""
    global _installed
    if _installed:
        return True
    jit = sys.modules.get("triton.runtime.jit")  # never imported here: that runs under torch modes
    KernelInterface = getattr(jit, "KernelInterface", None)
    if KernelInterface is None:
        return False
    with _lock:
        if _installed:
            return True
        classes = [KernelInterface, *_subclasses(KernelInterface)]
        for cls in classes:
            orig = cls.__dict__.get("__getitem__")
            if orig is not None and not getattr(orig, "_vllm_sparse_sync_hook", False):
                cls.__getitem__ = _wrap_getitem(orig)
        _installed = True
    return True


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def watch_launches(watcher: LaunchWatcher) -> None:
    """Report this thread's Triton launches to `watcher` until `unwatch_launches`."""
    install()
    _watchers().append(watcher)


def unwatch_launches(watcher: LaunchWatcher) -> None:
    w = _watchers()
    if watcher in w:
        w.remove(watcher)
