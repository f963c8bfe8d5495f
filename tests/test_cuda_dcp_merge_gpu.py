"""The CUDA DCP merge (``cuda_dcp_merge``) on a CUDA device: element for element equal to the
torch merge + remap on random and adversarial gathered keys (the CPU tests' generator) and on
full-size rows (world 2/4/8 at k 2048), capture and replay with new keys, no host sync. Skips
without CUDA or without cuda-bindings/NVRTC (with the reason)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_dcp_merge_kernel import _assert_same, _gathered, _torch_merge, merge_cases


def _status() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "needs a CUDA device"
    from vllm_sparse_sync.kernels.cuda.dcp_merge import status

    return status("cuda")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _status()[0], reason=f"CUDA merge: {_status()[1]}")]
DEV = "cuda"


def _cuda_merge(keys, k, world, rank, interleave, row_pad=0):
    from vllm_sparse_sync.kernels.cuda.dcp_merge import cuda_dcp_merge

    rows = keys.shape[1]
    gi = torch.full((rows + 2, k + row_pad), 5, dtype=torch.int32, device=DEV)[:rows, :k]
    li = torch.full((rows + 2, k + row_pad), 5, dtype=torch.int32, device=DEV)[:rows, :k]
    mk = torch.ones(rows + 2, k + row_pad, dtype=torch.bool, device=DEV)[:rows, :k]
    cuda_dcp_merge(keys.to(DEV), k, gi, li, mk, world=world, rank=rank, interleave=interleave)
    return gi.cpu(), li.cpu(), mk.cpu()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=merge_cases())
def test_equals_the_torch_merge_and_remap(c):
    gen = torch.Generator().manual_seed(c["seed"])
    keys = _gathered(c, gen)
    args = (c["k"], c["world"], c["rank"], c["interleave"])
    _assert_same(_cuda_merge(keys, *args, row_pad=c["row_pad"]), _torch_merge(keys, *args))


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("style", ["plain", "ties", "raw"])
def test_full_size_rows(world, style):
    """k 2048 per rank and row, 16 rows; also a strided view of a wider gathered buffer."""
    c = dict(world=world, rows=16, k_local=2048, span=200000, pad_frac=0.01, style=style,
             interleave=64 if world == 4 else 1)
    keys = _gathered(c, torch.Generator().manual_seed(world))
    for rank in (0, world - 1):
        args = (2048, world, rank, c["interleave"])
        _assert_same(_cuda_merge(keys, *args), _torch_merge(keys, *args))
    wide = torch.zeros(world, 20, 2048, dtype=torch.int64)
    wide[:, 2:18] = keys
    args = (2048, world, 0, c["interleave"])
    _assert_same(_cuda_merge(wide[:, 2:18], *args), _torch_merge(keys, *args))


def test_capture_replay_and_no_host_sync():
    from vllm_sparse_sync.kernels.cuda.dcp_merge import cuda_dcp_merge
    from vllm_sparse_sync.testing import check_step

    world, rows, k = 2, 8, 2048
    c = dict(world=world, rows=rows, k_local=k, span=100000, pad_frac=0.1, style="ties", interleave=1)
    gen = torch.Generator().manual_seed(3)
    keys = _gathered(c, gen).to(DEV)
    gi = torch.empty(rows, k, dtype=torch.int32, device=DEV)
    li, mk = torch.empty_like(gi), torch.empty(rows, k, dtype=torch.bool, device=DEV)

    def step():
        cuda_dcp_merge(keys, k, gi, li, mk, world=world, rank=1, interleave=1)

    step()
    torch.cuda.synchronize()
    check = check_step(step, where="cuda dcp merge")
    assert check.ran and not check.records
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (4, 5):
        new = _gathered(c, torch.Generator().manual_seed(seed))
        keys.copy_(new)
        graph.replay()
        _assert_same((gi.cpu(), li.cpu(), mk.cpu()), _torch_merge(new, k, world, 1, 1))
