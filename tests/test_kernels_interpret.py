"""Triton indexer kernels under ``TRITON_INTERPRET=1`` on the CPU, against the torch reference.

Where no CUDA device exists this module sets ``TRITON_INTERPRET=1`` at import, before the
kernel modules are (re)loaded, so their ``@triton.jit`` functions become interpreted ones; with
CUDA present it leaves the environment alone and skips (``test_kernels_gpu`` covers the device).
Sizes are small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

_KERNEL_MODULES = [
    "vllm_sparse_sync.kernels.triton_common",
    "vllm_sparse_sync.kernels.triton_cache",
    "vllm_sparse_sync.kernels.triton_scorer",
    "vllm_sparse_sync.kernels.triton_topk",
    "vllm_sparse_sync.kernels.triton_ops",
]
if not _CUDA:
    for _name in _KERNEL_MODULES:  # re-decorate if something imported them before the variable was set
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from vllm_sparse_sync.kernels import reference as ref  # noqa: E402
from vllm_sparse_sync.kernels import triton_ops as tk  # noqa: E402
from vllm_sparse_sync.kernels.synth import make_case  # noqa: E402
from vllm_sparse_sync.kernels.verify import topk_violations  # noqa: E402
from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace  # noqa: E402

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(_CUDA, reason="CUDA present: the GPU tests run the compiled kernels"),
]


def _eff(case, width, active=None):
    return ref.effective_lengths(case.row_lens, width, active)


def test_write_index_k_cache_matches_reference():
    torch.manual_seed(1)
    pages, page = 4, 64
    k8, ks = ref.quantize_index_k(torch.randn(50, 128))
    slots = torch.randperm(pages * page)[:50].to(torch.int64)
    slots[[3, 17]] = -1
    a = torch.zeros(pages, page * 132, dtype=torch.uint8)
    b = a.clone()
    ref.write_index_k_cache(a, k8, ks, slots)
    tk.write_index_k_cache(b, k8, ks, slots.int())
    assert torch.equal(a, b)


@pytest.mark.parametrize("heads, scalar_page", [(16, 1), (32, 1), (16, 0)])
def test_dense_logits_match_reference_with_holes_and_bounds(heads, scalar_page):
    from dataclasses import replace

    from vllm_sparse_sync.kernels.workspace import DEFAULT_CONFIG

    cfg = replace(DEFAULT_CONFIG, score_scalar_page=scalar_page)  # one-page tiles or gathered tiles
    # lengths: 0, page multiple, partial page, longer than the table (clamped)
    case = make_case([0, 128, 77, 190], heads=heads, table_pages=3, seed=2)
    case.block_table[2, 1] = -1  # a hole inside the live range scores -inf
    for width, active in [(192, None), (300, None), (192, torch.tensor([100], dtype=torch.int32))]:
        got = tk.paged_indexer_logits(*case.args, width, active_width=active, config=cfg)
        want = ref.paged_indexer_logits(*case.args, width, active_width=active)
        assert got.shape == want.shape
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("ties", [False, True])
def test_topk_is_exact_on_dense_logits(ties):
    k = 24
    case = make_case([0, 5, 24, 25, 200, 333], heads=16, ties=ties, seed=3)
    width = 384
    logits = ref.paged_indexer_logits(*case.args, width)
    got = tk.topk_indices(logits, case.row_lens, k)
    assert topk_violations(got, logits, _eff(case, width), k) == []


def test_topk_follows_active_width_and_is_deterministic():
    k = 16
    case = make_case([90, 300, 12], heads=16, ties=True, seed=4)
    logits = ref.paged_indexer_logits(*case.args, 320)
    ws = IndexerTopkWorkspace(3, k, 0, "cpu", num_sms=3)
    active = torch.tensor([64], dtype=torch.int32)
    first = tk.topk_indices(logits, case.row_lens, k, active_width=active, workspace=ws)
    second = tk.topk_indices(logits, case.row_lens, k, active_width=active, workspace=ws)
    assert torch.equal(first, second)
    assert topk_violations(first, logits, _eff(case, 320, active), k) == []
    assert int(ws.hist.abs().sum()) == 0 and int(ws.ticks.abs().sum()) == 0


@pytest.mark.parametrize("bound", ["exact", "host_width", "active_width"])
def test_indexer_topk_both_host_contracts(bound):
    k = 32
    lens = [0, 31, 32, 64, 150, 257]
    case = make_case(lens, heads=32, table_pages=6, seed=5)
    exact = max(lens)
    width, active = {
        "exact": (exact, None),
        "host_width": (6 * 64, None),
        "active_width": (6 * 64, torch.tensor([exact], dtype=torch.int32)),
    }[bound]
    ws = IndexerTopkWorkspace(len(lens), k, width, "cpu", num_sms=5)
    got = tk.indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws)
    logits = ref.paged_indexer_logits(*case.args, width, active_width=active)
    assert topk_violations(got, logits, _eff(case, width, active), k, tol=1e-3) == []
    again = tk.indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws)
    assert torch.equal(got, again)
    assert int(ws.hist.abs().sum()) == 0


def test_indexer_topk_active_width_clamps_below_lengths():
    k = 8
    case = make_case([100, 40, 200], heads=16, table_pages=4, seed=6)
    active = torch.tensor([50], dtype=torch.int32)
    got = tk.indexer_topk(*case.args, k, active_width=active)
    want_len = _eff(case, 256, active)
    logits = ref.paged_indexer_logits(*case.args, 256, active_width=active)
    assert topk_violations(got, logits, want_len, k, tol=1e-3) == []


def test_indexer_topk_without_workspace_allocates():
    case = make_case([70, 3], heads=16, seed=7)
    got = tk.indexer_topk(*case.args, 16)
    logits = ref.paged_indexer_logits(*case.args, 128)
    assert topk_violations(got, logits, _eff(case, 128), 16, tol=1e-3) == []


def test_indexer_topk_row_longer_than_page_table():
    # positions past the page table score -inf but still count toward the row length (reference)
    k = 8
    case = make_case([300, 5], heads=16, table_pages=3, seed=8)
    width = 320
    got = tk.indexer_topk(*case.args, k, width=width)
    logits = ref.paged_indexer_logits(*case.args, width)
    assert topk_violations(got, logits, _eff(case, width), k, tol=1e-3) == []
    want = ref.indexer_topk(*case.args, k, width=width)
    assert set(got[1].tolist()) == set(want[1].tolist())
