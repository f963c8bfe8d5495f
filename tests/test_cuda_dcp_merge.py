"""The CUDA DCP merge (``dcp_merge_p*`` in ``topk.cu``) on the CPU: its emulation
(``cuda_topk_emu.dcp_merge_row``: the same passes, early exit and gathered-order writes) against
the torch merge + remap it replaces, on the random and adversarial gathered keys of the Triton
merge's tests (ties, NaN / -0.0 / inf, padding, duplicate and arbitrary int64 keys, world 2/4/8);
the wrapper's checks. (``test_cuda_topk.py`` compiles the kernels with NVRTC.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_dcp_merge_kernel import _assert_same, _gathered, _torch_merge, merge_cases

from vllm_sparse_sync import dcp
from vllm_sparse_sync.kernels.cuda import dcp_merge as cm
from vllm_sparse_sync.kernels.cuda import topk_emu as emu

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _emu_merge(keys, k, world, rank, interleave):
    rows = [emu.dcp_merge_row(keys[:, r].reshape(-1), k, world=world, rank=rank,
                              interleave=interleave) for r in range(keys.shape[1])]
    return tuple(torch.stack([row[i] for row in rows]) for i in range(3))


@SETTINGS
@given(c=merge_cases())
def test_emulated_cuda_merge_equals_the_torch_merge_and_remap(c):
    gen = torch.Generator().manual_seed(c["seed"])
    keys = _gathered(c, gen)
    args = (c["k"], c["world"], c["rank"], c["interleave"])
    _assert_same(_emu_merge(keys, *args), _torch_merge(keys, *args))


def test_emulated_merge_ties_and_padding_pinned():
    """Equal keys straddling the cut: the first ones in gathered order are taken; padding never
    is, even where it is among the k largest (fewer real keys than k)."""
    key = (7 << 32) + 0xFFFFFFFF - 10  # one key value, id 10
    keys = torch.tensor([[[5, key, key]], [[key, dcp.PAD_KEY, 9]]], dtype=torch.int64)
    gi, li, mk = emu.dcp_merge_row(keys[:, 0].reshape(-1), 2, world=2, rank=0, interleave=1)
    assert gi.tolist() == [10, 10]  # the first two copies, in gathered order
    gi, _, _ = emu.dcp_merge_row(keys[:, 0].reshape(-1), 6, world=2, rank=0, interleave=1)
    want = dcp.key_ids(torch.tensor([5, key, key, key, 9])).tolist() + [-1]
    assert gi.tolist() == want
    assert torch.equal(gi, dcp.merge_candidate_keys(keys, 6)[0])


def test_emulated_merge_stops_early_on_unique_keys():
    """Unique keys: the passes stop once the k-th key's bin holds exactly what is needed (the
    planted 'always 6 passes' variant gives the same answer; the pass count is the point)."""
    calls = []
    real = emu._find_bin

    def counting(hist, need):
        calls.append(need)
        return real(hist, need)

    keys = torch.randperm(4096).long() << 40
    emu._find_bin = counting
    try:
        gi, _, _ = emu.dcp_merge_row(keys, 2048, world=2, rank=0, interleave=1)
    finally:
        emu._find_bin = real
    assert len(calls) <= 3
    assert torch.equal(gi, dcp.merge_candidate_keys(keys.view(2, 1, 2048), 2048)[0])


def test_keys_per_thread_and_limits():
    assert cm.keys_per_thread(2, 2048) == 4 and cm.keys_per_thread(4, 2048) == 8
    assert cm.keys_per_thread(8, 2048) == 16 and cm.keys_per_thread(1, 3) == 1
    assert cm.keys_per_thread(8, 2049) is None and not cm.merge_fits(16, 2048)
    assert cm.MAX_KEYS == 16384


def test_wrapper_rejects_bad_input_before_any_launch():
    keys = torch.zeros(2, 3, 16, dtype=torch.int64)
    ok = [torch.zeros(3, 16, dtype=t) for t in (torch.int32, torch.int32, torch.bool)]
    with pytest.raises(ValueError, match="gathered"):
        cm.cuda_dcp_merge(keys.int(), 16, *ok, world=2, rank=0, interleave=1)
    with pytest.raises(ValueError, match="gathered"):
        cm.cuda_dcp_merge(keys, 16, *ok, world=4, rank=0, interleave=1)
    with pytest.raises(ValueError, match="local_mask"):
        cm.cuda_dcp_merge(keys, 16, ok[0], ok[1], ok[1], world=2, rank=0, interleave=1)
    with pytest.raises(ValueError, match="rank"):
        cm.cuda_dcp_merge(keys, 16, *ok, world=2, rank=2, interleave=1)
    with pytest.raises(ValueError, match="k must"):
        cm.cuda_dcp_merge(keys, 0, *ok, world=2, rank=0, interleave=1)
    big = torch.zeros(8, 1, 4096, dtype=torch.int64)
    out = [torch.zeros(1, 4096, dtype=t) for t in (torch.int32, torch.int32, torch.bool)]
    with pytest.raises(ValueError, match="MAX_KEYS"):
        cm.cuda_dcp_merge(big, 4096, *out, world=8, rank=0, interleave=1)
