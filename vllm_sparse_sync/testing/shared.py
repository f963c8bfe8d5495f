"""Running layers shared by nested and concurrent checked regions.

One instance of each region layer runs at a time: per process for the CUDA layers (torch's debug
mode and the GPU trace hooks are process-wide, the profiler cannot nest) and per thread for the
sentinel (torch modes are per thread). A region entered while an instance runs joins it instead
of starting a second one; the last region to leave stops it, which puts the debug mode and the
profiler back as the first region found them.

Each record goes to exactly one region: the innermost region, among those using the layer, of the
thread the sync happened on, else the region that joined last. Records are handed out whenever a
region joins or leaves, so a region gets what was seen while it ran, and a nested region raises
for its own syncs while the region around it does not see them again.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from . import layers as _layers

if TYPE_CHECKING:
    from .guard import SyncCheck


class NotJoinable(RuntimeError):
    """A running layer that this region cannot share (it runs on another thread)."""


class Running:
    """One running layer instance and the regions using it, in the order they joined."""

    def __init__(self, key: tuple, layer) -> None:
        self.key = key
        self.layer = layer
        self.thread = threading.get_ident()
        self.users: list[SyncCheck] = []
        self._touched = 0

    def hand_out(self) -> None:
        """Give the records seen since the last hand-out to the regions using the layer."""
        self._route(self.layer.collect())

    def _route(self, records) -> None:
        users = self.users
        for rec in records:
            same = [u for u in users if u.thread_name == rec.thread]
            (same[-1] if same else users[-1]).records.append(rec)
        touched = getattr(self.layer, "touched", None)
        if touched is not None:  # the sentinel: one thread, so its innermost region
            users[-1]._touched = (users[-1]._touched or 0) + touched - self._touched
            self._touched = touched


_running: dict[tuple, Running] = {}
_lock = threading.RLock()


def _key(cls) -> tuple:
    return (cls.name, threading.get_ident()) if cls.shared_by == "thread" else (cls.name,)


def running(name: str) -> Running | None:
    """The running instance of layer `name` this thread would join, if any."""
    with _lock:
        return _running.get(_key(_layers.REGION_LAYERS[name]))


def join(region: SyncCheck, name: str, watch=()) -> Running:
    """Start layer `name` for `region`, or join the instance that runs."""
    cls = _layers.REGION_LAYERS[name]
    key = _key(cls)
    with _lock:
        run = _running.get(key)
        if run is None:
            layer = cls.create(watch)
            layer.start()
            run = _running[key] = Running(key, layer)
        else:
            if cls.own_thread_only and run.thread != threading.get_ident():
                owner = next((t.name for t in threading.enumerate() if t.ident == run.thread), "?")
                raise NotJoinable(f"it runs for a checked region of thread {owner!r} and is stopped "
                                  f"only there; that region's records hold the syncs of this thread")
            if run.users:
                run.hand_out()
            if watch:
                run.layer.add_watch(watch)
        run.users.append(region)
        return run


def leave(region: SyncCheck, run: Running) -> None:
    """`region` stops using `run`; the last region to leave stops the layer."""
    with _lock:
        if region not in run.users:
            return
        if len(run.users) > 1:
            try:
                run.hand_out()
            finally:
                run.users.remove(region)
            return
        del _running[run.key]
        try:
            run._route(run.layer.stop())
        finally:
            run.users.clear()


def hand_out(run: Running) -> None:
    """Hand out what `run` saw so far (a region reading its counts while it runs)."""
    with _lock:
        if run.users:
            run.hand_out()
