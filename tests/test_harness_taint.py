"""Taint follows storage: data written into any view of a buffer taints the buffer, and a later
read of any view of it is a host read. Also: checks that cannot check anything refuse to pass,
and usage errors are clear."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_sparse_sync.testing import (
    Budget,
    HostSyncError,
    SyncCheckUnavailable,
    check_step,
    device_tensors,
    no_host_sync,
    sync_recorder,
)
from vllm_sparse_sync.testing.cuda_env import no_cuda_reason
from vllm_sparse_sync.testing.records import PAGEABLE_MEMCPY

I64 = torch.int64


def _dev():
    return torch.tensor([3, 1, 4, 1], dtype=I64)


# Each writes watched data into a buffer through some view, then reads the buffer on the line
# marked "# read".
def cumsum_out(x):
    buf = torch.zeros(5, dtype=I64, device=x.device)
    torch.cumsum(x, 0, out=buf[1:])
    return int(buf[-1].item())  # read


def setitem_all(x):
    buf = torch.zeros(4, dtype=I64, device=x.device)
    buf[:] = x
    return buf.max().item()  # read


def setitem_ellipsis(x):
    buf = torch.zeros(4, dtype=I64, device=x.device)
    buf[...] = x
    return buf.tolist()  # read


def copy_into_view(x):
    buf = torch.zeros(6, dtype=I64, device=x.device)
    buf[:4].copy_(x)
    return buf.sum().item()  # read


def diff_out(x):
    buf = torch.zeros(6, dtype=I64, device=x.device)
    torch.diff(x, out=buf[:3])
    return buf[5].item()  # read


def index_put(x):
    buf = torch.zeros(6, dtype=I64, device=x.device)
    buf.index_put_((torch.arange(2, device=x.device),), x[:2])
    return int(buf[5])  # read


def index_put_by_tensor_index(x):
    buf = torch.zeros(6, dtype=I64, device=x.device)
    buf[torch.arange(2, 4, device=x.device)] = x[:2]
    return int(buf[0])  # read


def index_by_watched_positions(x):
    buf = torch.zeros(6, dtype=I64, device=x.device)
    buf[x] = 7  # where the 7s land depends on device data
    return buf.tolist()  # read


def scatter(x):
    buf = torch.zeros(6, dtype=I64, device=x.device)
    buf.scatter_(0, torch.arange(2, device=x.device), x[:2])
    return bool(buf[4] == 0)  # read


def masked_fill_from_0d(x):
    buf = torch.zeros(6, dtype=I64, device=x.device)
    buf.masked_fill_(torch.arange(6, device=x.device) > 2, x[0])
    return float(buf[0])  # read


def fill_from_0d(x):
    buf = torch.zeros(6, dtype=I64, device=x.device)
    buf[2:4].fill_(x[0])
    return int(buf[5])  # read


def views_of_views(x):
    buf = torch.zeros(12, dtype=I64, device=x.device)
    buf.view(3, 4)[1:][0][1:3].copy_(x[:2])
    return buf[::3].tolist()  # read


def inplace_add(x):
    buf = torch.zeros(4, dtype=I64, device=x.device)
    buf.add_(x)
    return buf.cpu()  # read


def sort_into_out_tuple(x):
    vals, idx = torch.empty(4, dtype=I64, device=x.device), torch.empty(4, dtype=I64, device=x.device)
    torch.sort(x, out=(vals, idx))
    return idx.tolist()  # read


def written_in_one_call_read_in_the_next(x):
    class Builder:
        def __init__(self):
            self.buf = torch.zeros(8, dtype=I64, device=x.device)

        def build(self, lens):
            self.buf[: lens.shape[0]].copy_(lens)

        def bound(self):
            return int(self.buf.max())  # read

    b = Builder()
    b.build(x)
    b.build(torch.arange(1, 3, dtype=I64, device=x.device))  # a later call writes clean data over part of it
    return b.bound()


WRITES = [cumsum_out, setitem_all, setitem_ellipsis, copy_into_view, diff_out, index_put,
          index_put_by_tensor_index, index_by_watched_positions, scatter, masked_fill_from_0d,
          fill_from_0d, views_of_views, inplace_add, sort_into_out_tuple,
          written_in_one_call_read_in_the_next]


@pytest.mark.parametrize("fn", WRITES, ids=lambda f: f.__name__)
def test_reads_of_buffers_written_with_watched_data_fail_naming_the_line(fn):
    x = _dev()
    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=[x], layers="sentinel"):
            fn(x)
    first = err.value.records[0]
    assert first.code.endswith("# read"), first
    assert "test_harness_taint.py" in first.location


@pytest.mark.parametrize("fn", WRITES, ids=lambda f: f.__name__)
def test_the_same_code_on_host_data_is_clean(fn):
    with no_host_sync(watch=[torch.zeros(1)], layers="sentinel") as check:
        fn(_dev())  # a host tensor: nothing watched flows into the buffer
    assert check.records == []


def test_writes_of_clean_data_into_a_watched_buffer_keep_it_watched_and_others_clean():
    buf = torch.zeros(8, dtype=I64)
    other = torch.zeros(8, dtype=I64)
    with sync_recorder(watch=[buf], layers="sentinel") as rec:
        buf[:4].copy_(torch.arange(4))  # clean data into a device buffer
        other.copy_(torch.arange(8))  # a host buffer written with host data
        other.tolist()
        buf[4:].tolist()
    assert [r.op for r in rec.records] == ["Tensor.tolist"]
    assert rec.records[0].code == "buf[4:].tolist()"


# -- random view chains, writes and reads -------------------------------------------------
VIEWS = {
    "slice": lambda b: b[1:] if b.shape[0] > 1 else b,  # every view keeps an element to write
    "step": lambda b: b[::2],
    "narrow": lambda b: b.narrow(0, 0, max(1, b.shape[0] - 1)),
    "view2d": lambda b: b.view(2, -1)[0] if b.shape[0] % 2 == 0 and b.is_contiguous() else b,
    "flip_select": lambda b: b[:],
}
WRITE_OPS = {
    "copy_": lambda v, x: v[:1].copy_(x[:1]),
    "setitem": lambda v, x: v.__setitem__(0, x[0]),
    "cumsum_out": lambda v, x: torch.cumsum(x[:1], 0, out=v[:1]),
    "index_put_": lambda v, x: v.index_put_((torch.tensor([0]),), x[:1]),
    "scatter_": lambda v, x: v.scatter_(0, torch.tensor([0]), x[:1]),
    "masked_fill_": lambda v, x: v.masked_fill_(torch.ones_like(v, dtype=torch.bool), x[0]),
    "fill_": lambda v, x: v.fill_(x[0]),
    "add_": lambda v, x: v.add_(x[0]),
    "clamp_max_": lambda v, x: v.clamp_(max=x[0]),
    "diff_out": lambda v, x: torch.diff(x[:2], out=v[:1]),
}
READ_OPS = {
    "item": lambda b: b.sum().item(),
    "int": lambda b: int(b[0]),
    "tolist": lambda b: b.tolist(),
    "cpu": lambda b: b.cpu(),
    "nonzero": lambda b: b.nonzero(),
    "bool": lambda b: bool(b.any()),
}


@given(views=st.lists(st.sampled_from(sorted(VIEWS)), max_size=4),
       write=st.sampled_from(sorted(WRITE_OPS)),
       read_views=st.lists(st.sampled_from(sorted(VIEWS)), max_size=3),
       read=st.sampled_from(sorted(READ_OPS)),
       size=st.sampled_from([8, 12, 16]))
@example(views=["step", "step", "narrow", "slice"], write="scatter_", read_views=[], read="bool", size=8)
def test_any_write_through_any_view_taints_every_view(views, write, read_views, read, size):
    x = torch.tensor([5, 2, 7, 1], dtype=I64)
    for watched in (True, False):
        buf = torch.zeros(size, dtype=I64)
        with sync_recorder(watch=[x] if watched else [torch.zeros(1)], layers="sentinel") as rec:
            v = buf
            for name in views:
                v = VIEWS[name](v)
            WRITE_OPS[write](v, x)
            r = buf
            for name in read_views:
                r = VIEWS[name](r)
            READ_OPS[read](r)
        assert (len(rec.records) == 1) is watched, rec.records


# -- pageable copies, custom ops ----------------------------------------------------------
def test_non_blocking_copy_from_pageable_memory_into_a_watched_tensor_is_recorded():
    dev = torch.zeros(4, dtype=I64)
    with sync_recorder(watch=[dev], layers="sentinel") as rec:
        dev.copy_(torch.arange(4), non_blocking=True)  # pageable source
        dev.copy_(torch.arange(4))  # blocking H2D: not a pageable async copy
        torch.zeros(4, dtype=I64).copy_(torch.arange(4), non_blocking=True)  # host to host
    assert rec.counts == {PAGEABLE_MEMCPY: 1}
    assert rec.records[0].code == "dev.copy_(torch.arange(4), non_blocking=True)  # pageable source"


_LIB = torch.library.Library("vss_taint_test", "DEF")
_LIB.define("scribble(Tensor src, Tensor dst) -> ()")  # writes dst, but the schema does not say so


def _scribble(src, dst):
    dst.copy_(src)


_LIB.impl("scribble", _scribble, "CompositeExplicitAutograd")


def test_a_custom_op_with_a_watched_input_taints_all_its_tensor_arguments():
    x = _dev()
    with sync_recorder(watch=[x], layers="sentinel") as rec:
        out = torch.zeros(4, dtype=I64)
        torch.ops.vss_taint_test.scribble(x, out)
        out.tolist()
        clean = torch.zeros(4, dtype=I64)
        torch.ops.vss_taint_test.scribble(torch.arange(4), clean)
        clean.tolist()
    assert [r.code for r in rec.records] == ["out.tolist()"]


# -- checks that could check nothing ------------------------------------------------------
cpu_only = pytest.mark.skipif(no_cuda_reason() is None, reason="this host has CUDA: GPU layers run")


@cpu_only
def test_nothing_watched_on_a_cpu_host_is_not_a_pass():
    ran = []
    with pytest.raises(SyncCheckUnavailable) as err:
        with no_host_sync():
            ran.append(1)
    assert ran == []
    msg = str(err.value)
    assert not isinstance(err.value, HostSyncError)
    assert "sentinel: nothing watched" in msg and "debug_mode:" in msg and "capture:" in msg


@cpu_only
def test_a_gpu_layer_alone_on_a_cpu_host_is_not_a_pass():
    with pytest.raises(SyncCheckUnavailable, match=r"debug_mode: torch .* without CUDA"):
        with sync_recorder(layers="debug_mode", watch=[_dev()]):
            pass
    with pytest.raises(SyncCheckUnavailable, match="requested: runtime_api, capture"):
        with no_host_sync(layers="runtime_api,capture"):
            pass


@cpu_only
def test_check_step_with_no_runnable_layer_raises_before_running_the_step():
    calls = []
    with pytest.raises(SyncCheckUnavailable):
        check_step(lambda: calls.append(1), layers="debug_mode")
    assert calls == []


def test_a_step_probe_alone_cannot_check_a_with_block():
    with pytest.raises(SyncCheckUnavailable, match=r"capture: a step probe: .*check_step\(step_fn\)"):
        with no_host_sync(layers="capture", watch=[_dev()]):
            pass


def test_partially_available_layers_run_and_say_what_did_not():
    x = _dev()
    with pytest.raises(HostSyncError) as err:
        with no_host_sync(layers="sentinel,debug_mode,trace", watch=[x]) as check:
            x.tolist()
            _dev().tolist()
    if no_cuda_reason() is not None:
        assert "debug_mode" in check.unavailable
        assert "layers not run: debug_mode" in str(err.value)


# -- usage errors -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [[None], [torch.zeros(1), 3], [[torch.zeros(1)], "x"], 5, "x",
                                 {"a": torch.zeros(1)}])
def test_watch_entries_must_be_tensors(bad):
    with pytest.raises(TypeError, match="watch"):
        no_host_sync(watch=bad)


def test_nested_watch_lists_are_accepted():
    a, b = _dev(), _dev()
    with sync_recorder(watch=[a, (b,)], layers="sentinel") as rec:
        b.tolist()
    assert rec.count("d2h_copy") == 1


class _Batch:
    """A CPU batch whose device `query_start_loc` is its host twin itself (as tests often pass)."""

    def __init__(self):
        self.query_start_loc = torch.tensor([0, 1, 3], dtype=I64)
        self.query_start_loc_cpu = self.query_start_loc
        self.seq_lens = _dev()
        self.seq_lens_cpu = self.seq_lens.clone()


def test_a_device_field_that_is_its_host_twin_is_not_watched_and_is_named():
    batch = _Batch()
    watch = device_tensors(batch)
    assert [id(t) for t in watch] == [id(batch.seq_lens)]
    assert watch.unwatched == ("_Batch.query_start_loc (storage of _Batch.query_start_loc_cpu)",)
    with sync_recorder(watch=watch, layers="sentinel") as rec:
        int(batch.query_start_loc_cpu[-1])  # a host read of the twin: fine
        int(batch.seq_lens.max())  # the rest is still checked
    assert [r.code for r in rec.records] == ["int(batch.seq_lens.max())  # the rest is still checked"]
    assert rec.unwatched == watch.unwatched
    with pytest.raises(ValueError, match=r"_Batch.query_start_loc \(storage of _Batch.query_start_loc_cpu\) "
                                         "shares storage with its host twin"):
        device_tensors(batch, strict=True)


def test_unknown_kinds_and_layers_are_usage_errors():
    with sync_recorder(watch=[_dev()], layers="sentinel") as rec:
        pass
    with pytest.raises(ValueError, match="unknown sync kind 'scalar_reads'.*scalar_read"):
        rec.count("scalar_reads")
    with pytest.raises(ValueError, match="unknown sync layer 'sentinal'"):
        rec.count(layer="sentinal")
    with pytest.raises(ValueError, match="unknown sync kind 'stream_syncs'"):
        Budget(n=1, kinds=["stream_syncs"])
    with pytest.raises(ValueError, match="unknown sync kind"):
        no_host_sync(budget={"d2h": 1})
    with pytest.raises(ValueError, match="unknown sync layer 'bogus'"):
        no_host_sync(layers="sentinel,bogus")
    with pytest.raises(TypeError, match="layers"):
        no_host_sync(layers=3)


def test_touched_counts_use_of_watched_data():
    x = _dev()
    with sync_recorder(watch=[x], layers="sentinel") as idle:
        torch.arange(3).sum()
    assert idle.touched == 0
    with sync_recorder(watch=[x], layers="sentinel") as used:
        (x + 1).cumsum(0)
    assert used.touched == 2


def test_syncs_inside_an_allowed_region_are_shown_never_counted():
    from vllm_sparse_sync.testing import allowed_syncs

    x = _dev()
    with no_host_sync(watch=[x], layers="sentinel") as check:
        with allowed_syncs("a library's deliberate sync"):
            x.tolist()
    assert [r.allowed for r in check.records] == ["a library's deliberate sync"]
    assert "[allowed: a library's deliberate sync]" in check.records[0].format()
    with pytest.raises(HostSyncError, match="1 over|> budget 0"):
        with no_host_sync(watch=[x], layers="sentinel"):
            with allowed_syncs("deliberate"):
                x.tolist()
            x.cpu()  # outside the allowed region: counts
