"""pytest plugin of the harness: options, ini values and hooks only.

A guest in every project that installs the package: nothing changes until the project asks.
GPU pinning per xdist worker (`--sync-pin-gpus` / `sync_pin_gpus`), skipping `gpu`-marked tests
where CUDA is absent (`sync_gpu_marker`) and filtering torch's prototype and profiler warnings
(`sync_filter_warnings`) are opt-in, and so is vLLM mode (`--sync-vllm`, `vllm_mode.py`); fixtures
live in `fixtures.py`, reporting in `report.py`, detection in `layers/`, the checked region in
`guard.py`.
"""

from __future__ import annotations

import pytest

from .fixtures import (
    enforce_budget,
    marker_budget,
    multirank,
    no_host_sync,
    sync_recorder,
    uses_harness_fixture,
    vllm_case_params,
    vllm_indexer_case,
)
from .report import SyncSession, store_checks

__all__ = ["multirank", "no_host_sync", "sync_recorder", "vllm_indexer_case"]

WARNING_FILTERS = (
    r"ignore:.*[Ss]ynchronization debug mode is a prototype feature:UserWarning",
    r"ignore::UserWarning:torch\.(autograd\.)?profiler.*",
    r"ignore:.*The CUDA Graph is empty:UserWarning",
)
UNAVAILABLE_CHOICES = ("error", "skip")
_KEY_CHECKS = pytest.StashKey[list]()
_KEY_STORED = pytest.StashKey[int]()


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
    group.addoption("--sync-report", default=None, metavar="FILE",
                    help="write a JSON report of every sync seen, per test")
    group.addoption("--sync-backend", default="all", choices=("all", "b12x", "deepgemm"),
                    help="keep only the decode scenarios of this backend")
    group.addoption("--sync-pin-gpus", action="store_true", default=None,
                    help="pin each xdist worker to its own GPU(s) before CUDA initializes "
                         "(ini: sync_pin_gpus)")
    group.addoption("--gpus-per-worker", type=int, default=1, metavar="N",
                    help="GPUs each xdist worker gets when pinning (default 1)")
    group.addoption("--sync-vllm", action="store_true", default=None,
                    help="vLLM mode: prepare the process for vLLM before the first conftest (CPU platform "
                         "and Triton interpreter where CUDA is absent), check every vLLM attention-metadata "
                         "build() as a region, record vLLM's gpu_sync_allowed() syncs as allowed, accept "
                         "known upstream reads; the run fails if no build was checked (ini: sync_vllm)")
    parser.addini("sync_vllm", type="bool", default=False, help="vLLM mode (--sync-vllm)")
    parser.addini("sync_vllm_baseline", default="",
                  help="known upstream vLLM syncs to accept in vLLM mode: a JSON list of {file, function, "
                       "code, why, link}; default: the ones found in vLLM 0.33")
    parser.addini("sync_unavailable", default="error",
                  help="error or skip: a check none of whose layers can run here "
                       "(--sync-unavailable overrides)")
    parser.addini("sync_pin_gpus", type="bool", default=False,
                  help="pin each xdist worker to its own GPU(s) (--sync-pin-gpus)")
    parser.addini("sync_gpu_marker", type="bool", default=False,
                  help="register the `gpu` marker and skip its tests, with a reason, where CUDA "
                       "is absent")
    parser.addini("sync_filter_warnings", type="bool", default=False,
                  help="filter torch's sync-debug prototype and profiler warnings (for -W error)")


def unavailable_policy(config) -> str:
    """"error" or "skip": the command line first, then the ini option."""
    value = config.getoption("sync_unavailable", None) or config.getini("sync_unavailable") or "error"
    if value not in UNAVAILABLE_CHOICES:
        raise pytest.UsageError(f"sync_unavailable: expected one of {', '.join(UNAVAILABLE_CHOICES)}, "
                                f"got {value!r}")
    return value


def _pin_requested(config) -> bool:
    flag = config.getoption("sync_pin_gpus", None)
    return bool(flag) or bool(config.getini("sync_pin_gpus"))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    from . import vllm_mode

    if vllm_mode.requested(early_config):
        vllm_mode.early(early_config)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config._vss_pinning = None
    if _pin_requested(config):
        from .xdist_pinning import pin_worker

        config._vss_pinning = pin_worker(per_worker=config.getoption("gpus_per_worker", 1))
    config.addinivalue_line(
        "markers", "host_sync_budget(n=0, kinds=None): syncs allowed per checked region "
                   "(no_host_sync) and in total over sync_recorder regions of the test")
    config.addinivalue_line(
        "markers", "sync_backend(name): a decode scenario of this backend (--sync-backend)")
    if config.getini("sync_gpu_marker"):
        config.addinivalue_line(
            "markers", "gpu: needs a CUDA device (skipped with a reason where CUDA is absent)")
    from . import vllm_mode
    from .guard import default_layer_spec, set_default_layers
    from .known import known_reads

    # process-wide state this run sets, put back at unconfigure (in-process runs nest)
    config._vss_saved = (default_layer_spec(), known_reads())
    try:
        set_default_layers(config.getoption("sync_layers", "auto"))
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"--sync-layers: {exc}") from None
    config._vss_unavailable = unavailable_policy(config)
    controller = not hasattr(config, "workerinput")
    distributing = controller and getattr(config.option, "dist", "no") != "no"
    config._vss_vllm = None
    if vllm_mode.requested(config):
        vllm_mode.enter(config, runs_tests=not distributing)
    if controller:  # the controller (or a run without xdist)
        config.pluginmanager.register(SyncSession(config), "vllm_sparse_sync_session")


def pytest_unconfigure(config):
    saved = getattr(config, "_vss_saved", None)
    if saved is None:
        return
    from . import vllm_mode
    from .guard import set_default_layers
    from .known import accept_known_reads, forget_known_reads

    vllm_mode.leave(config)
    spec, reads = saved
    set_default_layers(spec)
    forget_known_reads()
    accept_known_reads(reads)


def pytest_generate_tests(metafunc):
    if "vllm_indexer_case" in metafunc.fixturenames:
        metafunc.parametrize("vllm_indexer_case", vllm_case_params(), indirect=True)


def pytest_report_header(config):
    spec = config.getoption("sync_layers")
    vllm = getattr(config, "_vss_vllm", None)
    opted_in = (spec != "auto" or config._vss_pinning is not None or config.getini("sync_gpu_marker")
                or config.getoption("sync_unavailable", None) or vllm is not None)
    if not opted_in:
        return None
    from .guard import resolve_layers

    run, cannot = resolve_layers(None, watch=True)
    by_reason: dict[str, list[str]] = {}
    for name, why in cannot.items():  # one clause a reason: the layers it rules out, then why
        by_reason.setdefault(why, []).append(name)
    not_here = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())
    pinning = f", {config._vss_pinning}" if config._vss_pinning else ""
    lines = [f"vllm-sparse-sync: layers {','.join(run) or 'none'}" + (f" (not here: {not_here})" if not_here else "")
             + pinning]
    if vllm is not None:
        lines.append(f"vllm-sparse-sync: --sync-vllm ({vllm['setup']}): every vLLM metadata build() is "
                     "a checked region")
    return lines


def pytest_collection_modifyitems(config, items):
    backend = config.getoption("sync_backend", "all")
    if backend != "all":
        keep, drop = [], []
        for item in items:
            mark = item.get_closest_marker("sync_backend")
            (drop if mark is not None and mark.args and mark.args[0] != backend else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if config.getini("sync_filter_warnings"):  # per test: above -W on the command line
        for item in items:
            for f in WARNING_FILTERS:
                item.add_marker(pytest.mark.filterwarnings(f))
    if config.getini("sync_gpu_marker"):
        gpu_items = [i for i in items if i.get_closest_marker("gpu") is not None]
        if gpu_items:
            from .cuda_env import no_cuda_reason

            reason = no_cuda_reason()
            if reason:
                for item in gpu_items:
                    item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    from .guard import add_listener, remove_listener

    checks: list = []
    item.stash[_KEY_CHECKS] = checks
    item.stash[_KEY_STORED] = 0
    listener = checks.append
    add_listener(listener)
    try:
        return (yield)
    finally:
        remove_listener(listener)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    checks = item.stash.get(_KEY_CHECKS, None)
    if checks is not None:  # this phase's regions travel on its report (and across xdist)
        stored = item.stash.get(_KEY_STORED, 0)
        store_checks(item, checks[stored:], call.when)
        item.stash[_KEY_STORED] = len(checks)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    from .guard import SyncCheck, SyncCheckUnavailable

    checks = item.stash.get(_KEY_CHECKS, [])
    budget = marker_budget(item)
    auto = None
    try:
        if budget is not None and not uses_harness_fixture(item):
            # a budget marker on a test without the fixtures: the whole test is the region
            auto = SyncCheck(raise_on_sync=False, where=item.nodeid)
            auto.__enter__()
        result = yield
    except SyncCheckUnavailable as exc:
        if item.config._vss_unavailable == "skip":
            pytest.skip(str(exc))
        raise
    finally:
        if auto is not None and auto._running:
            auto.__exit__(None, None, None)
    if budget is not None:
        enforce_budget(item, budget, checks)
    return result
