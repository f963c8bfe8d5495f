"""Nested checked regions on a GPU with every layer: one profiler session, each sync recorded once
in its innermost region, one HostSyncError, the debug mode and the profiler back as they were;
with threads and with exceptions inside."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_sparse_sync.testing import (
    HostSyncError,
    check_step,
    no_host_sync,
    run_isolated,
    sync_recorder,
)
from vllm_sparse_sync.testing.probes import make_input

pytestmark = pytest.mark.gpu

IN_PROCESS = "sentinel,debug_mode,runtime_api"


def _clean() -> None:
    assert torch.cuda.get_sync_debug_mode() == 0
    assert not torch.autograd.profiler._is_profiler_enabled
    assert torch._C._len_torch_function_stack() == 0
    assert torch.randn(4, device="cuda").shape == (4,)


def _with(records, text):
    return [r for r in records if text in r.code]


def test_nested_regions_share_every_layer_and_the_inner_one_raises_once():
    x = make_input("cuda")
    x.sum().item()
    torch.cuda.set_sync_debug_mode(0)
    with sync_recorder(watch=[x], layers=IN_PROCESS) as outer:
        with pytest.raises(HostSyncError) as err:
            with no_host_sync(watch=[x], layers=IN_PROCESS) as inner:
                int(x.max().item())  # the inner sync
        x.tolist()  # the outer sync
    _clean()
    assert set(inner.ran) == set(outer.ran) == {"sentinel", "debug_mode", "runtime_api"}
    inner_sync = _with(err.value.records, "# the inner sync")
    assert {r.layer for r in inner_sync} == {"sentinel", "debug_mode", "runtime_api"}, err.value.records
    assert not _with(outer.records, "# the inner sync"), outer.records  # recorded once
    assert {r.layer for r in _with(outer.records, "# the outer sync")} >= {"sentinel", "debug_mode"}
    for layer in ("sentinel", "debug_mode"):
        assert len([r for r in inner_sync if r.layer == layer]) == 1, inner_sync


def test_regions_three_deep_on_every_layer_leave_the_process_clean():
    x = make_input("cuda")
    x.sum().item()
    with no_host_sync(watch=[x], layers=IN_PROCESS):
        with no_host_sync(watch=[x], layers=IN_PROCESS):
            with no_host_sync(layers="debug_mode,runtime_api"):
                torch.cumsum(x, 0)
            x * 2
    _clean()


def test_an_exception_inside_nested_regions_leaves_the_process_clean():
    x = make_input("cuda")
    x.sum().item()
    with pytest.raises(ValueError, match="boom"):
        with no_host_sync(watch=[x], layers=IN_PROCESS):
            with no_host_sync(watch=[x], layers=IN_PROCESS):
                x * 2
                raise ValueError("boom")
    _clean()
    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=[x], layers=IN_PROCESS) as outer:
            with no_host_sync(watch=[x], layers=IN_PROCESS):
                x.sum().item()  # a sync, then the error
                raise ValueError("boom")
    assert isinstance(err.value.__cause__, ValueError)
    assert outer.records == []
    _clean()
    with pytest.raises(HostSyncError):  # the harness still works
        with no_host_sync(watch=[x], layers=IN_PROCESS):
            x.tolist()
    _clean()


def test_nested_regions_on_two_threads_record_each_sync_once():
    x = make_input("cuda")
    x.sum().item()
    started, go = threading.Event(), threading.Event()
    out: dict = {}

    def worker():
        y = make_input("cuda")
        try:
            with sync_recorder(watch=[y], layers=IN_PROCESS) as rec:
                started.set()
                go.wait(30)
                try:
                    with no_host_sync(watch=[y], layers=IN_PROCESS):
                        y.sum().item()  # the worker's sync
                except HostSyncError as exc:
                    out["err"] = exc
            out["rec"] = rec
        except BaseException as exc:  # noqa: BLE001
            out["crash"] = exc
            started.set()

    t = threading.Thread(target=worker, name="worker")
    with sync_recorder(watch=[x], layers=IN_PROCESS) as main:
        with no_host_sync(layers="debug_mode"):
            t.start()
            assert started.wait(30)
            go.set()
            t.join(60)
        x.tolist()  # the main thread's sync
    _clean()
    assert "crash" not in out, out.get("crash")
    worker_sync = _with(out["err"].records, "# the worker's sync")
    assert {r.layer for r in worker_sync} == {"sentinel", "debug_mode"}, out["err"].records
    assert {r.thread for r in worker_sync} == {"worker"}
    # the profiler runs for the main thread's region: the main thread's sync is named by that
    # thread's name (not the profiler's id), and nothing else it saw goes on that thread's account
    assert "runtime_api" in out["rec"].unavailable
    me = threading.current_thread().name
    main_api = [r for r in main.records if r.layer == "runtime_api"]
    mine = _with(main_api, "# the main thread's sync")
    assert mine and {r.thread for r in mine} == {me}, main_api
    assert all(r.thread != me for r in main_api if r not in mine), main_api
    debug = [r for r in main.records + out["rec"].records + out["err"].records if r.layer == "debug_mode"]
    assert len(_with(debug, "# the worker's sync")) == 1, debug  # one .item(): one sync, once
    assert _with(debug, "# the main thread's sync") and all(
        r in main.records for r in _with(debug, "# the main thread's sync")), debug


def test_check_step_inside_a_region_keeps_its_probe_out_of_the_region():
    x = make_input("cuda")

    def step():
        return torch.cumsum(x * 2, 0)

    step()
    with sync_recorder(watch=[x], layers=IN_PROCESS) as outer:
        check = check_step(step, layers="debug_mode,capture")
    _clean()
    assert check.records == [] and "capture" in check.ran
    assert outer.records == [], outer.records  # the probe's warm-up, capture and syncs are its own


def nested_in_trace():
    """Run by `run_isolated` under the trace, debug-mode and runtime-API layers."""
    x = make_input("cuda")
    try:
        with no_host_sync(layers="trace,debug_mode,runtime_api"):
            torch.cuda.synchronize()  # the inner device sync
    except HostSyncError as err:
        kinds = sorted((r.layer, r.kind) for r in err.records)
        assert ("trace", "device_sync") in kinds, kinds
    else:
        raise AssertionError("the inner region did not raise")
    ev = torch.cuda.Event()
    ev.record()
    ev.synchronize()  # the outer event sync
    return x


def test_nested_regions_under_the_trace_layer_in_a_subprocess():
    records = run_isolated(nested_in_trace, layers=("trace", "debug_mode", "runtime_api"))
    by_layer = sorted((r.layer, r.kind) for r in records)
    assert ("trace", "event_sync") in by_layer, records
    assert ("trace", "device_sync") not in by_layer, records  # the inner region's, recorded there
    assert all("the inner device sync" not in r.code for r in records), records
