"""`no_host_sync` and `sync_recorder`: run the detection layers around a block or a step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import layers as _layers
from .layers.debug_mode import is_sync_error, record_error
from .records import Budget, HostSyncError, SyncRecord, count_by_kind, count_by_layer

# Region layers start outermost-first in this order and stop in reverse: the profiler's own
# syncs stay outside every other layer, the sentinel sits closest to the user code.
_ORDER = ("runtime_api", "debug_mode", "trace", "sentinel")

_default_spec: tuple[str, ...] | None = None
_listeners: list[Callable[[SyncCheck], None]] = []


def set_default_layers(spec) -> None:
    """What `layers=None` means in this process (the plugin's `--sync-layers`)."""
    global _default_spec
    _default_spec = _layers.parse_layers(spec)


def add_listener(fn: Callable[[SyncCheck], None]) -> None:
    _listeners.append(fn)


def remove_listener(fn: Callable[[SyncCheck], None]) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def resolve_layers(layers, *, watch: bool) -> tuple[list[str], dict[str, str]]:
    """(names to run, {name: reason} for requested layers that cannot run here)."""
    names = _layers.parse_layers(layers)
    if names is None:
        names = _default_spec
    if names is None:
        return list(_layers.default_layers(watch=watch)), {}
    run, skipped = [], {}
    for n in names:
        reason = _layers.unavailable_reason(n)
        if n == "sentinel" and not watch and reason is None:
            reason = "nothing watched"
        if reason is None:
            run.append(n)
        else:
            skipped[n] = reason
    return run, skipped


class SyncCheck:
    """A checked region: start the layers on enter, collect their records on exit."""

    def __init__(self, *, watch: Sequence = (), layers=None, budget=0, raise_on_sync: bool,
                 where: str = "", defer: bool = False):
        self.watch = tuple(watch) if not hasattr(watch, "untyped_storage") else (watch,)
        self.budget = Budget.of(budget)
        self.raise_on_sync = raise_on_sync
        self.where = where
        self.layer_names, self.unavailable = resolve_layers(layers, watch=bool(self.watch))
        self.records: list[SyncRecord] = []
        self._running: list = []
        self._sentinel = None
        self._defer = defer

    # -- results -------------------------------------------------------------------------
    @property
    def counts(self) -> dict[str, int]:
        """Records per kind (all layers)."""
        return count_by_kind(self.records)

    @property
    def by_layer(self) -> dict[str, int]:
        return count_by_layer(self.records)

    def count(self, kind: str | None = None, layer: str | None = None) -> int:
        return sum(1 for r in self.records
                   if (kind is None or r.kind == kind) and (layer is None or r.layer == layer))

    @property
    def violations(self) -> list[str]:
        return self.budget.violations(self.records)

    def mark(self, *tensors) -> None:
        """Watch more tensors (sentinel) from inside the region."""
        if self._sentinel is not None:
            self._sentinel.mark(*tensors)

    # -- region --------------------------------------------------------------------------
    def __enter__(self) -> SyncCheck:
        order = [n for n in _ORDER if n in self.layer_names]
        try:
            for name in order:
                cls = _layers.REGION_LAYERS[name]
                layer = cls(self.watch) if name == "sentinel" else cls()
                layer.start()
                self._running.append(layer)
                if name == "sentinel":
                    self._sentinel = layer
        except BaseException:
            self._stop_all()
            raise
        return self

    def _stop_all(self) -> None:
        while self._running:
            layer = self._running.pop()
            self.records.extend(layer.stop())
        self._sentinel = None

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._stop_all()
        suppress = False
        if exc is not None and is_sync_error(exc):
            self.records.append(record_error(exc))
            suppress = True
        if not self._defer:
            self.finish(exc)
        return suppress

    # -- steps ---------------------------------------------------------------------------
    def probe(self, step_fn: Callable[[], Any]) -> list[SyncRecord]:
        """Run the selected step probes (the capture probe) over `step_fn`."""
        found: list[SyncRecord] = []
        for name, cls in _layers.STEP_PROBES.items():
            if name in self.layer_names:
                found.extend(cls().probe(step_fn))
        self.records.extend(found)
        return found

    def finish(self, exc=None) -> None:
        """Report to the innermost listener (the running test); raise if over budget."""
        if _listeners:
            _listeners[-1](self)
        if self.raise_on_sync and self.violations:
            raise HostSyncError(self.records, self.budget, self.where,
                                unavailable=[f"{k} ({v})" for k, v in self.unavailable.items()]
                                ) from exc


def no_host_sync(*, watch: Sequence = (), layers=None, budget=0, where: str = "") -> SyncCheck:
    """Context manager: raise `HostSyncError` if the block syncs more than `budget` allows.

    `watch`: tensors that stand for device tensors (the sentinel follows them and all tensors
    computed from them). `layers`: names or "a,b" (default: every layer that can run here).
    """
    return SyncCheck(watch=watch, layers=layers, budget=budget, raise_on_sync=True, where=where)


def sync_recorder(*, watch: Sequence = (), layers=None, where: str = "") -> SyncCheck:
    """Context manager: the same layers, recording and counting by kind; never raises."""
    return SyncCheck(watch=watch, layers=layers, budget=0, raise_on_sync=False, where=where)


def check_step(step_fn: Callable[[], Any], *, watch: Sequence = (), layers=None, budget=0,
               warmup: int = 1, raise_on_sync: bool = True, where: str = "") -> SyncCheck:
    """Warm `step_fn` up, run it once under the region layers, then under the step probes."""
    for _ in range(warmup):
        step_fn()
    check = SyncCheck(watch=watch, layers=layers, budget=budget, raise_on_sync=raise_on_sync,
                      where=where, defer=True)
    with check:
        step_fn()
    check.probe(step_fn)
    check.finish()
    return check
