import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracle import rows_of_batch

from vllm_sparse_sync import (
    BoundSource,
    DecodeBatch,
    IndexerBackend,
    IndexerLayout,
    IndexerMetadataBuilder,
    SeqLenShadow,
)
from vllm_sparse_sync.bounds import capture_stable_bound

MAX_MODEL_LEN = 8192
MAX_REQS, MAX_TOKENS, MAX_PAGES = 8, 32, 130


def _batch(query_lens, seq_lens, *, device="cpu", pages=None, gen=None, max_seq_len=None,
           authoritative=True, dtype=torch.int32):
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    qsl = torch.tensor(starts, dtype=torch.int32)
    pages = pages or MAX_PAGES
    bt = torch.randint(0, 10_000, (len(query_lens), pages), generator=gen, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=dtype)
    return DecodeBatch(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device),
        shadow=SeqLenShadow(torch.tensor(seq_lens, dtype=torch.int32), authoritative),
        block_table=bt.to(device),
        max_seq_len=max(seq_lens, default=0) if max_seq_len is None else max_seq_len,
    )


def _builder(layout, device="cpu", **kw):
    return IndexerMetadataBuilder(layout, max_num_reqs=MAX_REQS, max_num_tokens=MAX_TOKENS,
                                  max_pages_per_req=MAX_PAGES, device=device, **kw)


@st.composite
def layouts(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    return IndexerLayout(backend=draw(st.sampled_from(list(IndexerBackend))),
                         compress_ratio=draw(st.sampled_from([1, 4])), dcp_world_size=world,
                         dcp_rank=draw(st.integers(0, world - 1)),
                         cp_interleave=draw(st.sampled_from([1, 64])), max_model_len=MAX_MODEL_LEN)


@given(layout=layouts(), data=st.data())
def test_rows_and_block_tables_match_an_independent_computation(layout, data):
    query_lens = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=MAX_REQS))
    seq_lens = [data.draw(st.integers(q, MAX_MODEL_LEN)) for q in query_lens]
    batch = _batch(query_lens, seq_lens, gen=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    meta = _builder(layout).build(batch)
    want = rows_of_batch(seq_lens, query_lens, layout.compress_ratio, layout.dcp_world_size,
                         layout.dcp_rank, layout.cp_interleave)
    assert meta.num_rows == sum(query_lens)
    assert meta.row_lens.tolist() == want
    token_req = [i for i, q in enumerate(query_lens) for _ in range(q)]
    assert torch.equal(meta.block_table, batch.block_table[token_req])
    assert meta.bound.value >= max(want, default=0)
    assert int(meta.active_width[0]) == meta.bound.value


def test_buffer_addresses_stable_and_padded_rows_zero(gen):
    layout = IndexerLayout(backend="b12x", max_model_len=MAX_MODEL_LEN)
    builder = _builder(layout)
    big = builder.build(_batch([4, 4, 4], [5000, 6000, 7000], gen=gen))
    ptrs = (big.row_lens.data_ptr(), big.block_table.data_ptr(), big.active_width.data_ptr())
    small = builder.build(_batch([1, 2], [300, 40], gen=gen, pages=5))
    assert (small.row_lens.data_ptr(), small.block_table.data_ptr(), small.active_width.data_ptr()) == ptrs
    assert small.row_lens.tolist() == [300, 39, 40]
    assert builder.row_lens_buffer[3:].eq(0).all()
    assert builder.block_table_buffer[:3, 5:].eq(-1).all()  # stale pages of the big step are gone


def test_capture_build_uses_no_shadow_and_the_stable_bound():
    for ratio, world in ((1, 1), (4, 1), (1, 2)):
        layout = IndexerLayout(backend="deepgemm", compress_ratio=ratio, dcp_world_size=world,
                               max_model_len=MAX_MODEL_LEN)
        builder = _builder(layout)
        meta = builder.build_for_capture(num_reqs=4, num_tokens=8)
        assert meta.bound.source is BoundSource.CAPTURE_STABLE
        assert meta.bound.value == capture_stable_bound(layout)
        assert int(meta.active_width[0]) == meta.bound.value
        assert meta.num_rows == 8 and meta.row_lens.shape == (8,) and meta.row_lens.eq(0).all()
        replay = builder.build(_batch([1] * 4, [10, 20, 30, 40]))
        assert replay.row_lens.data_ptr() == meta.row_lens.data_ptr()


def test_build_reads_no_device_data_on_the_host():
    """Meta tensors hold no data: any host read of them raises, so a clean build proves none."""
    layout = IndexerLayout(backend="b12x", max_model_len=MAX_MODEL_LEN, dcp_world_size=2, dcp_rank=1)
    meta = _builder(layout, device="meta").build(_batch([1, 3, 2], [100, 2000, 700], device="meta"))
    assert meta.row_lens.device.type == "meta" and meta.bound.source is BoundSource.CPU_DCP_LOCAL
    legacy = _builder(layout, device="meta", legacy_device_sync=True)
    with pytest.raises((RuntimeError, NotImplementedError)):
        legacy.build(_batch([1], [100], device="meta"))


def test_legacy_mode_reproduces_the_device_read_on_cpu():
    layout = IndexerLayout(backend="b12x", max_model_len=MAX_MODEL_LEN)
    meta = _builder(layout, legacy_device_sync=True).build(_batch([1, 1], [100, 2000], max_seq_len=4000))
    assert meta.bound.source is BoundSource.LEGACY_DEVICE_SYNC and meta.bound.value == 2000


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(seq_lens=torch.tensor([5, 6], dtype=torch.int64)), "seq_lens"),
        (dict(seq_lens=torch.tensor([5, 6], dtype=torch.int32, device="meta")), "seq_lens"),
        (dict(block_table=torch.zeros(2, MAX_PAGES + 1, dtype=torch.int32)), "block_table"),
        (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "block_table"),
        (dict(query_start_loc=torch.tensor([0, 1], dtype=torch.int32)), "query_start_loc"),
        (dict(shadow=SeqLenShadow(torch.tensor([-1, 6], dtype=torch.int32))), "shadow.seq_lens_cpu"),
        (dict(max_seq_len=MAX_MODEL_LEN + 1), "max_seq_len"),
    ],
)
def test_bad_input_errors_name_the_field(change, field):
    layout = IndexerLayout(backend="b12x", max_model_len=MAX_MODEL_LEN)
    base = _batch([1, 1], [500, 600])
    batch = DecodeBatch(**{**base.__dict__, **change})
    with pytest.raises((ValueError, TypeError), match=field):
        _builder(layout).build(batch)


def test_capacity_errors_name_the_field():
    layout = IndexerLayout(backend="b12x", max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="max_num_tokens"):
        _builder(layout).build(_batch([5] * 7, [10] * 7))
    with pytest.raises(ValueError, match="max_num_reqs"):
        _builder(layout).build(_batch([1] * 9, [10] * 9))
    with pytest.raises(ValueError, match="max_pages_per_req"):
        IndexerMetadataBuilder(layout, max_num_reqs=1, max_num_tokens=1, max_pages_per_req=0, device="cpu")
    with pytest.raises(ValueError, match="num_tokens"):
        _builder(layout).build_for_capture(4, 2)


def test_bound_fits_the_block_table_capacity():
    layout = IndexerLayout(backend="b12x", compress_ratio=4, max_model_len=MAX_MODEL_LEN)
    pages = math.ceil(MAX_MODEL_LEN / 4 / 64)
    meta = _builder(layout).build(_batch([1], [MAX_MODEL_LEN], pages=pages))
    assert meta.bound.value == MAX_MODEL_LEN // 4 and meta.row_lens.tolist() == [MAX_MODEL_LEN // 4]
