"""Kernel dispatch: CPU tensors take the torch reference; importing the package needs no Triton."""

from __future__ import annotations

import subprocess
import sys

import torch

from vllm_sparse_sync.kernels import dispatch, make_workspace
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.synth import make_case


def test_package_import_does_not_import_triton():
    code = "import sys, vllm_sparse_sync.kernels; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cpu_tensors_route_to_reference_and_fill_out():
    case = make_case([70, 0, 130], heads=16, seed=3)
    width, k = 192, 16
    logits = dispatch.paged_indexer_logits(*case.args, width)
    assert torch.equal(logits, ref.paged_indexer_logits(*case.args, width))
    out = torch.empty(3, k, dtype=torch.int32)
    got = dispatch.topk_indices(logits, case.row_lens, k, out=out)
    assert got is out and torch.equal(out, ref.topk_indices(logits, case.row_lens, k))
    step = dispatch.indexer_topk(*case.args, k, width=width)
    assert torch.equal(step, ref.indexer_topk(*case.args, k, width=width))
    assert make_workspace(3, k, width, "cpu") is None
