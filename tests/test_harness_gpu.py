"""Every GPU layer against known-sync and clean ops; capture hygiene; isolated trace runs."""

from __future__ import annotations

import pytest
import torch

from vllm_sparse_sync.testing import (
    CaptureProbe,
    HostSyncError,
    decode_graph,
    no_host_sync,
    run_isolated,
    sync_recorder,
)
from vllm_sparse_sync.testing.probes import OPS, ext_device_sync, ext_stream_sync, make_input

pytestmark = pytest.mark.gpu

BY_NAME = {op.name: op for op in OPS}
DEBUG_SEES = ["x.sum().item()", "int(x[0])", "bool(x[0] > 0)", "x.tolist()", "x.cpu()",
              "x.nonzero()", "x[x > 2]", "masked_select", "unique", "bincount",
              "repeat_interleave(x, x)", "Stream.synchronize()"]
CLEAN = [op.name for op in OPS if op.expected is False]


def _recorded(name, layers, watch=False):
    op = BY_NAME[name]
    x = make_input("cuda")
    op.fn(x)
    with sync_recorder(layers=layers, watch=[x] if watch else ()) as rec:
        op.fn(x)
    return rec


@pytest.mark.parametrize("name", DEBUG_SEES)
def test_debug_mode_sees_torch_syncs_with_the_line(name):
    rec = _recorded(name, "debug_mode")
    assert rec.count(layer="debug_mode") >= 1
    assert all("test_harness_gpu.py" in r.location for r in rec.records), rec.records


@pytest.mark.parametrize("name", ["torch.cuda.synchronize()", "Event.synchronize()",
                                  "ctypes cudaStreamSynchronize"])
def test_debug_mode_misses_device_event_and_extension_syncs(name):
    assert _recorded(name, "debug_mode").records == []


@pytest.mark.parametrize("name", CLEAN)
def test_no_layer_flags_clean_ops(name):
    rec = _recorded(name, "sentinel,debug_mode,runtime_api", watch=True)
    assert rec.records == []
    x = make_input("cuda")
    assert CaptureProbe().probe(lambda: BY_NAME[name].fn(x)) == []


def test_runtime_api_counter_catches_extension_syncs_and_subtracts_its_own():
    with sync_recorder(layers="runtime_api") as empty:
        pass
    assert empty.records == []
    with sync_recorder(layers="runtime_api") as rec:
        ext_stream_sync()
        ext_device_sync()
    assert rec.counts == {"stream_sync": 1, "device_sync": 1}
    with sync_recorder(layers="runtime_api") as rec2:
        torch.cuda.synchronize()
        make_input("cuda").sum().item()
    assert rec2.counts.get("device_sync") == 1 and rec2.counts.get("stream_sync") == 1


def test_runtime_api_counter_fails_no_host_sync_on_extension_sync():
    with pytest.raises(HostSyncError, match="cudaStreamSynchronize"):
        with no_host_sync(layers="runtime_api"):
            ext_stream_sync()


def device_sync_step():
    x = make_input("cuda")
    y = x * 2
    torch.cuda.synchronize()  # injected device sync
    return y


def event_sync_step():
    x = make_input("cuda")
    ev = torch.cuda.Event()
    ev.record()
    ev.synchronize()  # injected event sync
    return x


def clean_step():
    x = make_input("cuda")
    return torch.cumsum(x * 2, 0)


def test_trace_recorder_catches_device_and_event_sync_in_a_subprocess():
    dev = run_isolated(device_sync_step)
    assert [r.kind for r in dev] == ["device_sync"]
    assert dev[0].code == "torch.cuda.synchronize()  # injected device sync"
    ev = run_isolated(event_sync_step)
    assert [r.kind for r in ev] == ["event_sync"]
    assert "ev.synchronize()" in ev[0].code
    assert run_isolated(clean_step) == []


def test_failed_capture_ends_cleanly_and_rng_works_after():
    x = make_input("cuda")

    def bad():
        y = x * 2
        torch.cuda.synchronize()  # invalidates the capture
        return y

    records = CaptureProbe().probe(bad)
    assert records and records[0].layer == "capture"
    assert "torch.cuda.synchronize()" in records[0].code
    assert torch.randn(4, device="cuda").shape == (4,)
    assert not torch.cuda.is_current_stream_capturing()
    item = CaptureProbe().probe(lambda: x.sum().item())
    assert [r.kind for r in item] == ["stream_sync"]
    torch.randn(4, device="cuda")
    ext = CaptureProbe().probe(ext_stream_sync)
    assert len(ext) == 1
    torch.randn(4, device="cuda")
    torch.cuda.synchronize()


def test_no_host_sync_on_gpu_runs_every_in_process_layer():
    x = make_input("cuda")
    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=[x]):
            _ = int(x.max().item())  # regression
    layers = {r.layer for r in err.value.records}
    assert {"sentinel", "debug_mode", "runtime_api"} <= layers
    assert all("int(x.max().item())" in r.code for r in err.value.records
               if r.layer in ("sentinel", "debug_mode"))
    assert torch.cuda.get_sync_debug_mode() == 0


def test_decode_graph_captures_replays_and_rejects_syncs():
    lens = make_input("cuda")
    out = torch.zeros(8, dtype=torch.int32, device="cuda")

    def step():
        out.copy_(torch.cumsum(lens, 0))
        return out

    g = decode_graph(step, inputs=[lens])
    assert g.captured
    res = g.check_against_eager(lambda i: lens.fill_(i + 1), cases=3,
                                reference=lambda: torch.cumsum(lens, 0), expect_change=True)
    assert [r["changed"] for r in res] == [True, True, True]

    def bad():
        return torch.arange(int(lens.max()), device="cuda")  # sizing from data

    with pytest.raises(HostSyncError, match=r"int\(lens.max\(\)\)"):
        decode_graph(bad)
    assert torch.randn(4, device="cuda").shape == (4,)


def test_debug_mode_is_restored_after_the_region():
    torch.cuda.set_sync_debug_mode(0)
    with sync_recorder(layers="debug_mode"):
        assert torch.cuda.get_sync_debug_mode() == 1
    assert torch.cuda.get_sync_debug_mode() == 0


# -- taint through buffer writes, pageable copies, attribution, on CUDA tensors -----------
from test_harness_taint import WRITES  # noqa: E402


@pytest.mark.parametrize("fn", WRITES, ids=lambda f: f.__name__)
def test_buffer_write_then_read_fails_sentinel_and_debug_mode_at_the_read(fn):
    x = torch.tensor([3, 1, 4, 1], dtype=torch.int64, device="cuda")
    fn(x)  # warm-up
    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=[x], layers="sentinel,debug_mode"):
            fn(x)
    by_layer = {}
    for r in err.value.records:
        by_layer.setdefault(r.layer, []).append(r)
    assert by_layer["sentinel"][0].code.endswith("# read"), by_layer["sentinel"]
    assert any(r.code.endswith("# read") for r in by_layer["debug_mode"]), by_layer["debug_mode"]


def test_pageable_non_blocking_copy_seen_by_sentinel_and_runtime_api_at_its_line():
    dev = torch.zeros(1 << 16, device="cuda")
    host = torch.ones(1 << 16)  # pageable
    dev.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    with sync_recorder(watch=[dev], layers="sentinel,runtime_api") as rec:
        dev.copy_(host, non_blocking=True)  # the pageable copy
    seen = {r.layer: r for r in rec.records if r.kind == "pageable_memcpy"}
    assert set(seen) == {"sentinel", "runtime_api"}, rec.records
    assert seen["sentinel"].code.endswith("# the pageable copy")
    assert seen["runtime_api"].attribution == "op"
    assert seen["runtime_api"].code.endswith("# the pageable copy")


def test_runtime_api_names_the_op_line_or_says_it_is_the_region_line():
    x = make_input("cuda")
    x.sum().item()
    with sync_recorder(layers="runtime_api") as rec:
        x.sum().item()  # the op's own line
        ext_stream_sync()
    by_kind = {r.op.split(" ")[0]: r for r in rec.records}
    item = next(r for r in rec.records if "item" in r.op or "local_scalar" in r.op)
    assert item.attribution == "op" and item.code.endswith("# the op's own line"), rec.records
    ext = [r for r in rec.records if r is not item]
    assert ext, by_kind
    for r in ext:  # the ctypes call: its own line if the profiler had a stack, else the with line
        want = "ext_stream_sync()" if r.attribution == "op" else 'with sync_recorder(layers="runtime_api")'
        assert r.code.startswith(want), r
