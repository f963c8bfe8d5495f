import pytest
import torch

from vllm_sparse_sync import dcp
from vllm_sparse_sync.kernels.reference import topk_indices
from vllm_sparse_sync.lengths import dcp_localize


@pytest.mark.parametrize("world, interleave", [(2, 1), (4, 1), (2, 64), (4, 64), (3, 2)])
def test_maps_round_trip_and_cover_every_position(world, interleave):
    n = 1000
    g = torch.arange(n)
    owners = []
    for rank in range(world):
        local = dcp.global_to_local(g, world, rank, interleave)
        mine = local >= 0
        assert int(mine.sum()) == dcp_localize(n, world, rank, interleave)
        assert torch.equal(local[mine], torch.arange(int(mine.sum())))  # dense, in order
        assert torch.equal(dcp.local_to_global(local[mine], world, rank, interleave), g[mine])
        owners.append(mine)
    assert torch.equal(torch.stack(owners).sum(0), torch.ones(n, dtype=torch.long))
    assert dcp.local_to_global(torch.tensor([-1]), world, 0, interleave).item() == -1


@pytest.mark.parametrize("world, interleave, length, k", [(2, 1, 700, 64), (4, 64, 3000, 128),
                                                          (2, 1, 40, 64), (4, 2, 129, 32)])
def test_merge_equals_the_global_top_k(gen, world, interleave, length, k):
    rows = 3
    logits = torch.randn(rows, length, generator=gen).round(decimals=1)  # plenty of ties
    cand_s, cand_i = [], []
    for rank in range(world):
        gpos = torch.arange(length)
        mine = dcp.global_to_local(gpos, world, rank, interleave) >= 0
        local_logits = logits[:, mine]
        n_local = local_logits.shape[1]
        lens = torch.full((rows,), n_local, dtype=torch.int32)
        idx = topk_indices(local_logits, lens, k)
        s = torch.where(idx >= 0, local_logits.gather(1, idx.clamp_min(0).long()),
                        torch.full(idx.shape, float("-inf")))
        cand_s.append(s)
        cand_i.append(dcp.local_to_global(idx, world, rank, interleave))
    merged = dcp.merge_topk_candidates(torch.stack(cand_s), torch.stack(cand_i), k)
    want = topk_indices(logits, torch.full((rows,), length, dtype=torch.int32), k)
    assert merged.dtype == torch.int32 and merged.shape == (rows, k)
    for r in range(rows):  # the set is the contract (the merge writes in gathered order)
        assert sorted(merged[r].tolist()) == sorted(want[r].tolist())


def test_merge_rejects_bad_shapes():
    with pytest.raises(ValueError, match="scores/global_ids"):
        dcp.merge_topk_candidates(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="k"):
        dcp.merge_topk_candidates(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int32), 0)
