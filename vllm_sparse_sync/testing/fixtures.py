"""The harness's pytest fixtures and the `host_sync_budget` marker's enforcement."""

from __future__ import annotations

import pytest

from .records import Budget, HostSyncError


def marker_budget(item) -> Budget | None:
    """The test's `host_sync_budget(n, kinds=...)` marker as a Budget, or None."""
    mark = item.get_closest_marker("host_sync_budget")
    if mark is None:
        return None
    n = mark.args[0] if mark.args else mark.kwargs.get("n", 0)
    return Budget(n=n, kinds=mark.kwargs.get("kinds"))


def uses_harness_fixture(item) -> bool:
    return bool(set(getattr(item, "fixturenames", ())) & {"no_host_sync", "sync_recorder"})


def enforce_budget(item, budget: Budget, checks) -> None:
    """The marker's budget over every recorder region of the test (no_host_sync regions raise
    on their own)."""
    recorded = [r for c in checks if not c.raise_on_sync for r in c.records]
    violations = budget.violations(recorded)
    if violations:
        raise HostSyncError(recorded, budget, f"test {item.nodeid}", violations=violations)


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


NO_VLLM = 'needs vLLM: pip install -e ".[vllm]" (see the README\'s Checking vLLM)'


def vllm_case_params():
    """One `pytest.param` per path of vLLM's indexer builder; a skip where vLLM is missing."""
    try:
        from ..vllm import VLLM_PATHS
    except ModuleNotFoundError as exc:
        if exc.name != "vllm":
            raise
        return [pytest.param(None, marks=pytest.mark.skip(reason=NO_VLLM), id="no-vllm")]
    return [pytest.param(p, id=p) for p in VLLM_PATHS]


@pytest.fixture
def vllm_indexer_case(request):
    """vLLM's real indexer builder and a real `CommonAttentionMetadata` batch, one test per path
    (`case.build()`, `case.watch()`); the process is prepared for vLLM by `--sync-vllm`."""
    from ..vllm import make_vllm_case

    return make_vllm_case(request.param, seed=0)


@pytest.fixture(scope="session")
def multirank():
    """Run a function on N ranks of a torch.distributed group: `multirank.run(fn, *args,
    world_size=2, backend="gloo")` calls `fn(ctx, *args)` on every rank (spawned processes; gloo
    on CPUs, NCCL with one GPU per rank) and returns the per-rank results in rank order.

    `fn` is a module-level function (it is pickled by reference); `ctx` is a `RankContext`
    (`rank`, `world_size`, `backend`, `device`, `group`). A rank that raises fails the test with
    a `RankFailure` carrying that rank's traceback; every wait has a timeout (`timeout=`,
    seconds), so a hung rank fails instead of hanging; the rendezvous port is picked by the OS,
    so it works under `pytest -n`. Ranks are spawned once per (world size, backend) and reused
    for the session; NCCL with fewer GPUs than ranks skips the test with the reason.
    """
    from .multirank import MultiRank

    runner = MultiRank()
    yield runner
    runner.close()
