"""Device data the host may not read still never yields a wrong value (docs/design.md section 5):
a slot is a valid slot or ``-1`` (a negative page entry, an entry whose slots pass int32, a page
past the table), each such ``-1`` of a selected position is counted where ``health()`` reports
it, and with ``VLLM_SPARSE_SYNC_DEVICE_CHECKS=1`` a device-side assertion fires; a negative
device ``seq_len`` gives rows of length 0; ``check_bound`` catches negative device lengths and a
device ``query_start_loc`` that disagrees with its host twin. On the CPU: the torch reference, the
builder's torch route, and the Triton kernels in the interpreter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_sparse_sync import (
    DcpIndexerStep,
    DecodeBatch,
    IndexerLayout,
    IndexerMetadataBuilder,
    IndexerStep,
    SeqLenShadow,
    kernels,
    rank_layout,
)
from vllm_sparse_sync.checks import INT32_MAX
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.synth import make_case

INT32_MIN = -(2**31)


def _loop_slots(idx, table, bits):
    """The slot contract in Python ints: a valid int32 slot >= 0, else -1."""
    out, lost = [], 0
    for r, row in enumerate(idx):
        res = []
        for p in row:
            slot = -1
            if p >= 0 and (p >> bits) < len(table[r]):
                e = table[r][p >> bits]
                s = (e << bits) | (p & ((1 << bits) - 1))
                slot = s if e >= 0 and s <= INT32_MAX else -1
            lost += p >= 0 and slot < 0
            res.append(slot)
        out.append(res)
    return out, lost


ENTRIES = st.one_of(st.integers(0, 2**20), st.sampled_from([-1, -2, INT32_MIN, INT32_MAX, 2**30, 2**25, 2**24 - 1,
                                                            INT32_MAX >> 6, (INT32_MAX >> 6) + 1]))


@settings(max_examples=80, deadline=None)
@given(bits=st.integers(0, 8), data=st.data())
def test_reference_slots_are_valid_or_minus_one_and_the_rest_is_counted(bits, data):
    rows, k, pages = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12)), data.draw(st.integers(0, 4))
    table = [[data.draw(ENTRIES) for _ in range(pages)] for _ in range(rows)]
    idx = [[data.draw(st.integers(-1, (pages + 1) << bits)) for _ in range(k)] for _ in range(rows)]
    counter = torch.zeros(1, dtype=torch.int32)
    got = ref.page_table_slots(torch.tensor(idx, dtype=torch.int32),
                               torch.tensor(table, dtype=torch.int32).reshape(rows, pages), 1 << bits,
                               unmapped=counter)
    want, lost = _loop_slots(idx, table, bits)
    assert got.tolist() == want and int(counter) == lost
    assert bool(((got >= 0) | (got == -1)).all())


def test_the_issue_cases_minus_one_entry_and_an_entry_past_int32():
    table = torch.tensor([[-1, 7, 2**30]], dtype=torch.int32)  # page 0 unallocated, page 2 overflows
    idx = torch.tensor([[5, 64 + 5, 128 + 5, -1]], dtype=torch.int32)
    counter = torch.zeros(1, dtype=torch.int32)
    got = kernels.page_table_slots(idx, table, 64, unmapped=counter)
    assert got.tolist() == [[-1, 7 * 64 + 5, -1, -1]] and int(counter) == 2  # never -59, never 5


def test_the_largest_entry_whose_slots_fit_int32_maps_and_the_next_does_not():
    bits = 6
    top = INT32_MAX >> bits
    table = torch.tensor([[top, top + 1]], dtype=torch.int32)
    idx = torch.tensor([[63, 64]], dtype=torch.int32)
    assert ref.page_table_slots(idx, table, 64).tolist() == [[INT32_MAX, -1]]


def test_device_checks_assert_on_a_position_without_a_slot(monkeypatch):
    monkeypatch.setenv(ref.DEVICE_CHECKS_ENV, "1")
    table = torch.tensor([[-1, 7]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="no slot"):
        kernels.page_table_slots(torch.tensor([[3]], dtype=torch.int32), table, 64)
    kernels.page_table_slots(torch.tensor([[64, -1]], dtype=torch.int32), table, 64)  # mapped: no assert


# ------------------------------------------------------------------------- the step, on the CPU
LAY = IndexerLayout(backend="b12x", topk=64, num_heads=16, max_model_len=8192)


def _step_with_holes(holes: bool):
    """A three-row step whose block table has unallocated (-1) pages inside the live rows: the
    long row's holes score ``-inf`` and lose, the two rows shorter than k select every position."""
    lens = [1000, 60, 40]
    c = make_case(lens, heads=16, table_pages=16, holes=True, seed=3)
    builder = IndexerMetadataBuilder(LAY, max_num_reqs=4, max_num_tokens=4, max_pages_per_req=16, device="cpu")
    step = IndexerStep.for_builder(builder)
    table = c.block_table.clone()
    if holes:
        table[0, ::2] = -1  # every other page missing
        table[1, 0] = -1  # the short row's only page
        table[2, 0] = 2**30  # its slots pass int32
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    meta = builder.build(DecodeBatch(qsl.clone(), qsl, seq.clone(), SeqLenShadow(seq.clone()), table, 1000))
    return step, meta, c


def test_step_slots_are_valid_or_minus_one_and_health_counts_the_rest():
    step, meta, c = _step_with_holes(True)
    positions = step.run(meta, c.q_fp8, c.weights, c.k_cache)
    slots = step.run(meta, c.q_fp8, c.weights, c.k_cache, slots=True)
    table = meta.block_table
    want, lost = _loop_slots(positions.tolist(), table.tolist(), 6)
    assert slots.tolist() == want and lost > 0
    assert bool(((slots >= 0) | (slots == -1)).all())  # never -59, never a wrapped slot
    health = step.health()
    assert health.unmapped_slots == lost and not health.ok
    assert step.health().unmapped_slots == 0  # read and cleared


def test_step_without_holes_reports_nothing():
    step, meta, c = _step_with_holes(False)
    step.run(meta, c.q_fp8, c.weights, c.k_cache, slots=True)
    assert step.health().ok


def test_step_slots_assert_on_the_device_under_device_checks(monkeypatch):
    step, meta, c = _step_with_holes(True)
    monkeypatch.setenv(ref.DEVICE_CHECKS_ENV, "1")
    with pytest.raises(RuntimeError, match="no slot"):
        step.run(meta, c.q_fp8, c.weights, c.k_cache, slots=True)


# ------------------------------------------------------------------- the builder's device lengths
CAPS = dict(max_num_reqs=4, max_num_tokens=12, max_pages_per_req=16, device="cpu")


def _batch(seq, query_lens, *, device_qsl=None, shadow=False, max_seq_len=1000):
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    qsl = torch.tensor(starts, dtype=torch.int32)
    dev_qsl = qsl.clone() if device_qsl is None else torch.tensor(device_qsl, dtype=torch.int32)
    seq = torch.tensor(seq, dtype=torch.int32)
    return DecodeBatch(dev_qsl, qsl, seq, SeqLenShadow(seq.clamp_min(0).clone()) if shadow else None,
                       torch.zeros(len(query_lens), 16, dtype=torch.int32), max_seq_len)


@pytest.mark.parametrize("query_lens", [(1, 1, 1), (2, 2, 2), (1, 3, 2)])
@pytest.mark.parametrize("ratio, world", [(1, 1), (4, 1), (1, 2)])
def test_a_negative_device_seq_len_gives_rows_of_length_zero(query_lens, ratio, world):
    lay = IndexerLayout(backend="b12x", compress_ratio=ratio, dcp_world_size=world, topk=8, max_model_len=1024)
    seq = [500, -7, INT32_MIN][: len(query_lens)]
    meta = IndexerMetadataBuilder(lay, **CAPS).build(_batch(seq, query_lens))
    rows = meta.row_lens.tolist()
    first = query_lens[0]
    assert rows[first:] == [0] * (len(rows) - first)  # never negative, never wrapped to 2**31 - 1
    assert all(0 < r <= 500 for r in rows[:first])


def test_check_bound_asserts_on_a_negative_device_seq_len():
    lay = IndexerLayout(backend="deepgemm", topk=8, max_model_len=1024)
    IndexerMetadataBuilder(lay, **CAPS).build(_batch([500, -7], (1, 1)))  # off: rows of 0, no read
    with pytest.raises(RuntimeError, match="negative"):
        IndexerMetadataBuilder(lay, check_bound=True, **CAPS).build(_batch([500, -7], (1, 1)))


@pytest.mark.parametrize("query_lens, device_qsl", [
    ((1, 1, 1), [0, 1, 2, 4]),  # plain decode: the device's last entry is off
    ((1, 1, 1), [0, 0, 1, 3]),
    ((2, 2), [0, 1, 4]),  # MTP, uniform: a middle entry is off
    ((1, 3, 2), [0, 2, 3, 6]),  # MTP, ragged: same ends and sum, another split
    ((1, 3, 2), [0, 1, 4, 7]),
])
def test_check_bound_asserts_when_the_device_query_start_loc_disagrees(query_lens, device_qsl):
    lay = IndexerLayout(backend="b12x", topk=8, max_model_len=1024)
    batch = _batch([500, 600, 700][: len(query_lens)], query_lens, device_qsl=device_qsl)
    IndexerMetadataBuilder(lay, **CAPS).build(batch)  # off: nothing is read
    with pytest.raises(RuntimeError, match="query_start_loc"):
        IndexerMetadataBuilder(lay, check_bound=True, **CAPS).build(batch)


@pytest.mark.parametrize("query_lens", [(), (1,), (1, 1, 1), (3, 3), (1, 3, 2), (4, 1)])
def test_check_bound_passes_an_honest_batch(query_lens):
    lay = IndexerLayout(backend="b12x", topk=8, max_model_len=1024)
    batch = _batch([500, 600, 700][: len(query_lens)], query_lens, shadow=True, max_seq_len=700)
    IndexerMetadataBuilder(lay, check_bound=True, **CAPS).build(batch)


# --------------------------------------------------------------- the Triton kernels, interpreted
@pytest.fixture
def interpreted():
    pytest.importorskip("triton")
    import interpret_env

    if interpret_env.CUDA:
        pytest.skip(interpret_env.SKIP_WITH_CUDA)


@pytest.mark.usefixtures("interpreted")
def test_triton_slots_transform_maps_and_counts_as_the_reference():
    from vllm_sparse_sync.kernels.triton.slots import launch_page_slots

    g = torch.Generator().manual_seed(5)
    table = torch.randint(0, 2**20, (3, 6), generator=g, dtype=torch.int32)
    table[0, 1], table[1, 0], table[2, 3] = -1, 2**30, INT32_MIN
    table[2, 4] = INT32_MAX >> 6
    idx = torch.randint(-1, 7 * 64, (3, 40), generator=g, dtype=torch.int32)
    idx[2, :3] = torch.tensor([4 * 64 + 63, 3 * 64, 64 + 1])
    counter = torch.zeros(1, dtype=torch.int32)
    want_counter = torch.zeros(1, dtype=torch.int32)
    want = ref.page_table_slots(idx, table, 64, unmapped=want_counter)
    got = idx.clone()
    launch_page_slots(got, table, 6, counter)
    assert torch.equal(got, want) and int(counter) == int(want_counter) > 0
    assert int(got[2, 0]) == INT32_MAX


@pytest.mark.usefixtures("interpreted")
def test_triton_metadata_kernel_reads_a_negative_seq_len_as_zero():
    from vllm_sparse_sync.kernels.triton.metadata import launch_decode_rows

    seq = torch.tensor([500, INT32_MIN, -7, INT32_MAX], dtype=torch.int32)  # INT32_MIN - 2 would wrap
    qsl = torch.tensor([0, 1, 3, 4, 5], dtype=torch.int32)  # ragged: 1, 2, 1, 1 tokens
    rows = torch.full((8,), -5, dtype=torch.int32)
    table_out = torch.zeros(8, 2, dtype=torch.int32)
    active = torch.zeros(1, dtype=torch.int32)
    bt = torch.zeros(4, 2, dtype=torch.int32)
    launch_decode_rows(seq, qsl, bt, rows, table_out, active, num_reqs=4, num_rows=5, clear_to=8, bound=9,
                       uniform_q=None, ratio=1, world=2, rank=0, interleave=1, max_reqs=4)
    assert rows.tolist() == [250, 0, 0, 0, 2**30, 0, 0, 0]


@pytest.mark.usefixtures("interpreted")
def test_triton_top_k_clamps_an_int64_length_past_int32_instead_of_wrapping():
    from vllm_sparse_sync.kernels import ops as triton_ops

    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    lens = torch.tensor([2**32 + 5, 2**31, -(2**32) + 100], dtype=torch.int64)
    got = triton_ops.topk_indices(x, lens, 16)
    want = ref.topk_indices(x, lens, 16)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    assert bool((want[:2] >= 0).all()) and bool((want[2] == -1).all())  # full rows, then an empty one


# ----------------------------------------------------------------------- DCP candidates, gloo
def _merge_far_position(ctx, checks: bool):
    import os

    if checks:
        os.environ[ref.DEVICE_CHECKS_ENV] = "1"
    try:
        layout = rank_layout(IndexerLayout(backend="b12x", topk=4, max_model_len=256))
        step = DcpIndexerStep(layout, max_rows=1, max_pages_per_req=4, device="cpu")
        local = torch.tensor([[0, 10**9, 2, -5]], dtype=torch.int32)  # 10**9 and -5: not this rank's rows
        scores = torch.tensor([[1.0, 9.0, 1.0, 8.0]])
        try:
            out = step.merge(local, scores)
        except RuntimeError as exc:
            return str(exc)
        return out.global_idx.tolist(), step.health().unmapped_slots
    finally:
        os.environ.pop(ref.DEVICE_CHECKS_ENV, None)


def test_dcp_merge_drops_a_position_outside_the_rank_and_counts_it(multirank):
    r0, r1 = multirank.run(_merge_far_position, False, world_size=2, timeout=120)
    assert r0 == r1 == ([[0, 4, 1, 5]], 2)  # positions 0 and 2 of both ranks; 10**9 never a global id
    e0, e1 = multirank.run(_merge_far_position, True, world_size=2, timeout=120)
    assert "no slot" in e0 and "no slot" in e1
