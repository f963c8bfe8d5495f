"""The CUDA wgmma scorer on a CPU host: its operand layouts emulated in torch (the query's image in
shared memory, each thread's key bytes, the wgmma fragments, as ``cuda_scorer.cu`` indexes them)
give q . k for every (token, head); the planner's scorer choice; the calls ``takes`` accepts; and
an NVRTC compile for sm_90a that fits four CTAs per SM without spills (skipped, with the reason,
where NVRTC is absent)."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_sparse_sync.kernels import cuda_scorer, cuda_topk
from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG
from vllm_sparse_sync.kernels.route import CUDA, TRITON, DeviceInfo, plan_route, scorer_for

LBO, SBO = 128, 256  # the kernel's b_desc: K-adjacent and N-adjacent core matrices


def q_image(q: torch.Tensor, precise: bool) -> torch.Tensor:
    """The kernel's B operand image of ``q`` ``[H, 128]`` (element values; f16 or e4m3 slots)."""
    heads = q.shape[0]
    esize = 2 if precise else 1
    img = torch.full((heads * 128 * esize // esize,), float("nan"), dtype=torch.float64)
    step_bytes = heads * 32
    for h in range(heads):
        for p in range(0, 128, 4):
            c = p // 32
            core = (h // 8) * SBO + (h % 8) * 16
            if precise:
                j = (p % 32) // 4
                base = j * step_bytes + core
                for e in range(2):  # dims p, p+1 -> kl 2c + e; p+2, p+3 -> kl 2c + 8 + e
                    img[(base + (2 * c) * 2 + 2 * e) // 2] = q[h, p + e]
                    img[(base + LBO + (2 * c) * 2 + 2 * e) // 2] = q[h, p + 2 + e]
            else:
                j, hi = (p % 32) // 8, (p % 8) // 4
                for e in range(4):
                    img[j * step_bytes + core + hi * LBO + 4 * c + e] = q[h, p + e]
    assert not torch.isnan(img).any()  # every slot written once
    return img


def b_matrix(img: torch.Tensor, j: int, heads: int, precise: bool) -> torch.Tensor:
    """``B[kl, n]`` of k-step ``j`` as wgmma reads a K-major, unswizzled descriptor."""
    ksize = 16 if precise else 32
    esize = 2 if precise else 1
    step = heads * 32
    b = torch.empty(ksize, heads, dtype=torch.float64)
    per_core = 16 // esize  # K elements in one core-matrix row
    for kl in range(ksize):
        for n in range(heads):
            byte = j * step + (n // 8) * SBO + (kl // per_core) * LBO + (n % 8) * 16 + (kl % per_core) * esize
            b[kl, n] = img[byte // esize]
    return b


def a_matrix(keys: torch.Tensor, j: int, precise: bool) -> torch.Tensor:
    """``A[m, kl]`` of k-step ``j`` (64 tokens) from each thread's registers, as the kernel fills them."""
    ksize = 16 if precise else 32
    a = torch.full((64, ksize), float("nan"), dtype=torch.float64)
    for tid in range(128):
        lane, warp = tid % 32, tid // 32
        g, c = lane // 4, lane % 4
        m0 = warp * 16 + g
        rows = {0: m0, 1: m0 + 8}
        own = {r: keys[m, 32 * c: 32 * c + 32] for r, m in rows.items()}  # 32 bytes of each row
        if precise:  # a0/a1: row m0/m0+8 at kl 2c, 2c+1 <- bytes 4j, 4j+1; a2/a3: kl 2c+8.. <- 4j+2..
            for r, m in rows.items():
                for e in range(2):
                    a[m, 2 * c + e] = own[r][4 * j + e]
                    a[m, 2 * c + 8 + e] = own[r][4 * j + 2 + e]
        else:  # a0/a1: kl 4c.. <- word 2j; a2/a3: kl 16 + 4c.. <- word 2j + 1
            for r, m in rows.items():
                for e in range(4):
                    a[m, 4 * c + e] = own[r][8 * j + e]
                    a[m, 16 + 4 * c + e] = own[r][8 * j + 4 + e]
    assert not torch.isnan(a).any()
    return a


@pytest.mark.parametrize("precise", [True, False])
@pytest.mark.parametrize("heads", [64, 32])
def test_the_operand_layouts_compute_q_dot_k(precise, heads):
    g = torch.Generator().manual_seed(heads + precise)
    q = torch.randint(-8, 9, (heads, 128), generator=g).double()
    keys = torch.randint(-8, 9, (64, 128), generator=g).double()
    img = q_image(q, precise)
    d = torch.zeros(64, heads, dtype=torch.float64)
    for j in range(8 if precise else 4):
        d += a_matrix(keys, j, precise) @ b_matrix(img, j, heads, precise)
    assert torch.equal(d, keys @ q.T)


def test_the_planner_takes_the_cuda_scorer_where_the_device_can():
    hopper = DeviceInfo(num_sms=132, cuda_topk=True, cluster_smem=200000, cuda_scorer=True)
    assert plan_route(64, 65536, 64, hopper).scorer == CUDA
    assert plan_route(8, 4096, 64, hopper).scorer == CUDA
    assert plan_route(8, 4096, 64, hopper).score_splits == 132 * DEFAULT_CONFIG.scorer.cuda_ctas_per_sm // 8
    assert plan_route(7, 4096, 64, hopper).scorer == TRITON  # fewer rows than scorer.cuda_min_rows
    assert plan_route(7, 4096, 64, hopper).score_splits == 132 * DEFAULT_CONFIG.scorer.ctas_per_sm // 7
    every = DEFAULT_CONFIG.with_values(**{"scorer.cuda_min_rows": 0})
    assert plan_route(1, 4096, 64, hopper, every).scorer == CUDA
    assert plan_route(64, 65536, 32, hopper).scorer == TRITON  # pages of another size
    assert plan_route(64, 65536, 64, DeviceInfo(num_sms=132)).scorer == TRITON
    off = DEFAULT_CONFIG.with_values(**{"scorer.cuda": False})
    fp8 = DEFAULT_CONFIG.with_values(**{"scorer.precise": False})  # Triton's e4m3 kernel is faster
    assert scorer_for(64, 64, hopper, off) == TRITON and scorer_for(64, 64, hopper) == CUDA
    assert scorer_for(64, 64, hopper, fp8) == TRITON


def test_takes_only_the_calls_the_kernel_is_built_for():
    cache = torch.zeros(10, 64 * 132, dtype=torch.uint8)
    q = torch.zeros(2, 64, 128, dtype=torch.uint8)
    table = torch.zeros(2, 4, dtype=torch.int32)
    assert cuda_scorer.takes(q, cache, table, 64, 8)
    assert not cuda_scorer.takes(torch.zeros(2, 16, 128, dtype=torch.uint8), cache, table, 64, 8)  # heads
    assert not cuda_scorer.takes(q, torch.zeros(10, 32 * 132, dtype=torch.uint8), table, 32, 8)  # page
    assert not cuda_scorer.takes(q, cache[:, 4:], table, 64, 8)  # a page not 16-byte aligned
    assert not cuda_scorer.takes(q, cache, table.t().contiguous().t(), 64, 8)  # table rows not contiguous
    assert not cuda_scorer.takes(q, cache, table, 64, 70000)  # more splits than the grid's y
    with pytest.raises(ValueError, match="heads"):
        cuda_scorer.kernel_name(16, True)


def test_the_ctas_of_the_grid_fit_one_sm():
    """228 KB of shared memory per SM (1 KB reserved per CTA) holds the grid's CTAs per SM of
    either path, and the grid asks for what the kernel's register bound allows."""
    assert DEFAULT_CONFIG.scorer.cuda_ctas_per_sm == cuda_scorer.CTAS_PER_SM
    assert f"#define CTAS_PER_SM {cuda_scorer.CTAS_PER_SM}" in cuda_scorer.source()
    assert f"#define STAGES {cuda_scorer.STAGES}" in cuda_scorer.source()
    for heads in cuda_scorer.HEADS:
        for precise in (True, False):
            assert cuda_scorer.CTAS_PER_SM * (cuda_scorer.smem_bytes(heads, precise) + 1024) <= 228 * 1024


NVRTC_OK, NVRTC_WHY = cuda_topk.compiler_status()


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_the_source_compiles_for_sm90a_without_spills():
    _, log = cuda_topk.compile_source(cuda_scorer.ARCH, text=cuda_scorer.source(), name="cuda_scorer.cu",
                                      extra_options=("--ptxas-options=-v",))
    found = re.findall(r"entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers", log, re.S)
    names = {f[0] for f in found}
    assert names == {cuda_scorer.kernel_name(h, p) for h in cuda_scorer.HEADS for p in (True, False)}
    for name, spills, regs in found:
        assert int(spills) == 0, (name, spills)
        # CTAS_PER_SM CTAs of THREADS threads per SM in 64K registers
        assert int(regs) * cuda_scorer.THREADS * cuda_scorer.CTAS_PER_SM <= 65536, (name, regs)
