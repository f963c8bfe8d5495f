"""The CPU sentinel: every known host read of a watched tensor is flagged, clean ops are not."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_sparse_sync.testing import HostSyncError, SentinelLayer, no_host_sync, sync_recorder
from vllm_sparse_sync.testing.records import D2H_COPY, DATA_DEPENDENT_SHAPE, SCALAR_READ


def _dev():
    return torch.tensor([5, 9, 3, 0], dtype=torch.int32)


SYNCING = {
    "item": (lambda x: x.sum().item(), SCALAR_READ),
    "int": (lambda x: int(x[0]), SCALAR_READ),
    "float": (lambda x: float(x[1]), SCALAR_READ),
    "bool": (lambda x: bool(x[0] > 0), SCALAR_READ),
    "if": (lambda x: 1 if (x > 100).any() else 0, SCALAR_READ),
    "index": (lambda x: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9][x[1]], SCALAR_READ),
    "format": (lambda x: f"{x[0]}", SCALAR_READ),
    "equal": (lambda x: torch.equal(x, x + 0), SCALAR_READ),
    "sized_by_data": (lambda x: torch.arange(x.max()), SCALAR_READ),
    "slice_by_data": (lambda x: torch.zeros(10)[: x[0]], SCALAR_READ),
    "tolist": (lambda x: x.tolist(), D2H_COPY),
    "cpu": (lambda x: x.cpu(), D2H_COPY),
    "numpy": (lambda x: x.numpy(), D2H_COPY),
    "to_cpu": (lambda x: x.to("cpu"), D2H_COPY),
    "to_cpu_device": (lambda x: x.to(device=torch.device("cpu")), D2H_COPY),
    "nonzero": (lambda x: x.nonzero(), DATA_DEPENDENT_SHAPE),
    "mask_index": (lambda x: x[x > 3], DATA_DEPENDENT_SHAPE),
    "mask_index_of_host_tensor": (lambda x: torch.arange(4)[x > 3], DATA_DEPENDENT_SHAPE),
    "mask_put_tensor": (lambda x: x.clone().__setitem__(x > 3, x[0]), DATA_DEPENDENT_SHAPE),
    "masked_select": (lambda x: torch.masked_select(x, x > 3), DATA_DEPENDENT_SHAPE),
    "where_one_arg": (lambda x: torch.where(x > 3), DATA_DEPENDENT_SHAPE),
    "unique": (lambda x: torch.unique(x), DATA_DEPENDENT_SHAPE),
    "bincount": (lambda x: torch.bincount(x), DATA_DEPENDENT_SHAPE),
    "repeat_interleave": (lambda x: torch.repeat_interleave(torch.arange(4), x),
                          DATA_DEPENDENT_SHAPE),
    "repeat_interleave_self": (lambda x: x.repeat_interleave(x), DATA_DEPENDENT_SHAPE),
    "one_hot": (lambda x: torch.nn.functional.one_hot(x.long()), DATA_DEPENDENT_SHAPE),
}

CLEAN = {
    "arith": lambda x: (x * 2 + 1) // 3,
    "cumsum": lambda x: torch.cumsum(x, 0),
    "topk": lambda x: torch.topk(x, 2),
    "sort": lambda x: torch.sort(x),
    "max": lambda x: x.max(),
    "any_no_bool": lambda x: torch.any(x > 3),
    "sized_repeat_interleave": lambda x: torch.repeat_interleave(torch.arange(4), x,
                                                                 output_size=17),
    "repeat_interleave_int": lambda x: x.repeat_interleave(2),
    "nonzero_static": lambda x: torch.nonzero_static(x, size=4),
    "mask_put_scalar": lambda x: x.clone().__setitem__(x > 3, 0),
    "where_three_args": lambda x: torch.where(x > 3, x, 0),
    "copy_into_device_buffer": lambda x: torch.zeros(4, dtype=torch.int32).copy_(x),
    "one_hot_sized": lambda x: torch.nn.functional.one_hot(x.long(), 16),
    "shape_reads": lambda x: (x.shape[0], x.numel(), x.dtype, x.device, len(x)),
    "index_select": lambda x: x.index_select(0, torch.tensor([1, 0])),
    "clamp_fill": lambda x: x.clone().clamp_(max=4).fill_(1),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_known_host_reads_are_flagged_with_kind_and_line(name):
    fn, kind = SYNCING[name]
    x = _dev()
    with sync_recorder(watch=[x], layers="sentinel") as rec:
        fn(x)
    assert rec.records, f"{name} was not flagged"
    first = rec.records[0]
    assert first.kind == kind
    assert first.layer == "sentinel"
    assert first.location.endswith(".py:" + str(first.location.rsplit(":", 1)[1]))
    assert "test_harness_sentinel.py" in first.location
    assert first.thread == threading.current_thread().name


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_device_staying_ops_pass(name):
    x = _dev()
    with no_host_sync(watch=[x], layers="sentinel") as check:
        CLEAN[name](x)
    assert check.records == []


def test_taint_propagates_through_ops_views_inplace_and_copies():
    x = _dev()
    host = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    with sync_recorder(watch=[x], layers="sentinel") as rec:
        y = (x + 1).cumsum(0)  # derived
        v = y[1:3]  # view
        buf = torch.zeros(4, dtype=torch.int32)
        buf.copy_(v.sum().expand(4))  # copy into another device buffer
        other = torch.zeros(4, dtype=torch.int32)
        other.add_(y)  # in-place with a tainted operand
        out = torch.empty(4, dtype=torch.int32)
        torch.mul(x, 2, out=out)  # out= target
        host.tolist()  # a host tensor: fine
        int(host[0])
        int(v[0])
        buf.tolist()
        bool(other[0])
        out.cpu()
    ops = [r.op for r in rec.records]
    assert ops == ["Tensor.__int__", "Tensor.tolist", "Tensor.__bool__", "Tensor.cpu"]


HOST_COPIES = {
    "cpu": lambda x: x.cpu(),
    "to_cpu": lambda x: x.to("cpu"),
    "to_cpu_copy": lambda x: x.to("cpu", copy=True),
    "cpu_of_a_view": lambda x: x[1:].cpu(),
    "numpy": lambda x: x.numpy(),
    "tolist": lambda x: x.tolist(),
}


@pytest.mark.parametrize("name", sorted(HOST_COPIES))
def test_one_record_per_sync_reads_of_a_host_copy_are_host_reads(name):
    """`x = seq_lens.cpu(); int(x.max())`: the copy syncs; reading what it copied does not."""
    x = _dev()
    with sync_recorder(watch=[x], layers="sentinel") as rec:
        copy = HOST_COPIES[name](x)  # the copy
        int(max(copy)) if isinstance(copy, list) else int(copy.max())
        copy[0] += 1
    assert [r.kind for r in rec.records] == [D2H_COPY], rec.records
    assert int(x[0]) == 5  # the copy is its own storage: writes to it leave the watched tensor
    with sync_recorder(watch=[x], layers="sentinel") as again:
        int(x.max())
    assert [r.kind for r in again.records] == [SCALAR_READ]  # the watched tensor itself still is


def test_view_of_a_watched_tensor_made_before_the_region_is_watched():
    base = torch.arange(8, dtype=torch.int32)
    view = base[2:6]
    with sync_recorder(watch=[base], layers="sentinel") as rec:
        view.tolist()
    assert len(rec.records) == 1


def test_taint_dies_with_its_storage_and_a_reused_address_starts_clean():
    """A freed tainted storage leaves no taint behind, even at the very same address."""
    layer = SentinelLayer([_dev()])
    layer.start()
    try:
        baseline = len(layer.taint)
        for _ in range(50):  # the allocator usually hands the freed block straight back
            dead = torch.arange(4096, dtype=torch.int32)
            layer.mark(dead)
            assert len(layer.taint) == baseline + 1
            ptr = dead.untyped_storage().data_ptr()
            del dead
            assert len(layer.taint) == baseline  # the entry died with its storage
            fresh = torch.zeros(4096, dtype=torch.int32)
            if fresh.untyped_storage().data_ptr() == ptr:
                break  # the same address: the strongest case, checked below like any other
        assert fresh not in layer.taint
        int(fresh[0])
    finally:
        records = layer.stop()
    assert records == []


def test_taint_of_a_new_tensor_at_a_reused_address_holds():
    """A new tainted tensor stays tainted, also (the usual case) at the address and Python id a
    dead clean tensor had."""
    x = torch.arange(4096, dtype=torch.int32)
    layer = SentinelLayer([x])
    layer.start()
    try:
        for _ in range(50):
            clean = torch.zeros(4096, dtype=torch.int32)
            ptr, ident = clean.untyped_storage().data_ptr(), id(clean)
            del clean
            derived = x * 1  # tainted, maybe at the dead tensor's address and id
            if derived.untyped_storage().data_ptr() == ptr:
                break  # the same address: the strongest case, checked below like any other
        assert derived in layer.taint, (ptr, ident, id(derived))
        int(derived[0])
    finally:
        records = layer.stop()
    assert [r.op for r in records] == ["Tensor.__int__"]


def test_taint_lives_while_any_view_keeps_the_storage():
    x = _dev()
    with sync_recorder(watch=[x], layers="sentinel") as rec:
        buf = torch.zeros(8, dtype=torch.int32)
        buf[2:6] = x  # the view written into dies at once
        tail = buf[6:]  # a view that never saw tainted data
        del buf
        tail.tolist()  # same storage: tainted
    assert [r.op for r in rec.records] == ["Tensor.tolist"]


def test_taint_dies_with_its_tensors():
    x = _dev()
    layer = SentinelLayer([x])
    layer.start()
    try:
        y = x * 2
        assert y in layer.taint
        del y
        z = torch.ones(4, dtype=torch.int32)
        int(z[0])
    finally:
        records = layer.stop()
    assert records == []


def test_no_host_sync_names_the_line_and_lists_every_sync():
    x = _dev()

    def build(seq_lens):
        a = int(seq_lens.max().item())  # the regression line
        b = seq_lens.tolist()
        return a, b

    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=[x]):
            build(x)
    msg = str(err.value)
    assert isinstance(err.value, AssertionError)
    assert len(err.value.records) == 2
    assert "int(seq_lens.max().item())  # the regression line" in msg
    assert "b = seq_lens.tolist()" in msg
    assert "in build" in msg and "[sentinel]" in msg


def test_budget_allows_counted_syncs():
    x = _dev()
    with no_host_sync(watch=[x], budget=1):
        x.sum().item()
    with pytest.raises(HostSyncError, match="2 syncs > budget 1"):
        with no_host_sync(watch=[x], budget=1):
            x.sum().item()
            x.tolist()
    with no_host_sync(watch=[x], budget={"d2h_copy": 1}):
        x.tolist()
    with pytest.raises(HostSyncError, match="scalar_read > budget 0"):
        with no_host_sync(watch=[x], budget={"d2h_copy": 1}):
            x.tolist()
            int(x[0])


def test_recorder_counts_by_kind_and_never_raises():
    x = _dev()
    with sync_recorder(watch=[x]) as rec:
        for _ in range(3):
            int(x[0])
        x.nonzero()
    assert rec.counts == {SCALAR_READ: 3, DATA_DEPENDENT_SHAPE: 1}
    assert rec.count(kind=SCALAR_READ, layer="sentinel") == 3


def test_mark_watches_tensors_created_inside_the_region():
    with sync_recorder(layers="sentinel", watch=[torch.zeros(1)]) as rec:
        fresh = torch.arange(3)
        fresh.tolist()
        rec.mark(fresh)
        fresh.tolist()
    assert len(rec.records) == 1


def test_other_threads_are_not_policed_by_the_sentinel():
    x = _dev()
    with sync_recorder(watch=[x], layers="sentinel") as rec:
        t = threading.Thread(target=lambda: x.tolist(), name="bg")
        t.start()
        t.join()
    assert rec.records == []


def test_sentinel_does_not_change_results():
    x = _dev()
    want = torch.topk(torch.cumsum(x * 3, 0), 2).values
    with no_host_sync(watch=[x]):
        got = torch.topk(torch.cumsum(x * 3, 0), 2).values
    assert torch.equal(got, want)


def test_unchecked_blocks_are_not_counted_and_marked_outputs_are():
    """``SyncCheck.unchecked()``: a stand-in's own host reads inside are not records, taint does
    not follow inside, reads before and after still count, and ``mark`` makes an output count."""
    x = _dev()
    with sync_recorder(watch=[x], layers="sentinel") as rec:
        int(x[0])  # counted
        with rec.unchecked():
            int(x[1])  # the stand-in's own read
            y = x * 2  # computed unchecked: not followed
        y.tolist()
        rec.mark(y)
        y.tolist()  # counted once marked
    assert [r.kind for r in rec.records] == [SCALAR_READ, D2H_COPY]


def test_unchecked_blocks_nest_and_resume_checking():
    x = _dev()
    with sync_recorder(watch=[x], layers="sentinel") as rec:
        with rec.unchecked(), rec.unchecked():  # nests
            pass
        x.tolist()
    assert [r.kind for r in rec.records] == [D2H_COPY]
