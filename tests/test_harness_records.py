"""Records, budgets, HostSyncError, layer selection and GPU pinning (pure host logic)."""

from __future__ import annotations

import pickle

import pytest

from vllm_sparse_sync.testing import Budget, HostSyncError, SyncRecord
from vllm_sparse_sync.testing import layers as L
from vllm_sparse_sync.testing.guard import resolve_layers
from vllm_sparse_sync.testing.layers.runtime_api import classify_call, records_from_events
from vllm_sparse_sync.testing.xdist_pinning import (
    devices_for_worker,
    pin_worker,
    visible_devices,
    worker_index,
)


def rec(kind="stream_sync", layer="debug_mode", op="x"):
    return SyncRecord(kind=kind, layer=layer, op=op, location="a.py:1")


def test_budget_counts_each_layer_on_its_own():
    records = [rec(layer="debug_mode"), rec(layer="runtime_api")]
    assert Budget(1).violations(records) == []
    records.append(rec(layer="debug_mode"))
    assert Budget(1).violations(records) == ["debug_mode: 2 syncs > budget 1"]


def test_budget_by_kinds_and_mapping():
    records = [rec("device_sync"), rec("device_sync"), rec("stream_sync")]
    assert Budget(2, kinds=("device_sync",)).violations(records) == [
        "debug_mode: 1 stream_sync > budget 0 (kind not allowed)"]
    assert Budget(2, kinds="device_sync").kinds == ("device_sync",)
    assert Budget.of({"device_sync": 2, "stream_sync": 1}).violations(records) == []
    assert Budget.of({"device_sync": 1}).violations(records) == [
        "debug_mode: 2 device_sync > budget 1", "debug_mode: 1 stream_sync > budget 0"]
    with pytest.raises(ValueError):
        Budget(-1)
    with pytest.raises(TypeError):
        Budget.of("3")


def test_host_sync_error_is_an_assertion_and_pickles():
    err = HostSyncError([rec(op="Tensor.item")], 0, "step")
    assert isinstance(err, AssertionError)
    again = pickle.loads(pickle.dumps(err))
    assert again.records == err.records and str(again) == str(err)
    assert "[debug_mode] stream_sync Tensor.item at a.py:1" in str(err)


def test_record_round_trips_through_dict():
    r = rec()
    assert SyncRecord.from_dict(r.to_dict()) == r


def test_layer_names_are_checked():
    assert L.parse_layers("sentinel, capture") == ("sentinel", "capture")
    assert L.parse_layers("auto") is None
    with pytest.raises(ValueError, match="unknown sync layer 'nope'"):
        L.parse_layers(["nope"])


def test_unavailable_layers_are_reported_not_run(monkeypatch):
    monkeypatch.setattr(L.DebugModeLayer, "unavailable_reason", classmethod(lambda c: "no CUDA"))
    run, skipped = resolve_layers("sentinel,debug_mode", watch=True)
    assert run == ["sentinel"] and skipped == {"debug_mode": "no CUDA"}
    run, skipped = resolve_layers("sentinel", watch=False)
    assert run == [] and skipped["sentinel"].startswith("nothing watched")


def test_trace_layer_needs_an_opted_in_process(monkeypatch):
    monkeypatch.setattr("vllm_sparse_sync.testing.layers.trace.no_cuda_reason", lambda: None)
    monkeypatch.delenv("VLLM_SPARSE_SYNC_TRACE", raising=False)
    assert "irreversible" in L.TraceLayer.unavailable_reason()
    monkeypatch.setenv("VLLM_SPARSE_SYNC_TRACE", "1")
    assert L.TraceLayer.unavailable_reason() is None


def test_runtime_api_call_classification():
    assert classify_call("cudaStreamSynchronize") == "stream_sync"
    assert classify_call("cudaDeviceSynchronize") == "device_sync"
    assert classify_call("cudaEventSynchronize") == "event_sync"
    assert classify_call("cudaMemcpy") == "memcpy_sync"
    assert classify_call("cuMemcpyDtoH_v2") == "memcpy_sync"
    for clean in ("cudaMemcpyAsync", "cudaLaunchKernel", "cudaStreamWaitEvent", "cudaEventQuery"):
        assert classify_call(clean) is None


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Evt:
    def __init__(self, name, start, end, parent=None, stack=(), kernels=(), device="CPU"):
        self.name, self.time_range = name, _Range(start, end)
        self.cpu_parent, self.stack, self.kernels = parent, list(stack), list(kernels)
        self.device_type, self.thread = f"DeviceType.{device}", 1


class _Kernel:
    def __init__(self, name):
        self.name = name


def test_runtime_api_records_only_inside_the_region_and_attributes_stacks(tmp_path):
    src = tmp_path / "user.py"
    src.write_text("a = 1\nb = seq_lens.max().item()\n")
    region = _Evt("vllm_sparse_sync::checked_region", 10, 100)
    op = _Evt("aten::item", 20, 30, parent=region, stack=[f"{src}(2): build"])
    inner = _Evt("aten::_local_scalar_dense", 21, 29, parent=op)
    sync = _Evt("cudaStreamSynchronize", 22, 28, parent=inner)
    ext = _Evt("cudaDeviceSynchronize", 40, 41, parent=region)  # an extension: no stack
    copy = _Evt("aten::copy_", 50, 60, parent=region, stack=[f"{src}(1): build"],
                kernels=[_Kernel("Memcpy HtoD (Pageable -> Device)")])
    own = _Evt("cudaDeviceSynchronize", 200, 210)  # the profiler's own, after the region
    records = records_from_events([region, op, inner, sync, ext, copy, own])
    assert [r.kind for r in records] == ["stream_sync", "device_sync", "pageable_memcpy"]
    assert records[0].location.endswith("user.py:2")
    assert records[0].code == "b = seq_lens.max().item()"
    assert records[0].op == "cudaStreamSynchronize via aten::_local_scalar_dense"
    assert "no Python frame" in records[1].detail
    assert [r.attribution for r in records] == ["op", "region", "op"]
    assert "(line of the checked region)" in records[1].format()
    assert "(line of the checked region)" not in records[0].format()
    assert records_from_events([own]) == []


def test_pageable_copy_inside_a_synced_op_is_not_counted_twice():
    region = _Evt("vllm_sparse_sync::checked_region", 0, 100)
    op = _Evt("aten::_to_copy", 10, 20, parent=region,
              kernels=[_Kernel("Memcpy DtoH (Device -> Pageable)")])
    sync = _Evt("cudaStreamSynchronize", 12, 18, parent=op)
    assert [r.kind for r in records_from_events([region, op, sync])] == ["stream_sync"]


def test_worker_index_and_device_slices():
    assert worker_index("gw3") == 3 and worker_index(None) is None and worker_index("x") is None
    devs = ["0", "1", "2", "3"]
    assert devices_for_worker(0, devs) == ["0"]
    assert devices_for_worker(5, devs) == ["1"]
    assert devices_for_worker(1, devs, per_worker=2) == ["2", "3"]
    assert devices_for_worker(2, devs, per_worker=2) == ["0", "1"]
    assert devices_for_worker(0, []) == []


@pytest.fixture
def fresh_worker(monkeypatch):
    """A worker in which CUDA is not initialized yet (an earlier test here may have done it)."""
    import vllm_sparse_sync.testing.xdist_pinning as xp

    monkeypatch.setattr(xp, "cuda_initialized", lambda: False)


def test_pinning_uses_visible_devices_without_cuda(fresh_worker):
    env = {"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "4,6"}
    assert visible_devices(env) == ["4", "6"]
    msg = pin_worker(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "6" and "gw1 pinned" in msg
    env = {"PYTEST_XDIST_WORKER": "gw2", "CUDA_VISIBLE_DEVICES": "4,6"}
    pin_worker(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "4"
    assert pin_worker({}) == "not an xdist worker"


def test_pinning_counts_gpus_through_nvml_or_smi(monkeypatch, fresh_worker):
    import vllm_sparse_sync.testing.xdist_pinning as xp

    monkeypatch.setattr(xp, "_nvml_count", lambda: None)
    monkeypatch.setattr(xp, "_smi_count", lambda: 2)
    env = {"PYTEST_XDIST_WORKER": "gw3"}
    pin_worker(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setattr(xp, "_smi_count", lambda: None)
    env = {"PYTEST_XDIST_WORKER": "gw0"}
    assert "not pinned" in pin_worker(env) and "CUDA_VISIBLE_DEVICES" not in env


def test_pinning_does_not_initialize_cuda():
    """In a fresh process (this one may have initialized CUDA already)."""
    import subprocess
    import sys

    code = ("import torch; from vllm_sparse_sync.testing.xdist_pinning import pin_worker; "
            "pin_worker({'PYTEST_XDIST_WORKER': 'gw0'}); print(torch.cuda.is_initialized())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


def test_pinning_refuses_once_cuda_is_initialized(monkeypatch):
    import vllm_sparse_sync.testing.xdist_pinning as xp

    monkeypatch.setattr(xp, "cuda_initialized", lambda: True)
    env = {"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "4,6"}
    assert "already initialized" in pin_worker(env) and env["CUDA_VISIBLE_DEVICES"] == "4,6"


def test_user_frame_skips_the_warnings_module():
    import sys
    import warnings

    from vllm_sparse_sync.testing.records import user_frame

    seen = []

    def show(*args, **kwargs):
        seen.append(user_frame(sys._getframe(1)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        warnings.warn("x", stacklevel=1)  # the user line
    assert seen[0].code == 'warnings.warn("x", stacklevel=1)  # the user line'


def test_runtime_api_attributes_through_python_tracer_events(tmp_path):
    src = tmp_path / "ext_user.py"
    src.write_text("def step():\n    lib.cudaStreamSynchronize(s)\n")
    region = _Evt("vllm_sparse_sync::checked_region", 0, 100)
    py = _Evt(f"{src}(1): step", 5, 50, parent=region)
    py.is_python_function = True
    sync = _Evt("cudaStreamSynchronize", 10, 12, parent=py)
    (r,) = records_from_events([region, py, sync])
    assert r.location.endswith("ext_user.py:1") and r.function == "step"
    assert r.op == "cudaStreamSynchronize" and r.attribution == "function"


def test_runtime_api_attributes_through_op_marks_by_parent_or_by_time(tmp_path):
    from vllm_sparse_sync.testing.layers.runtime_api import OP_MARK
    from vllm_sparse_sync.testing.records import Frame

    frames = {0: Frame(str(tmp_path / "u.py"), 7, "build", "n = int(x.max())"),
              1: Frame(str(tmp_path / "u.py"), 9, "build", "y = x.tolist()")}
    region = _Evt("vllm_sparse_sync::checked_region", 0, 100)
    py = _Evt(f"{tmp_path / 'u.py'}(5): build", 1, 99, parent=region)
    py.is_python_function = True
    mark = _Evt(OP_MARK + "0", 10, 20, parent=py)
    op = _Evt("aten::_local_scalar_dense", 11, 19, parent=mark)
    linked = _Evt("cudaStreamSynchronize", 12, 13, parent=op)
    mark2 = _Evt(OP_MARK + "1", 30, 40, parent=py)
    unlinked = _Evt("cudaMemcpyAsync", 31, 32)  # not a sync kind: ignored
    orphan = _Evt("cudaStreamSynchronize", 33, 34)  # no parent link: found by time
    recs = records_from_events([region, py, mark, op, linked, mark2, unlinked, orphan],
                               op_frames=frames)
    assert [(r.location.rsplit(":", 1)[1], r.attribution) for r in recs] == [("7", "op"), ("9", "op")]
    assert recs[0].op == "cudaStreamSynchronize via aten::_local_scalar_dense"


def test_runtime_api_records_of_known_reads_or_in_allowed_ranges_are_allowed(tmp_path):
    from vllm_sparse_sync.testing.known import KnownRead, accept_known_reads, forget_known_reads
    from vllm_sparse_sync.testing.records import ALLOWED_MARK

    src = tmp_path / "upstream.py"
    src.write_text("a = 1\nb = seq_lens.max().item()\n")
    region = _Evt("vllm_sparse_sync::checked_region", 0, 100)
    op = _Evt("aten::item", 10, 20, parent=region, stack=[f"{src}(2): build"])
    sync = _Evt("cudaStreamSynchronize", 12, 18, parent=op)
    allowed = _Evt(ALLOWED_MARK, 30, 50, parent=region)
    ext = _Evt("cudaDeviceSynchronize", 40, 41, parent=region)  # inside the allowed range
    (known, inside) = records_from_events([region, op, sync, allowed, ext])
    assert known.allowed == "" and inside.allowed == "inside an allowed region"
    accept_known_reads([KnownRead("upstream.py", "build", code="b = seq_lens.max().item()",
                                  why="a known upstream read")])
    try:
        (known, inside) = records_from_events([region, op, sync, allowed, ext])
    finally:
        forget_known_reads()
    assert known.allowed == "a known upstream read" and known.known
    assert inside.allowed == "inside an allowed region" and not inside.known
    assert not Budget.of(0).violations([known, inside])


def test_runtime_api_leaves_out_the_harness_own_work_inside_the_region():
    from vllm_sparse_sync.testing.records import HARNESS_MARK

    region = _Evt("vllm_sparse_sync::checked_region", 0, 100)
    harness = _Evt(HARNESS_MARK, 10, 50, parent=region)  # e.g. a capture probe's synchronize
    own = _Evt("cudaDeviceSynchronize", 20, 21, parent=harness)
    other_thread = _Evt("cudaStreamSynchronize", 30, 31)
    other_thread.thread = 2  # another thread's sync at the same time still counts
    user = _Evt("cudaStreamSynchronize", 60, 61, parent=region)
    records = records_from_events([region, harness, own, other_thread, user])
    assert [r.kind for r in records] == ["stream_sync", "stream_sync"]


def test_runtime_api_names_threads_by_name_whatever_ids_the_profiler_gives():
    """Some torch builds number the profiler's threads from 1 rather than by native id: the
    region's thread is named by the region's own range; a native id is named from the harness's
    table; any other id says it is the profiler's."""
    region = _Evt("vllm_sparse_sync::checked_region", 0, 100)  # thread 1 (the profiler's id)
    own = _Evt("cudaStreamSynchronize", 10, 11, parent=region)
    native = _Evt("cudaStreamSynchronize", 20, 21)
    native.thread = 4242
    other = _Evt("cudaStreamSynchronize", 30, 31)
    other.thread = 7
    records = records_from_events([region, own, native, other], thread_names={4242: "worker"},
                                  region_thread="MainThread")
    assert [r.thread for r in records] == ["MainThread", "worker", "7"]
    assert [r.thread for r in records_from_events([region, own])] == ["1"]
