"""``topk.scorer_counts`` on the H200: the CUDA scorer's counts build writes each row's pass-A counts
and the one-CTA CUDA top-k takes them. The step selects exactly what it selects without them
(element for element, eager and replayed), leaves every count zero, is not fooled by counts left
over from an unfinished step, and checks the counts it is given against the keys (counts that lie
are refused, counted for the host, and the answer stays exact). Skips without sm_90, cuda-bindings
or NVRTC, with the reason."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_sparse_sync.kernels.synth import make_case


def _status() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "needs a CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return False, "the CUDA scorer (sm_90a) and the cluster top-k need compute capability 9.0"
    from vllm_sparse_sync.kernels.cuda.topk import status

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
    """Live lengths over the whole range: the bound first (rows past the registers on wide
    bounds), just past k, then empty, k and less (the short path), the rest random."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, width + 1, (rows,), generator=g, dtype=torch.int32)
    edge = torch.tensor([width, K + 1, 0, K, 1, K - 1], dtype=torch.int32)
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
    assert int(counted.counts.count_nonzero()) == 0  # the counts zero, no refusal

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
    assert counted.counts_refused() == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 64), width=st.sampled_from([K + 64, 4096, 8192, 16384]), precise=st.booleans(),
       ties=st.booleans(), seed=st.integers(0, 2**16))
def test_random_calls_select_with_the_counts_as_without(rows, width, precise, ties, seed):
    """Any call: rows, bound, dot, ties and live lengths drawn at random; with the counts (where its
    route takes them) the step writes exactly what it writes without, the counts end zero, and
    nothing is refused."""
    from vllm_sparse_sync.kernels import triton_ops as tk

    case = make_case([width] * rows, heads=64, table_pages=width // 64, ties=ties, device=DEV, seed=seed)
    g = torch.Generator().manual_seed(seed)
    case.row_lens.copy_(torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32))
    plain, counted = _workspace(rows, width, False, precise), _workspace(rows, width, True, precise)
    want = tk.indexer_topk(*case.args, K, width=width, workspace=plain)
    got = tk.indexer_topk(*case.args, K, width=width, workspace=counted)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert int(counted.counts.count_nonzero()) == 0


def test_counts_left_over_are_not_taken_and_are_cleared():
    """A step that scored but never selected (an exception between the launches, say) leaves counts
    behind: the next step's rows do not take them (they sum past the live length), select exactly,
    and leave the buffer zero."""
    from vllm_sparse_sync.kernels import triton_ops as tk
    from vllm_sparse_sync.kernels.cuda.topk import COUNTS_BINS

    rows, width = 32, 16384
    case = make_case([width] * rows, heads=64, table_pages=width // 64, device=DEV, seed=5)
    case.row_lens.copy_(_lengths(rows, width, seed=5))
    plain, counted = _workspace(rows, width, False, True), _workspace(rows, width, True, True)
    g = torch.Generator(device=DEV).manual_seed(6)
    left = torch.randint(0, 3, (rows, COUNTS_BINS), device=DEV, generator=g, dtype=torch.int32)
    left[:, 0] += 1  # every row's leftovers nonzero
    counted.counts[:, :COUNTS_BINS] = left
    want = tk.indexer_topk(*case.args, K, width=width, workspace=plain)
    got = tk.indexer_topk(*case.args, K, width=width, workspace=counted)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert int(counted.counts.count_nonzero()) == 0  # zeroed; summing past the length, never refused


@pytest.mark.parametrize("width", [4096, 16384])
def test_counts_that_disagree_with_the_keys_are_refused_and_the_answer_stays_exact(width):
    """Proof that the counts are read and checked, not only cleared: counts that sum to each row's
    live length but put every key in the lowest bin are refused by the keys (each row's refusals
    word counts one) and the row is counted again, exactly; the same lie one count longer fails
    the sum first (no refusal); the row's own counts are kept (no refusal). Exact and zeroed each
    time; the refusals stay until the host clears them."""
    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk
    from vllm_sparse_sync.kernels.cuda import topk_emu as emu
    from vllm_sparse_sync.kernels import reference as ref

    rows = 4
    g = torch.Generator(device=DEV).manual_seed(width)
    x = torch.randn(rows, width, device=DEV, generator=g)
    lens = torch.full((rows,), width, dtype=torch.int32, device=DEV)
    counts = torch.zeros(rows, cuda_topk.COUNTS_WORDS, dtype=torch.int32, device=DEV)
    want = ref.topk_indices(x.cpu(), lens.cpu(), K).sort(1).values
    own = torch.stack([emu.scorer_counts(r) for r in x.cpu()]).to(device=DEV, dtype=torch.int32)

    def run(bins: torch.Tensor) -> torch.Tensor:
        counts[:, : cuda_topk.COUNTS_BINS] = bins
        out = torch.empty(rows, K, dtype=torch.int32, device=DEV)
        cuda_topk.launch_cuda_topk_cluster(x, x.stride(0), lens, None, out, K, width, nan_low=False,
                                           cluster=1, pdl=False, counts=counts)
        torch.cuda.synchronize()
        assert int(counts[:, : cuda_topk.COUNTS_BINS].count_nonzero()) == 0
        return out.cpu().sort(1).values

    lie = torch.zeros_like(own)
    lie[:, 0] = width  # the lowest bin: keys below -2^18, of which the rows have none
    assert torch.equal(run(lie), want)
    assert counts[:, cuda_topk.COUNTS_REFUSED].tolist() == [1] * rows
    lie[:, 0] += 1
    assert torch.equal(run(lie), want)
    assert torch.equal(run(own), want)
    assert counts[:, cuda_topk.COUNTS_REFUSED].tolist() == [1] * rows
    with pytest.raises(ValueError, match="one CTA a row"):
        cuda_topk.launch_cuda_topk_cluster(x, x.stride(0), lens, None, torch.empty(rows, K, dtype=torch.int32,
                                           device=DEV), K, width, cluster=2, counts=counts)


def test_the_counts_step_runs_without_a_sync_and_replays_captured():
    """The public way with ``topk.scorer_counts``: builder and step, the step checked by the
    harness (no host sync, every watched tensor touched), captured once, replayed on new lengths
    (the same answer as the step without the counts), healthy."""
    from decode_rows import DecodeRows

    from vllm_sparse_sync import IndexerLayout, IndexerMetadataBuilder, IndexerStep
    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG
    from vllm_sparse_sync.testing import check_step, decode_graph, device_tensors

    rows, max_len = 32, 16384
    layout = IndexerLayout(backend="b12x", topk=K, max_model_len=max_len)
    pages = max_len // 64
    builder = IndexerMetadataBuilder(layout, max_num_reqs=rows, max_num_tokens=rows, max_pages_per_req=pages,
                                     device=DEV)
    step = IndexerStep.for_builder(builder, config=DEFAULT_CONFIG.with_values(**{"topk.scorer_counts": True}))
    plain = IndexerStep.for_builder(builder)
    route = step.route(rows)
    assert (route.scorer, route.topk_cluster) == ("cuda", 1), route
    d = DecodeRows(rows, max_len, seed=8, device=DEV)
    case, q, w, seq, batch = d.case, d.q, d.w, d.seq, d.batch
    meta = builder.build(batch())
    out = torch.empty(rows, K, dtype=torch.int32, device=DEV)
    step.run(meta, q, w, case.k_cache, out=out)  # warm every kernel
    assert torch.equal(out, plain.run(meta, q, w, case.k_cache))
    watch = device_tensors(builder, step.workspace, seq, case.block_table, q, w, case.k_cache, out)
    check = check_step(lambda: step.run(builder.build(batch()), q, w, case.k_cache, out=out), watch=watch,
                       warmup=1)
    assert check.records == [] and check.touched
    graph = decode_graph(lambda: step.run(meta, q, w, case.k_cache, out=out), inputs=[q, w])
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        d.set_lengths(torch.randint(1, max_len + 1, (rows,), dtype=torch.int32, generator=g))
        live = builder.build(batch())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain.run(live, q, w, case.k_cache)), seed
    health = step.health()
    assert health.ok and health.refused_counts == 0
