"""int32 at the edges: the layout refuses what the kernels cannot take (``checks``: int32 device
lengths, ``MAX_KERNEL_ROWS`` positions a row), and every length transform and ``build()`` is exact
up to the largest int32 length, on host ints, numpy (int32 or int64) and int32 tensors alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_sparse_sync import (
    BoundSource,
    DecodeBatch,
    IndexerLayout,
    IndexerMetadataBuilder,
    IndexerStep,
    SeqLenShadow,
)
from vllm_sparse_sync.bounds import capture_stable_bound
from vllm_sparse_sync.checks import INT32_MAX, MAX_KERNEL_ROWS, MAX_ROWS
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.lengths import compress, compress_ceil, dcp_localize

LIMIT = MAX_KERNEL_ROWS
EDGES = [0, 1, 2, 63, 64, 65, 2047, 2048, 2049, LIMIT - 1, LIMIT, LIMIT + 1, 2**31 - 64, INT32_MAX - 1, INT32_MAX]
LENGTHS = st.one_of(st.sampled_from(EDGES), st.integers(0, INT32_MAX))
WORLDS = st.sampled_from([1, 2, 3, 4, 8])
INTERLEAVES = st.sampled_from([1, 2, 4, 64])


def _local(n: int, world: int, rank: int, inter: int) -> int:
    """The DCP-local length in Python ints (no overflow): tokens g < n with (g // I) % W == rank."""
    span = inter * world
    return (n // span) * inter + min(max(n % span - rank * inter, 0), inter)


def test_the_oracle_counts_the_tokens_of_a_rank():
    for n in range(0, 70):
        for world, inter in ((2, 1), (3, 2), (4, 4)):
            for rank in range(world):
                assert _local(n, world, rank, inter) == sum((g // inter) % world == rank for g in range(n))


@settings(max_examples=300, deadline=None)
@given(n=LENGTHS, world=WORLDS, inter=INTERLEAVES, data=st.data())
def test_localize_is_exact_up_to_int32_max_on_every_kind_of_length(n, world, inter, data):
    rank = data.draw(st.integers(0, world - 1))
    want = _local(n, world, rank, inter)
    assert dcp_localize(n, world, rank, inter) == want
    for arr in (np.array([n, 0], dtype=np.int32), np.array([n, 0], dtype=np.int64)):
        got = dcp_localize(arr, world, rank, inter)
        assert got.dtype == np.int64 and int(got[0]) == want
    t = dcp_localize(torch.tensor([n, 0], dtype=torch.int32), world, rank, inter)
    assert t.dtype == torch.int32 and int(t[0]) == want


@settings(max_examples=200, deadline=None)
@given(n=LENGTHS, ratio=st.sampled_from([1, 2, 4, 128]))
def test_compress_and_its_ceiling_are_exact_up_to_int32_max(n, ratio):
    assert compress(n, ratio) == n // ratio and compress_ceil(n, ratio) == -(-n // ratio)
    t = torch.tensor([n], dtype=torch.int32)
    assert int(compress(t, ratio)[0]) == n // ratio and int(compress_ceil(t, ratio)[0]) == -(-n // ratio)
    a = np.array([n], dtype=np.int32)
    assert int(compress_ceil(a, ratio)[0]) == -(-n // ratio)


# ---------------------------------------------------------------------------- layout limits
MODEL_LENS = st.one_of(st.sampled_from([1, 2048, LIMIT - 1, LIMIT, LIMIT + 1, INT32_MAX - 1, INT32_MAX,
                                        2**31, 2**40]), st.integers(1, 2**32))


@settings(max_examples=300, deadline=None)
@given(model_len=MODEL_LENS, ratio=st.sampled_from([1, 2, 4]), world=WORLDS, inter=st.sampled_from([1, 4, 64]),
       data=st.data())
def test_the_layout_takes_exactly_the_lengths_the_kernels_take(model_len, ratio, world, inter, data):
    rank = data.draw(st.integers(0, world - 1))
    widest = _local(-(-model_len // ratio), world, rank, inter)
    ok = model_len <= INT32_MAX and widest <= LIMIT
    kw = dict(backend="b12x", max_model_len=model_len, compress_ratio=ratio, dcp_world_size=world,
              dcp_rank=rank, cp_interleave=inter)
    if ok:
        lay = IndexerLayout(**kw)
        assert capture_stable_bound(lay) == widest <= LIMIT
    else:
        with pytest.raises(ValueError, match="max_model_len"):
            IndexerLayout(**kw)


@pytest.mark.parametrize("topk, ok", [(1, True), (2048, True), (LIMIT, True), (LIMIT + 1, False), (2**40, False)])
def test_topk_up_to_the_limit(topk, ok):
    if ok:
        assert IndexerLayout(backend="b12x", topk=topk, max_model_len=1024).topk == topk
        assert ref.check_k(topk) == topk
    else:
        with pytest.raises(ValueError, match="topk"):
            IndexerLayout(backend="b12x", topk=topk, max_model_len=1024)
        with pytest.raises(ValueError, match="k"):
            ref.check_k(topk)


@pytest.mark.parametrize("width, ok", [(0, True), (1, True), (LIMIT, True), (LIMIT + 1, False), (INT32_MAX, False)])
def test_widths_up_to_the_limit(width, ok):
    if ok:
        assert ref.check_width(width) == width
    else:
        with pytest.raises(ValueError, match="width"):
            ref.check_width(width)


def test_capacities_up_to_the_limits():
    lay = IndexerLayout(backend="b12x", page_size=2**20, topk=8, max_model_len=INT32_MAX, dcp_world_size=2)
    IndexerMetadataBuilder(lay, max_num_reqs=1, max_num_tokens=1, max_pages_per_req=LIMIT >> 20, device="cpu")
    with pytest.raises(ValueError, match="max_pages_per_req"):
        IndexerMetadataBuilder(lay, max_num_reqs=1, max_num_tokens=1, max_pages_per_req=(LIMIT >> 20) + 1,
                               device="cpu")
    with pytest.raises(ValueError, match="max_pages_per_req"):
        IndexerStep(lay, max_rows=1, max_pages_per_req=(LIMIT >> 20) + 1, device="cpu")
    IndexerStep(lay, max_rows=MAX_ROWS, max_pages_per_req=1, device="cpu")
    with pytest.raises(ValueError, match="max_rows"):
        IndexerStep(lay, max_rows=MAX_ROWS + 1, max_pages_per_req=1, device="cpu")
    with pytest.raises(ValueError, match="max_num_tokens"):
        IndexerMetadataBuilder(lay, max_num_reqs=1, max_num_tokens=MAX_ROWS + 1, max_pages_per_req=1, device="cpu")
    with pytest.raises(ValueError, match="page_size"):
        IndexerLayout(backend="b12x", page_size=2**21, max_model_len=1024)


# -------------------------------------------------------------- build() near the largest length
BIG_PAGE = 2**20  # a table of 1024 pages holds 2**30 rows


@settings(max_examples=40, deadline=None)
@given(world=st.sampled_from([2, 3, 4, 8]), ratio=st.sampled_from([1, 4]), q=st.sampled_from([1, 2, 3]),
       length=st.sampled_from([INT32_MAX, INT32_MAX - 1, 2**31 - 64, LIMIT + 1, LIMIT, 1, 0]), data=st.data())
def test_build_writes_exact_dcp_rows_near_int32_max(world, ratio, q, length, data):
    """Was: world 2, rank 0, length 2**31 - 1 wrote -1073741824 (true: 2**30); a correct DCP-local
    shadow was refused as 'not rank 0's share (-1073741824)'."""
    rank = data.draw(st.integers(0, world - 1))
    lay = IndexerLayout(backend=data.draw(st.sampled_from(["b12x", "deepgemm"])), compress_ratio=ratio,
                        dcp_world_size=world, dcp_rank=rank, page_size=BIG_PAGE, topk=8, max_model_len=INT32_MAX)
    length = max(length, q)
    seq = [length, max(length - 5, q)]
    local = [_local(s, world, rank, 1) for s in seq]
    shadow = SeqLenShadow(torch.tensor(seq, dtype=torch.int32),
                          dcp_local_seq_lens_cpu=torch.tensor(local, dtype=torch.int32))
    qsl = torch.tensor([0, q, 2 * q], dtype=torch.int32)
    pages = -(-capture_stable_bound(lay) // BIG_PAGE)
    batch = DecodeBatch(qsl.clone(), qsl, torch.tensor(seq, dtype=torch.int32), shadow,
                        torch.zeros(2, pages, dtype=torch.int32), length)
    builder = IndexerMetadataBuilder(lay, max_num_reqs=2, max_num_tokens=6, max_pages_per_req=pages,
                                     device="cpu", check_bound=True)
    meta = builder.build(batch)
    want = [_local(max(s - q + 1 + j, 0) // ratio, world, rank, 1) for s in seq for j in range(q)]
    assert meta.row_lens.tolist() == want
    assert min(want) >= 0 and meta.bound.value >= max(want)
    if ratio == 1:
        assert meta.bound.source is BoundSource.CPU_DCP_LOCAL and meta.bound.value == max(want)


def test_the_issue_case_world_two_rank_zero():
    lay = IndexerLayout(backend="b12x", dcp_world_size=2, page_size=BIG_PAGE, topk=8, max_model_len=INT32_MAX)
    seq = torch.tensor([INT32_MAX], dtype=torch.int32)
    shadow = SeqLenShadow(seq.clone(), dcp_local_seq_lens_cpu=torch.tensor([2**30], dtype=torch.int32))
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    meta = IndexerMetadataBuilder(lay, max_num_reqs=1, max_num_tokens=1, max_pages_per_req=1024, device="cpu").build(
        DecodeBatch(qsl.clone(), qsl, seq.clone(), shadow, torch.zeros(1, 1024, dtype=torch.int32), INT32_MAX))
    assert meta.row_lens.tolist() == [2**30] and meta.bound.value == 2**30
    wrong = SeqLenShadow(seq.clone(), dcp_local_seq_lens_cpu=torch.tensor([2**30 - 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"1073741823 is not rank 0's share \(1073741824\)"):
        IndexerMetadataBuilder(lay, max_num_reqs=1, max_num_tokens=1, max_pages_per_req=1024, device="cpu").build(
            DecodeBatch(qsl.clone(), qsl, seq.clone(), wrong, torch.zeros(1, 1024, dtype=torch.int32), INT32_MAX))
