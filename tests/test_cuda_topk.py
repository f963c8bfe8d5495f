"""The CUDA top-k route on a CPU host: its exact algorithm (the torch emulation of
``cuda_topk.cu``) against the reference, and an NVRTC compile of the kernel source for sm_90
(NVRTC needs no GPU; skipped with the reason when cuda-bindings or NVRTC is absent)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_sparse_sync.kernels import cuda_dcp_merge, cuda_topk
from vllm_sparse_sync.kernels import cuda_topk_emu as emu
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.verify import topk_violations


def _same_sets(got, want):
    for r in range(got.shape[0]):
        assert sorted(got[r].tolist()) == sorted(want[r].tolist()), f"row {r}"


def test_order_keys_match_the_sortable_keys():
    vals = torch.tensor(
        [float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf"), float("nan"), -float("nan")]
    )
    u = emu.order_keys(vals)
    s = ref.sortable_keys(vals).long()
    assert torch.equal(u, (s + 2**31) & 0xFFFFFFFF)  # the int32 order, shifted to unsigned
    assert u[8] == 0 and u[9] == 0
    assert (u[:8].diff() > 0).all()
    # the scorer's negative NaN sits below -inf without the NaN check
    assert emu.order_keys(vals, nan_low=False)[9] < u[0]


@st.composite
def rows_case(draw):
    rows = draw(st.integers(1, 4))
    width = draw(st.integers(0, 600))
    k = draw(st.integers(1, 80))
    kind = draw(st.sampled_from(["randn", "ties", "few_values", "inf_nan", "zeros_signs", "sorted"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(rows, width, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 1e4]))
    elif kind == "ties":
        x = torch.randint(0, 4, (rows, width), generator=gen).float()
    elif kind == "few_values":  # values that share the top 11 or 22 bits but differ below
        base = draw(st.sampled_from([1.0, -2.0, 3e5]))
        x = base + torch.randint(0, 64, (rows, width), generator=gen).float() * abs(base) * 2**-20
    elif kind == "inf_nan":
        x = torch.randn(rows, width, generator=gen)
        pick = torch.rand(rows, width, generator=gen)
        x[pick < 0.2] = float("-inf")
        x[(pick >= 0.2) & (pick < 0.3)] = float("nan")
        x[(pick >= 0.3) & (pick < 0.35)] = float("inf")
    elif kind == "zeros_signs":
        x = torch.where(torch.rand(rows, width, generator=gen) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
    else:
        x = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
        if draw(st.booleans()):
            x = -x
    lens = torch.tensor(
        draw(st.lists(st.integers(-3, width + 50), min_size=rows, max_size=rows)),
        dtype=draw(st.sampled_from([torch.int32, torch.int64])),
    )
    active = None
    if draw(st.booleans()):
        active = torch.tensor([draw(st.integers(-1, width + 10))], dtype=torch.int32)
    tile = draw(st.sampled_from([64, 16384]))
    cap = draw(st.sampled_from([0, 16, 8192]))
    return x, lens, k, active, tile, cap


@given(rows_case())
def test_emulation_selects_the_reference_set(case):
    x, lens, k, active, tile, cap = case
    got = emu.topk_indices(x, lens, k, active_width=active, tile=tile, cap=cap)
    want = ref.topk_indices(x, lens, k, active_width=active)
    _same_sets(got, want)
    eff = ref.effective_lengths(lens, x.shape[1], active)
    if not x.isnan().any():  # verify's torch.topk ranks NaN on top: the reference is the oracle there
        assert topk_violations(got, x, eff, k) == []
    for r, n in enumerate(eff.tolist()):
        if n <= k:
            assert torch.equal(got[r], want[r])  # 0..n-1 then -1
        else:  # above the threshold in position order, then ties in position order
            plan = emu.plan_row(emu.order_keys(x[r, :n]), k, tile=tile, cap=cap)
            hi = emu.order_keys(x[r, got[r].long()]) >> (32 - plan.bits)
            na = k - plan.need
            assert (hi[:na] > plan.prefix).all() and (hi[na:] == plan.prefix).all()
            assert (got[r, :na].diff() > 0).all() and (got[r, na:].diff() > 0).all()


@given(rows_case(), st.sampled_from(cuda_topk.CLUSTER_SIZES), st.sampled_from([1, 2, 16, 32]))
def test_the_cluster_split_writes_the_one_cta_order(case, cluster, warps):
    """Chunks per CTA and segments per warp (the cluster route's collect) cover every position
    once and keep the specification's order, element for element."""
    x, lens, k, active, _, _ = case
    eff = ref.effective_lengths(lens, x.shape[1], active)
    for r, n in enumerate(eff.tolist()):
        want = emu.topk_row(x[r, :n], k)
        assert torch.equal(emu.cluster_topk_row(x[r, :n], k, cluster, warps=warps), want)


def test_cluster_chunks_and_segments():
    assert emu.cluster_chunks(10, 4) == [(0, 4), (4, 4), (8, 2), (12, 0)]
    assert emu.cluster_chunks(65536, 8) == [(8192 * r, 8192) for r in range(8)]
    tail = [(128 * w, 300) for w in range(3, 32)]  # empty segments past the chunk
    assert emu.warp_segments(300, 32) == [(0, 128), (128, 256), (256, 300)] + tail
    for n, c in [(0, 2), (3, 8), (2049, 4), (131071, 8)]:
        assert sum(length for _, length in emu.cluster_chunks(n, c)) == n
        assert all(lo % 4 == 0 for lo, _ in emu.cluster_chunks(n, c))  # float4 loads stay aligned


H200_SMEM = 232448 - 1024  # opt-in shared memory less the kernel's static share


def test_plan_cluster_table():
    plan = lambda rows, width: cuda_topk.plan_cluster(rows, width, 132, H200_SMEM)  # noqa: E731
    table = {  # (rows, width): (CTAs per row, keys per CTA)
        (1, 4096): (8, 512), (1, 65536): (8, 8192), (1, 131072): (8, 16384), (8, 65536): (8, 8192),
        (16, 65536): (4, 16384), (32, 16384): (2, 8192), (32, 65536): (2, 32768),
        (64, 65536): (2, 32768), (64, 131072): (2, 43520), (128, 8192): (1, 8192),
        (128, 131072): (1, 48640), (1000, 8192): (1, 8192),
    }
    for (rows, width), want in table.items():
        got = plan(rows, width)
        assert (got.cluster, got.cap) == want, (rows, width, got)
        assert got.smem <= H200_SMEM and got.cap % 4 == 0
    # the bound sets capacity, never the size: a wide bound keeps the cluster size
    assert plan(8, 4096).cluster == plan(8, 131072).cluster
    assert cuda_topk.plan_cluster(0, 4096, 132, H200_SMEM) is None
    assert cuda_topk.plan_cluster(70000, 4096, 132, H200_SMEM) is None
    assert cuda_topk.plan_cluster(4, 4096, 132, H200_SMEM, cluster=2).cluster == 2
    with pytest.raises(ValueError, match="cluster size"):
        cuda_topk.plan_cluster(4, 4096, 132, H200_SMEM, cluster=3)
    # more CTAs than SMs: 512-thread CTAs share an SM, so each keeps half the keys
    assert cuda_topk.plan_cluster(300, 131072, 132, H200_SMEM, threads=512).cap < plan(300, 131072).cap


def test_emulation_is_deterministic_and_storage_blind():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (3, 5000), generator=gen).float()
    lens = torch.tensor([5000, 4000, 100])
    outs = [
        emu.topk_indices(x, lens, 2048, tile=t, cap=c) for t, c in [(16384, 8192), (1024, 8192), (1024, 0)]
    ]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_plan_modes_and_early_exit():
    gen = torch.Generator().manual_seed(1)
    u = emu.order_keys(torch.randn(40000, generator=gen))
    assert emu.plan_row(u, 2048).mode == "candidates"
    assert emu.plan_row(u[:9000], 2048).mode == "registers"
    assert emu.plan_row(u, 2048, cap=16).mode == "global"
    # every key distinct in its top 11 bits: the first pass resolves the row
    distinct = emu.order_keys(torch.arange(100, dtype=torch.float32).exp2())  # one exponent each
    assert emu.plan_row(distinct, 10).mode == "none"
    ties = emu.order_keys(torch.ones(5000))
    plan = emu.plan_row(ties, 2048)
    assert plan.bits == 32 and plan.need == 2048


# --- NVRTC ------------------------------------------------------------------------------------

NVRTC_OK, NVRTC_WHY = cuda_topk.compiler_status()


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
@pytest.mark.parametrize("output", ["ptx", "cubin"])
def test_kernel_source_compiles_for_sm90(output):
    code, log = cuda_topk.compile_source("sm_90", output=output, extra_options=("--ptxas-options=-v",))
    assert len(code) > 1000
    if output == "ptx":
        text = code.decode(errors="replace")
        for threads, vec in cuda_topk.VARIANTS:
            for aligned in (True, False):
                assert f".entry {cuda_topk.kernel_name(threads, vec, aligned)}" in text
        for cluster in cuda_topk.CLUSTER_SIZES:
            for aligned, threads in itertools.product((True, False), cuda_topk.CLUSTER_THREADS):
                assert f".entry {cuda_topk.cluster_kernel_name(cluster, aligned, threads)}" in text
                assert ".reqnctapercluster" in text  # compiled cluster dims: a plain launch clusters
        for per in cuda_dcp_merge.KEYS_PER_THREAD:  # the DCP merge, in the same module
            assert f".entry dcp_merge_p{per}(" in text
    else:
        spills = [line for line in log.splitlines() if "spill" in line]
        clusters = len(cuda_topk.CLUSTER_SIZES) * len(cuda_topk.CLUSTER_THREADS)
        kernels = 2 * (len(cuda_topk.VARIANTS) + clusters) + len(cuda_dcp_merge.KEYS_PER_THREAD)
        assert len(spills) == kernels, log  # ptxas -v: one line per kernel
        assert all("0 bytes spill stores, 0 bytes spill loads" in line for line in spills), log


def test_status_says_why_without_a_device():
    ok, why = cuda_topk.status()
    if not torch.cuda.is_available():
        assert not ok and why == "no CUDA device"
    assert isinstance(why, str) and why
