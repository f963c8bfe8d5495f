"""pytest plugin: fixtures, markers, options, report and summary of host syncs per test.

Hooks and options only; detection lives in `layers/`, the checked region in `guard.py`.
"""

from __future__ import annotations

import json
import os

import pytest

from .records import Budget, HostSyncError, SyncRecord, count_by_kind
from .xdist_pinning import pin_worker

PROPERTY = "vllm_sparse_sync.host_syncs"
WARNING_FILTERS = (
    r"ignore:.*[Ss]ynchronization debug mode is a prototype feature:UserWarning",
    r"ignore::UserWarning:torch\.(autograd\.)?profiler.*",
    r"ignore:.*The CUDA Graph is empty:UserWarning",
)
_KEY_CHECKS = pytest.StashKey[list]()
UNAVAILABLE_CHOICES = ("error", "skip")


def unavailable_policy(config) -> str:
    """"error" or "skip": the command line first, then the ini option."""
    value = config.getoption("sync_unavailable", None) or config.getini("sync_unavailable") or "error"
    if value not in UNAVAILABLE_CHOICES:
        raise pytest.UsageError(f"sync_unavailable: expected one of {', '.join(UNAVAILABLE_CHOICES)}, "
                                f"got {value!r}")
    return value


def pytest_addoption(parser):
    group = parser.getgroup("vllm-sparse-sync", "host-sync harness (vllm_sparse_sync.testing)")
    group.addoption("--sync-layers", default="auto", metavar="LAYERS",
                    help="comma-separated detection layers for no_host_sync/sync_recorder "
                         "(sentinel,debug_mode,trace,runtime_api,capture); default: auto, "
                         "every layer that can run here")
    group.addoption("--sync-unavailable", default=None, choices=UNAVAILABLE_CHOICES,
                    help="what a test does when none of its check's layers can run here: "
                         "error (default: the test fails, nothing was checked) or skip "
                         "(with the reason); ini: sync_unavailable")
    parser.addini("sync_unavailable", default="error",
                  help="error or skip: a check none of whose layers can run here "
                       "(--sync-unavailable overrides)")
    group.addoption("--sync-report", default=None, metavar="FILE",
                    help="write a JSON report of every sync seen, per test")
    group.addoption("--sync-backend", default="all", choices=("all", "b12x", "deepgemm"),
                    help="keep only the decode scenarios of this backend")
    group.addoption("--no-gpu-pinning", action="store_true", default=False,
                    help="do not pin each xdist worker to its own GPU")
    group.addoption("--gpus-per-worker", type=int, default=1, metavar="N",
                    help="GPUs each xdist worker gets when pinning (default 1)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if not config.getoption("no_gpu_pinning", False):
        config._vss_pinning = pin_worker(per_worker=config.getoption("gpus_per_worker", 1))
    else:
        config._vss_pinning = "GPU pinning disabled (--no-gpu-pinning)"
    config.addinivalue_line(
        "markers", "host_sync_budget(n=0, kinds=None): syncs allowed per checked region "
                   "(no_host_sync) and in total over sync_recorder regions of the test")
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (skipped with a reason where CUDA is absent)")
    config.addinivalue_line(
        "markers", "sync_backend(name): a decode scenario of this backend (--sync-backend)")
    for f in WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", f)
    from .guard import set_default_layers

    try:
        set_default_layers(config.getoption("sync_layers", "auto"))
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"--sync-layers: {exc}") from None
    config._vss_unavailable = unavailable_policy(config)
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(SyncSession(config), "vllm_sparse_sync_session")


def pytest_report_header(config):
    from .guard import resolve_layers

    spec = config.getoption("sync_layers")
    _, cannot = resolve_layers(None, watch=True)
    not_here = "; ".join(f"{k}: {v}" for k, v in cannot.items())
    return (f"vllm-sparse-sync: layers={spec}"
            + (f" (cannot run here: {not_here})" if not_here else "")
            + f", {getattr(config, '_vss_pinning', '')}")


def pytest_collection_modifyitems(config, items):
    backend = config.getoption("sync_backend", "all")
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("sync_backend")
        if backend != "all" and mark is not None and mark.args and mark.args[0] != backend:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    gpu_items = [i for i in items if i.get_closest_marker("gpu") is not None]
    if gpu_items:
        from .cuda_env import no_cuda_reason

        reason = no_cuda_reason()
        if reason:
            for item in gpu_items:
                item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))
    for item in items:
        for f in WARNING_FILTERS:
            item.add_marker(pytest.mark.filterwarnings(f))


def marker_budget(item) -> Budget | None:
    mark = item.get_closest_marker("host_sync_budget")
    if mark is None:
        return None
    n = mark.args[0] if mark.args else mark.kwargs.get("n", 0)
    return Budget(n=n, kinds=mark.kwargs.get("kinds"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    from .guard import add_listener, remove_listener

    checks: list = []
    item.stash[_KEY_CHECKS] = checks
    listener = checks.append
    add_listener(listener)
    try:
        return (yield)
    finally:
        remove_listener(listener)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    checks = item.stash.get(_KEY_CHECKS, [])
    budget = marker_budget(item)
    auto = None
    uses = set(getattr(item, "fixturenames", ()))
    if budget is not None and not uses & {"no_host_sync", "sync_recorder"}:
        from .cuda_env import no_cuda_reason
        from .guard import SyncCheck

        if no_cuda_reason() is None:
            auto = SyncCheck(raise_on_sync=False, where=item.nodeid)
            auto.__enter__()
    from .guard import SyncCheckUnavailable

    try:
        result = yield
    except SyncCheckUnavailable as exc:
        if getattr(item.config, "_vss_unavailable", "error") == "skip":
            pytest.skip(str(exc))
        raise
    finally:
        if auto is not None:
            auto.__exit__(None, None, None)
        _store(item, checks)
    if budget is not None:
        recorded = [r for c in checks if not c.raise_on_sync for r in c.records]
        violations = budget.violations(recorded)
        if violations:
            raise HostSyncError(recorded, budget, f"test {item.nodeid}", violations=violations)
    return result


def _store(item, checks) -> None:
    if not checks:
        return
    records = [r.to_dict() for c in checks for r in c.records]
    layers = sorted({n for c in checks for n in c.ran})
    item.user_properties.append((PROPERTY, {"records": records, "layers": layers,
                                            "regions": len(checks)}))


class SyncSession:
    """Per-run collector: records from every test, the terminal summary, the JSON report."""

    def __init__(self, config):
        self.config = config
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        if report.when != "call":
            return
        for name, value in getattr(report, "user_properties", ()):
            if name == PROPERTY:
                self.results[report.nodeid] = value

    def summary_rows(self) -> list[str]:
        rows = []
        for nodeid in sorted(self.results):
            data = self.results[nodeid]
            counts = count_by_kind(SyncRecord.from_dict(d) for d in data["records"])
            detail = ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
            rows.append(f"{nodeid}: {len(data['records'])} sync record(s) [{detail}] "
                        f"layers={','.join(data['layers']) or '-'}")
        return rows

    def pytest_terminal_summary(self, terminalreporter):
        if not self.results:
            return
        tr = terminalreporter
        tr.write_sep("=", "host sync summary (vllm_sparse_sync)")
        rows = self.summary_rows()
        limit = 60
        for row in rows[:limit]:
            tr.write_line(row)
        if len(rows) > limit:
            tr.write_line(f"... {len(rows) - limit} more tests (see --sync-report)")
        total = sum(len(v["records"]) for v in self.results.values())
        tr.write_line(f"{len(rows)} test(s) checked, {total} sync record(s) in total")

    def pytest_sessionfinish(self, session):
        path = self.config.getoption("sync_report", None)
        if not path:
            return
        out = {}
        for nodeid, data in sorted(self.results.items()):
            recs = [SyncRecord.from_dict(d) for d in data["records"]]
            out[nodeid] = {"counts": count_by_kind(recs), "layers": data["layers"],
                           "regions": data["regions"], "records": data["records"]}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"tests": out}, f, indent=2, sort_keys=True)


def _factory(request, raising: bool):
    from .guard import SyncCheck

    budget_mark = marker_budget(request.node)

    def make(*, watch=(), layers=None, budget=None, where=None):
        b = budget if budget is not None else (budget_mark if raising and budget_mark else 0)
        return SyncCheck(watch=watch, layers=layers, budget=b, raise_on_sync=raising,
                         where=where or request.node.nodeid)

    return make


@pytest.fixture
def no_host_sync(request):
    """`with no_host_sync(watch=[...]):` raises HostSyncError over budget (marker default)."""
    return _factory(request, raising=True)


@pytest.fixture
def sync_recorder(request):
    """`with sync_recorder(watch=[...]) as rec:` records; the marker budget applies per test."""
    return _factory(request, raising=False)
