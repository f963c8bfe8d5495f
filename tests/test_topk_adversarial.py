"""Every top-k route against the torch reference on adversarial scores, on the CPU: the CUDA
top-k's emulation (one CTA a row, and every cluster size, thread count and shared-memory cap the
cluster route has) and the Triton top-k kernels and slots transform in the interpreter, at small
sizes. ``test_topk_adversarial_gpu.py`` runs the compiled kernels on the same scores."""

from __future__ import annotations

import pytest
import torch
from adversarial import ALL_ROWS, KINDS, adversarial_rows, edge_lengths, scores, sets

from vllm_sparse_sync.kernels.cuda import topk_emu as emu
from vllm_sparse_sync.kernels import reference as ref


def _bits_key(v: float) -> tuple:
    """The contract's order of one score, from its bits: NaN lowest, -0.0 below +0.0."""
    import struct

    b = struct.unpack("<i", struct.pack("<f", v))[0]
    if v != v:
        return (0, 0)
    return (1, b if b >= 0 else b ^ 0x7FFFFFFF)


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_takes_the_k_largest_by_bits_ties_to_the_lowest_positions(kind):
    g = torch.Generator().manual_seed(1)
    x = scores(kind, 300, g)
    for n in edge_lengths(16, 300):
        got = ref.topk_indices(x[None], torch.tensor([n]), 16)[0].tolist()
        live = max(0, min(n, 300))
        order = sorted(range(live), key=lambda p: (_bits_key(float(x[p])), -p), reverse=True)
        want = sorted(order[:16]) if live > 16 else list(range(live))
        assert sorted(p for p in got if p >= 0) == want and got.count(-1) == 16 - len(want)


@pytest.mark.parametrize("width, k", [(300, 16), (5000, 64), (20000, 2048), (70000, 2048)])
def test_the_emulated_cuda_top_k_matches_the_reference_on_every_route(width, k):
    g = torch.Generator().manual_seed(width)
    _, x, lens = adversarial_rows(ALL_ROWS, width, k, g, offset=3, pad=5)
    want = ref.topk_indices(x, lens, k)
    one_cta = emu.topk_indices(x, lens, k)
    assert torch.equal(sets(one_cta), sets(want))
    eff = ref.effective_lengths(lens, width).tolist()
    for cluster in (1, 2, 4, 8, 16):
        for threads, cap in ((1024, 1 << 30), (512, 1 << 30), (1024, 1000)):
            for r, n in enumerate(eff):
                row = emu.cluster_topk_row(x[r, :n], k, cluster, threads=threads, cap=cap)
                assert torch.equal(row, one_cta[r]), (cluster, threads, cap, r, KINDS[r % len(KINDS)], n)


# ------------------------------------------------------------------ Triton, interpreted (small)
@pytest.fixture
def triton_ops(monkeypatch):
    """The kernels' device entry points (``ops``) under the interpreter, the Triton top-k shrunk
    (64 scores an iteration; the sampled one's candidates and samples) so small rows take every
    path."""
    pytest.importorskip("triton")
    import interpret_env

    if interpret_env.CUDA:
        pytest.skip(interpret_env.SKIP_WITH_CUDA)
    from vllm_sparse_sync.kernels import ops
    from vllm_sparse_sync.kernels.triton import topk_radix, topk_sample

    for name, value in dict(CAP=128, SAMPLE_ABOVE=128, SAMPLES=64, BLOCK=64, RESOLVE_BLOCK=64).items():
        monkeypatch.setattr(topk_sample, name, value)
    monkeypatch.setattr(topk_radix, "BLOCK", 64)
    return ops


def _configs():
    from vllm_sparse_sync.kernels.config import KernelConfig

    return {"radix": KernelConfig(topk="radix", fused=False), "sample": KernelConfig(topk="sample", fused=False)}


@pytest.mark.parametrize("algo", ["radix", "sample"])
@pytest.mark.parametrize("rows, upto", [(1, 2 * len(KINDS)), (len(KINDS), ALL_ROWS), (32, ALL_ROWS)])
def test_triton_top_k_matches_the_reference_on_adversarial_scores(triton_ops, algo, rows, upto):
    """Calls of ``rows`` rows over the first ``upto`` adversarial rows (one row a call: every kind
    at the full width and at k + 1)."""
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    k, width = 16, 300
    g = torch.Generator().manual_seed(rows)
    _, xs, all_lens = adversarial_rows(ALL_ROWS, width, k, g, offset=3, pad=5)
    ws = IndexerTopkWorkspace(rows, k, 0, "cpu", config=_configs()[algo], num_sms=2)
    for first in range(0, upto, rows):
        x, lens = xs[first:first + rows], all_lens[first:first + rows]
        got = triton_ops.topk_indices(x, lens, k, workspace=ws)
        assert torch.equal(sets(got), sets(ref.topk_indices(x, lens, k))), (algo, first)


def test_triton_slots_of_adversarial_selections_match_the_reference(triton_ops):
    g = torch.Generator().manual_seed(9)
    _, x, lens = adversarial_rows(2 * len(KINDS), 300, 16, g)
    table = torch.randint(-1, 50, (2 * len(KINDS), 5), generator=g, dtype=torch.int32)
    counter, want_counter = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    got = triton_ops.topk_indices(x, lens, 16, page_table=table, page_size=64, unmapped=counter)
    want = ref.topk_indices(x, lens, 16, page_table=table, page_size=64, unmapped=want_counter)
    assert torch.equal(sets(got), sets(want)) and int(counter) == int(want_counter)
