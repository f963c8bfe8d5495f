import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracle import local_count, rows_of_batch

from vllm_sparse_sync import lengths


@given(length=st.integers(0, 5000), world=st.sampled_from([1, 2, 3, 4, 8]), data=st.data(),
       interleave=st.sampled_from([1, 2, 64]))
def test_dcp_localize_counts_owned_tokens(length, world, data, interleave):
    rank = data.draw(st.integers(0, world - 1))
    want = local_count(length, world, rank, interleave)
    assert lengths.dcp_localize(length, world, rank, interleave) == want
    t = torch.tensor([length, length], dtype=torch.int32)
    assert lengths.dcp_localize(t, world, rank, interleave).tolist() == [want, want]


@given(length=st.integers(0, 10_000), ratio=st.sampled_from([1, 2, 4, 128]))
def test_compress_floor_and_ceil(length, ratio):
    assert lengths.compress(length, ratio) == length // ratio
    assert lengths.compress_ceil(length, ratio) == -(-length // ratio)
    t = torch.tensor([length])
    assert lengths.compress(t, ratio).item() == length // ratio


def test_bad_transform_arguments():
    with pytest.raises(ValueError, match="ratio"):
        lengths.compress(5, 0)
    with pytest.raises(ValueError, match="rank"):
        lengths.dcp_localize(5, 2, 2)


@given(data=st.data())
def test_expand_per_token_matches_oracle(data):
    query_lens = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=6))
    seq_lens = [data.draw(st.integers(q, 3000)) for q in query_lens]
    total = sum(query_lens)
    pad = data.draw(st.integers(0, 5))
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    got = lengths.expand_per_token(torch.tensor(seq_lens, dtype=torch.int32), qsl, total + pad)
    want = rows_of_batch(seq_lens, query_lens)
    assert got.dtype == torch.int32
    assert got.tolist() == want + [0] * pad
    assert lengths.per_token_lengths_host(seq_lens, query_lens) == want


def test_expand_per_token_is_sync_free_on_meta():
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32, device="meta")
    seq = torch.tensor([9, 4], dtype=torch.int32, device="meta")
    out = lengths.expand_per_token(seq, qsl, 8)  # meta tensors raise on any host read
    assert out.shape == (8,) and out.device.type == "meta"
    loc = lengths.kernel_lengths(out, 4, 2, 1, 64)
    assert loc.shape == (8,)


def test_token_request_index_marks_padding():
    qsl = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert lengths.token_request_index(qsl, 7).tolist() == [0, 0, 2, 2, 2, 3, 3]
