"""`no_host_sync` and `sync_recorder`: run the detection layers around a block or a step.

A check never passes by checking nothing: when none of the requested layers can run here,
entering it raises `SyncCheckUnavailable` (naming each layer and why), not a pass.

Regions nest, on any thread: a region entered inside another shares the layers that run
(`shared.py`), each sync is recorded once, in the innermost region of its thread, and only that
region raises for it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from . import layers as _layers
from . import shared as _shared
from .layers.sentinel import watch_list
from .records import (
    Budget,
    HostSyncError,
    SyncRecord,
    check_kind,
    count_by_kind,
    count_by_layer,
    harness_work,
    note_thread,
)

_default_spec: tuple[str, ...] | None = None
_listeners: list[Callable[[SyncCheck], None]] = []


class SyncCheckUnavailable(RuntimeError):
    """No requested detection layer can run here, so the check would check nothing.

    Not a `HostSyncError`: nothing synchronized, and nothing was checked either.
    ``reasons`` maps each requested layer to why it cannot run.
    """

    def __init__(self, reasons: dict[str, str], where: str = "", note: str = ""):
        self.reasons = dict(reasons)
        self.where = where
        head = (f"no sync detection layer can run here{' for ' + where if where else ''}, "
                f"so nothing would be checked")
        lines = [head + (f" ({note})" if note else "") + ":"]
        lines += [f"  {name}: {why}" for name, why in self.reasons.items()]
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (SyncCheckUnavailable, (self.reasons, self.where))


def set_default_layers(spec) -> None:
    """What `layers=None` means in this process (the plugin's `--sync-layers`)."""
    global _default_spec
    _default_spec = _layers.parse_layers(spec)


def default_layer_spec() -> tuple[str, ...] | None:
    """The layer names `layers=None` means in this process (None: every layer)."""
    return _default_spec


def add_listener(fn: Callable[[SyncCheck], None]) -> None:
    _listeners.append(fn)


def remove_listener(fn: Callable[[SyncCheck], None]) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def resolve_layers(layers, *, watch: bool) -> tuple[list[str], dict[str, str]]:
    """(names to run, {name: reason} for requested layers that cannot run here).

    `layers=None` means the process default (`--sync-layers`), else every layer there is.
    """
    names = _layers.parse_layers(layers)
    if names is None:
        names = _default_spec
    if names is None:
        names = _layers.ALL_LAYERS
    run, skipped = [], {}
    for n in dict.fromkeys(names):
        reason = _layers.unavailable_reason(n, watch=watch)
        if reason is None:
            run.append(n)
        else:
            skipped[n] = reason
    return run, skipped


class SyncCheck:
    """A checked region: start the layers on enter, collect their records on exit."""

    def __init__(self, *, watch: Sequence = (), layers=None, budget=0, raise_on_sync: bool,
                 where: str = "", defer: bool = False, info: dict | None = None,
                 allow: Callable[[SyncRecord], str] | None = None):
        self.watch = tuple(watch_list(watch))
        self.unwatched: tuple[str, ...] = tuple(getattr(watch, "unwatched", ()))
        """Device-standing tensors the watch left out (they share storage with a host twin)."""
        self.budget = Budget.of(budget)
        self.raise_on_sync = raise_on_sync
        self.where = where
        self.info = dict(info or {})
        """What the region checks, for reports (e.g. the vLLM builder and its call site)."""
        self.allow = allow
        """Why a record is allowed (shown, never counted), or "" (e.g. a test's own code that a
        checked library call ran)."""
        self.layer_names, self.unavailable = resolve_layers(layers, watch=bool(self.watch))
        self.records: list[SyncRecord] = []
        self.thread_name = ""
        self._running: list[_shared.Running] = []
        self._sentinel: _shared.Running | None = None
        self._defer = defer
        self._touched: int | None = None
        self.ran: list[str] = []
        """The layers that actually ran (region layers, then step probes)."""

    # -- results -------------------------------------------------------------------------
    @property
    def counts(self) -> dict[str, int]:
        """Records per kind (all layers)."""
        return count_by_kind(self.records)

    @property
    def by_layer(self) -> dict[str, int]:
        return count_by_layer(self.records)

    def count(self, kind: str | None = None, layer: str | None = None) -> int:
        """Records of `kind` (one of `KINDS`) seen by `layer` (a layer name); None: any."""
        if kind is not None:
            check_kind(kind)
        if layer is not None:
            _layers.layer_class(layer)
        return sum(1 for r in self.records
                   if (kind is None or r.kind == kind) and (layer is None or r.layer == layer))

    @property
    def violations(self) -> list[str]:
        return self.budget.violations(self.records)

    @property
    def touched(self) -> int | None:
        """Ops and launches in the region that used watched data (sentinel); None without it."""
        if self._sentinel is not None:
            _shared.hand_out(self._sentinel)
        return self._touched

    def mark(self, *tensors) -> None:
        """Watch more tensors (sentinel) from inside the region."""
        if self._sentinel is not None:
            self._sentinel.layer.mark(*tensors)

    @contextmanager
    def unchecked(self) -> Iterator[None]:
        """A block whose host reads are not the code under check (a CPU reference standing in
        for device kernels): the sentinel pauses inside; mark its outputs after, if they count."""
        watcher = self._sentinel.layer if self._sentinel is not None else None
        if watcher is None:
            yield
            return
        watcher.pause()
        try:
            yield
        finally:
            watcher.resume()

    def _region_layers(self) -> list[str]:
        return [n for n in self.layer_names if n in _layers.REGION_LAYERS]

    def _probes(self) -> list[str]:
        return [n for n in self.layer_names if n in _layers.STEP_PROBES]

    def _require(self, *, with_probes: bool) -> None:
        """Raise `SyncCheckUnavailable` when nothing would be checked."""
        if self._region_layers() or (with_probes and self._probes()):
            return
        reasons = dict(self.unavailable)
        note = ""
        if not with_probes:
            for n in _layers.STEP_PROBES:
                if n in reasons or n in self._probes():
                    here = f" (and here: {reasons[n]})" if n in reasons else ""
                    reasons[n] = f"a step probe: it runs only through check_step(step_fn){here}"
        requested = list(reasons)
        if not requested:
            reasons = {"(none)": "no layer was requested"}
        elif set(requested) != set(_layers.ALL_LAYERS):
            note = f"requested: {', '.join(requested)}"
        raise SyncCheckUnavailable(reasons, self.where, note)

    # -- region --------------------------------------------------------------------------
    def __enter__(self) -> SyncCheck:
        self._require(with_probes=self._defer)
        self._start()
        return self

    def _start(self) -> None:
        self.thread_name = threading.current_thread().name
        note_thread()
        order = sorted(self._region_layers(), key=lambda n: _layers.REGION_LAYERS[n].order)
        try:
            for name in order:
                cls = _layers.REGION_LAYERS[name]
                try:
                    run = _shared.join(self, name, self.watch if cls.needs_watch else ())
                except _shared.NotJoinable as exc:
                    self.layer_names.remove(name)
                    self.unavailable[name] = str(exc)
                    continue
                self._running.append(run)
                self.ran.append(name)
                if cls.needs_watch:  # the layer that follows watched data
                    self._sentinel = run
                    self._touched = 0
            self._require(with_probes=self._defer)
        except BaseException:
            self._stop_all()
            raise

    def _stop_all(self) -> None:
        try:
            while self._running:
                _shared.leave(self, self._running.pop())
        finally:
            self._running.clear()
            self._sentinel = None

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._stop_all()
        suppress = False
        if exc is not None:
            for name in self._region_layers():
                rec = _layers.REGION_LAYERS[name].record_exception(exc)
                if rec is not None:
                    self.records.append(rec)
                    suppress = True
                    break
        if not self._defer:
            self.finish(exc)
        return suppress

    # -- steps ---------------------------------------------------------------------------
    def probe(self, step_fn: Callable[[], Any]) -> list[SyncRecord]:
        """Run the selected step probes (the capture probe) over `step_fn`."""
        found: list[SyncRecord] = []
        for name in self._probes():
            found.extend(_layers.STEP_PROBES[name]().probe(step_fn))
            self.ran.append(name)
        self.records.extend(found)
        return found

    def finish(self, exc=None) -> None:
        """Report to the innermost listener (the running test); raise if over budget (unless a
        region inside this one already raises for its syncs)."""
        if self.allow is not None:
            self.records = [dataclasses.replace(r, allowed=why) if not r.allowed and (why := self.allow(r))
                            else r for r in self.records]
        if _listeners:
            _listeners[-1](self)
        if isinstance(exc, HostSyncError):
            return
        if self.raise_on_sync and self.violations:
            raise HostSyncError(self.records, self.budget, self.where,
                                unavailable=[f"{k} ({v})" for k, v in self.unavailable.items()]
                                ) from exc


def no_host_sync(*, watch: Sequence = (), layers=None, budget=0, where: str = "") -> SyncCheck:
    """Context manager: raise `HostSyncError` if the block syncs more than `budget` allows.

    `watch`: tensors that stand for device tensors (the sentinel follows them and all tensors
    computed from them or written with their data). `layers`: names or "a,b" (default: every
    layer that can run here). Entering raises `SyncCheckUnavailable` when no layer can run.
    """
    return SyncCheck(watch=watch, layers=layers, budget=budget, raise_on_sync=True, where=where)


def sync_recorder(*, watch: Sequence = (), layers=None, where: str = "") -> SyncCheck:
    """Context manager: the same layers, recording and counting by kind; never raises a
    `HostSyncError` (entering still refuses a check no layer can run)."""
    return SyncCheck(watch=watch, layers=layers, budget=0, raise_on_sync=False, where=where)


def check_step(step_fn: Callable[[], Any], *, watch: Sequence = (), layers=None, budget=0,
               warmup: int = 1, raise_on_sync: bool = True, where: str = "") -> SyncCheck:
    """Warm `step_fn` up, run it once under the region layers, then under the step probes."""
    check = SyncCheck(watch=watch, layers=layers, budget=budget, raise_on_sync=raise_on_sync,
                      where=where, defer=True)
    check._require(with_probes=True)
    with harness_work():  # not checked, by this region or any around it
        for _ in range(warmup):
            step_fn()
    if check._region_layers():
        with check:
            step_fn()
    check.probe(step_fn)
    check.finish()
    return check
