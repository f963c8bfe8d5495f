"""``topk.scorer_counts`` on the H200: the CUDA scorer's counts build writes each row's pass-A counts
and the one-CTA CUDA top-k takes them. The step selects exactly what it selects without them
(element for element, eager and replayed), leaves every count zero, is not fooled by counts left
over from an unfinished step, and really takes the counts it is given (counts that lie change the
answer). Skips without sm_90, cuda-bindings or NVRTC, with the reason."""

from __future__ import annotations

import pytest
import torch

from vllm_sparse_sync.kernels.synth import make_case


def _status() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "needs a CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return False, "the CUDA scorer (sm_90a) and the cluster top-k need compute capability 9.0"
    from vllm_sparse_sync.kernels.cuda_topk import status

    return status("cuda")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _status()[0], reason=f"scorer counts: {_status()[1]}")]
DEV = "cuda"
K = 2048


def _workspace(rows: int, width: int, counts: bool, precise: bool):
    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    config = DEFAULT_CONFIG.with_values(**{"topk.scorer_counts": counts, "scorer.precise": precise})
    return IndexerTopkWorkspace(rows, K, width, DEV, config=config)


def _lengths(rows: int, width: int, seed: int) -> torch.Tensor:
    """Live lengths over the whole range: empty, at most k (the short path), just past k, and the
    bound (rows past the registers on wide bounds)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, width + 1, (rows,), generator=g, dtype=torch.int32)
    edge = torch.tensor([0, K, K + 1, width, 1, K - 1], dtype=torch.int32)
    lens[: min(rows, edge.numel())] = edge[: min(rows, edge.numel())]
    return lens


SHAPES = [(1, 4096, True), (2, 4096, False), (32, 16384, True), (64, 16384, False), (128, 8192, True),
          (96, 32768, False)]
"""(rows, bound, exact dot): one CTA a row on 512 and 1024 threads, rows in registers and (32K)
past them"""


@pytest.mark.parametrize("rows, width, precise", SHAPES)
def test_the_step_with_the_scorers_counts_selects_what_it_selects_without(rows, width, precise):
    from vllm_sparse_sync.kernels import triton_ops as tk
    from vllm_sparse_sync.kernels.route import CUDA, CUDA_RADIX

    case = make_case([width] * rows, heads=64, table_pages=width // 64, ties=rows % 2 == 0, device=DEV,
                     seed=rows + width)
    case.row_lens.copy_(_lengths(rows, width, seed=rows))
    plain, counted = _workspace(rows, width, False, precise), _workspace(rows, width, True, precise)
    route = counted.route(rows, width, 64)
    assert (route.scorer, route.kind, route.topk_cluster) == (CUDA, CUDA_RADIX, 1), route
    assert tk.scorer_counts_for(route, counted, None) is counted.counts
    want = tk.indexer_topk(*case.args, K, width=width, workspace=plain)
    got = tk.indexer_topk(*case.args, K, width=width, workspace=counted)
    torch.cuda.synchronize()
    assert torch.equal(got, want)  # the same positions in the same order
    assert int(counted.counts.count_nonzero()) == 0

    # captured once, replayed on new lengths: the same again, the counts zero after each replay
    out = torch.empty_like(got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.indexer_topk(*case.args, K, width=width, workspace=counted, out=out)
    for seed in (11, 12):
        case.row_lens.copy_(_lengths(rows, width, seed=seed + rows))
        graph.replay()
        want = tk.indexer_topk(*case.args, K, width=width, workspace=plain)
        torch.cuda.synchronize()
        assert torch.equal(out, want), seed
        assert int(counted.counts.count_nonzero()) == 0


def test_counts_left_over_are_not_taken_and_are_cleared():
    """A step that scored but never selected (an exception between the launches, say) leaves counts
    behind: the next step's rows do not take them (they sum past the live length), select exactly,
    and leave the buffer zero."""
    from vllm_sparse_sync.kernels import triton_ops as tk

    rows, width = 32, 16384
    case = make_case([width] * rows, heads=64, table_pages=width // 64, device=DEV, seed=5)
    case.row_lens.copy_(_lengths(rows, width, seed=5))
    plain, counted = _workspace(rows, width, False, True), _workspace(rows, width, True, True)
    g = torch.Generator(device=DEV).manual_seed(6)
    left = torch.randint(0, 3, counted.counts.shape, device=DEV, generator=g, dtype=torch.int32)
    counted.counts.copy_(left)
    counted.counts[:, 0] += 1  # every row's leftovers nonzero
    want = tk.indexer_topk(*case.args, K, width=width, workspace=plain)
    got = tk.indexer_topk(*case.args, K, width=width, workspace=counted)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert int(counted.counts.count_nonzero()) == 0


@pytest.mark.parametrize("width", [4096, 16384])
def test_the_top_k_takes_counts_that_sum_to_the_length_and_no_others(width):
    """Proof that the counts are read, not only cleared: counts that sum to a row's live length
    but put every key in the lowest bin are taken, and the selection is no longer the row's top k;
    the same lie one count longer is refused, and the row is counted exactly. Zero after both."""
    from vllm_sparse_sync.kernels import cuda_topk
    from vllm_sparse_sync.kernels import reference as ref

    rows = 4
    g = torch.Generator(device=DEV).manual_seed(width)
    x = torch.randn(rows, width, device=DEV, generator=g)
    lens = torch.full((rows,), width, dtype=torch.int32, device=DEV)
    counts = torch.zeros(rows, cuda_topk.COUNTS_BINS, dtype=torch.int32, device=DEV)
    want = ref.topk_indices(x.cpu(), lens.cpu(), K).sort(1).values

    def run(lie: int) -> torch.Tensor:
        counts.zero_()
        counts[:, 0] = width + lie  # the lowest bin: keys below -2^18, of which the row has none
        out = torch.empty(rows, K, dtype=torch.int32, device=DEV)
        cuda_topk.launch_cuda_topk_cluster(x, x.stride(0), lens, None, out, K, width, nan_low=False,
                                           cluster=1, pdl=False, counts=counts)
        torch.cuda.synchronize()
        assert int(counts.count_nonzero()) == 0
        return out.cpu().sort(1).values

    assert not torch.equal(run(0), want)  # taken: pass A looked for the k-th key where none is
    assert torch.equal(run(1), want)  # refused: counted again
    with pytest.raises(ValueError, match="one CTA a row"):
        cuda_topk.launch_cuda_topk_cluster(x, x.stride(0), lens, None, torch.empty(rows, K, dtype=torch.int32,
                                           device=DEV), K, width, cluster=2, counts=counts)
