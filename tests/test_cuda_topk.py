"""The CUDA top-k route on a CPU host: its exact algorithm (the torch emulation of
``topk.cu``) against the reference, and an NVRTC compile of the kernel source for sm_90
(NVRTC needs no GPU; skipped with the reason when cuda-bindings or NVRTC is absent)."""

from __future__ import annotations

import itertools
import re
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_sparse_sync.kernels.cuda import dcp_merge as cuda_dcp_merge
from vllm_sparse_sync.kernels.cuda import topk as cuda_topk
from vllm_sparse_sync.kernels.cuda import topk_emu as emu
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
        else:  # the selection in ascending position order, ties at the lowest positions
            assert (got[r].diff() > 0).all()
            plan = emu.plan_row(emu.order_keys(x[r, :n]), k, tile=tile, cap=cap)
            hi = emu.order_keys(x[r, :n]) >> (32 - plan.bits)
            ties = torch.nonzero(hi == plan.prefix).flatten().tolist()
            assert set(ties[: plan.need]) <= set(got[r].tolist())
            assert not set(ties[plan.need:]) & set(got[r].tolist())


@given(rows_case(), st.sampled_from(cuda_topk.CLUSTER_SIZES), st.sampled_from([32, 64, 512, 1024]),
       st.sampled_from([4, 64, 1 << 30]))
def test_the_cluster_split_writes_the_one_cta_order(case, cluster, threads, cap):
    """Chunks per CTA (or one CTA for a short row), ranges per thread, listed bins (the cluster
    route's collect) cover every position once and write the specification's row."""
    x, lens, k, active, _, _ = case
    eff = ref.effective_lengths(lens, x.shape[1], active)
    for r, n in enumerate(eff.tolist()):
        want = emu.topk_row(x[r, :n], k)
        assert torch.equal(emu.cluster_topk_row(x[r, :n], k, cluster, threads=threads, cap=cap), want)


def test_cluster_levels_list_small_bins():
    gen = torch.Generator().manual_seed(1)
    u = emu.order_keys(torch.randn(65536, generator=gen))
    plan = emu.plan_cluster_row(u, 2048)
    assert plan.bits == 22 and plan.listed and plan.count <= emu.TIE_MAX
    assert emu.plan_row(u, 2048).bits == 32  # the one-CTA kernel takes a pass more
    ties = emu.order_keys(torch.randn(9000, generator=gen).round())
    plan = emu.plan_cluster_row(ties, 2048)
    assert plan.bits == 32 and not plan.listed and plan.count > emu.TIE_MAX
    few = emu.order_keys(torch.tensor([5.0, 1.0, 1.01, 1.02, 0.5]))  # a bin of three keys, need two
    plan = emu.plan_cluster_row(few, 3)
    assert plan.bits == 11 and plan.listed and (plan.count, plan.need) == (3, 2)
    assert emu.cluster_topk_row(torch.tensor([5.0, 1.0, 1.01, 1.02, 0.5]), 3, 2).tolist() == [0, 2, 3]
    assert emu.cluster_split(5000, 8, 8192) == [(0, 5000)] + [(5000, 0)] * 7
    assert emu.cluster_split(16384, 2, 43520) == [(0, 16384), (16384, 0)]
    assert emu.cluster_split(5000, 8, 4096, threads=256) == emu.cluster_chunks(5000, 8)
    assert emu.cluster_split(16384, 8, 1024) == [(0, 16384)] + [(16384, 0)] * 7  # in registers: any cap
    assert [emu.in_registers(n, t) for n, t in [(16384, 1024), (16385, 1024), (8192, 512), (8193, 512)]] == [
        True, False, True, False]
    assert emu.cluster_split(16385, 8, 16384) == emu.cluster_chunks(16385, 8)
    # 16 CTAs split a row of at most 8 x 8192 live keys over their first 8 only
    assert emu.cluster_split(65536, 16, 16384) == emu.cluster_chunks(65536, 8) + [(65536, 0)] * 8
    assert emu.cluster_split(65537, 16, 16384) == emu.cluster_chunks(65537, 16)
    assert emu.cluster_split(16385, 16, 16384, threads=512) == emu.cluster_chunks(16385, 8) + [(16385, 0)] * 8
    assert [emu.chunks_in_registers(n, 16, 16384) for n in (20000, 65536, 65537, 262144, 262145)] == [
        True, True, True, True, False]
    # a split row whose chunks fit the registers of a 1024-thread launch
    assert [emu.chunks_in_registers(n, c, 8192, threads=t) for n, c, t in [
        (65536, 8, 1024), (131072, 8, 1024), (131073, 8, 1024), (131072, 4, 1024), (65536, 8, 512),
        (16384, 8, 1024), (16385, 2, 1024)]] == [True, True, False, False, False, False, True]


def _tie_across_chunks(n: int, cluster: int, k: int) -> torch.Tensor:
    """One key value everywhere but a low run: the first chunk holds k // 2 of its keys, so the
    k-th of them (in position order) lies in a later chunk."""
    chunk = emu.cluster_chunks(n, cluster)[0][1]
    x = torch.ones(n)
    x[: chunk - k // 2] = 0.0
    return x


@pytest.mark.parametrize("cluster", [2, 4, 8])
def test_chunks_in_registers_write_the_specification(cluster):
    """A split row held in registers (every chunk at most 16384 keys on 1024 threads) writes the
    specification's row: one key value taken across chunks, a list, an indexer-like row."""
    g = torch.Generator().manual_seed(cluster)
    n = 8192 * cluster + 12
    cases = [_tie_across_chunks(n, cluster, 2048), torch.randn(n, generator=g).round(decimals=1),
             torch.randn(n, generator=g) * 19 + 8.5]
    for x in cases:
        assert emu.chunks_in_registers(n, cluster, 8192)
        assert torch.equal(emu.cluster_topk_row(x, 2048, cluster, cap=8192), emu.topk_row(x, 2048))


def test_one_cta_bins_partition_the_keys():
    """``solo_bin``'s 4096 bins are consecutive intervals of keys covering all 2^32 of them, in
    order, and each bin's keys are ``solo_bin_keys``' interval."""
    spans = [emu.solo_bin_keys(b) for b in range(4096)]
    assert spans[0][0] == 0 and spans[-1][1] == 2**32 - 1
    assert all(lo <= hi for lo, hi in spans)
    assert all(spans[b][1] + 1 == spans[b + 1][0] for b in range(4095))
    ends = torch.tensor([v for span in spans for v in span])
    assert torch.equal(emu.solo_bin(ends), torch.arange(4096).repeat_interleave(2))
    # the window: 64 bins per octave of |x| from 2^-14 to 2^18; its first and last bins per sign
    # (the edges) also hold the magnitudes below and above it
    x = torch.tensor([1.0, 1.0 + 2**-6, 2.0**17, 2.0**18 * (1 - 2**-7), 2.0**-14 * (1 + 2**-6), 2.0**-14,
                      0.0])
    b = emu.solo_bin(emu.order_keys(x)).tolist()
    assert b[1] == b[0] + 1 and b[2] == 4095 - 63 and b[3] == 4095 and b[4] == 2049 and b[5] == b[6] == 2048
    assert emu.solo_bin(emu.order_keys(-x)).tolist() == [4095 - v for v in b]


@given(st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=64))
def test_one_cta_bins_follow_the_key_order(keys):
    u = torch.tensor(sorted(keys))
    b = emu.solo_bin(u)
    assert (b.diff() >= 0).all()
    for key, bin_ in zip(u.tolist(), b.tolist()):
        lo, hi = emu.solo_bin_keys(bin_)
        assert lo <= key <= hi


def _edge_row() -> torch.Tensor:
    """Zeros and 2^-14 (the positive edge bin, 2^-14 at its top) with 100 keys of the next bin
    mixed in: the first refine digit of the edge bin spans both."""
    x = torch.cat([torch.full((200,), 2.0**-14), torch.full((100,), 2.0**-14 * (1 + 2**-6)),
                   torch.zeros(300)])
    return x[torch.randperm(600, generator=torch.Generator().manual_seed(0))]


def test_one_cta_levels():
    """The one-CTA plan on the rows each of its levels is for, and the row it writes."""
    gen = torch.Generator().manual_seed(3)
    indexer_like = torch.randn(4096, generator=gen) * 19 + 8.5  # benchmarks/indexer.py's logits, roughly
    cases = [  # (row, k, refine passes, listed)
        (indexer_like, 2048, 0, True),  # the 4096-bin pass A leaves a short list
        (torch.ones(5000), 2048, 2, False),  # one key value in an inner bin: 11 + 6 bits, by position
        (torch.full((5000,), -0.0), 2048, 3, False),  # an edge bin: 11 + 11 + 8 bits
        (1.0 + torch.arange(4000) * 2**-22, 100, 1, True),  # 4000 keys in one bin: one pass, a list
        (_edge_row(), 150, 3, False),  # the refine digits reach past the edge bin's keys
    ]
    for x, k, passes, listed in cases:
        plan = emu.plan_cluster_row(emu.order_keys(x), k, solo=True)
        assert (plan.passes, plan.listed) == (passes, listed), (x[:3], plan)
        assert plan.count <= emu.SOLO_TIE_MAX or not listed
        want = emu.topk_row(x, k)
        assert torch.equal(emu.cluster_topk_row(x, k, 1), want)
        assert torch.equal(emu.cluster_topk_row(x, k, 8), want)  # a short row: the same code
    assert emu.plan_cluster_row(emu.order_keys(indexer_like), 2048).passes == 1  # a cluster's pass A


@given(st.integers(0, 50000), st.sampled_from(cuda_topk.CLUSTER_THREADS))
def test_thread_ranges_fit_the_padded_shared_layout(length, threads):
    """Each key's word is its own (the kernel stores 16-byte groups), inside the keys area the
    host sizes (cap + RANGE_PAD * threads words), and the 16-byte reads of 8 neighbouring threads
    at the same step of their ranges fall in 8 distinct bank groups (no conflicts)."""
    per = emu.thread_range(length, threads)
    assert per % 8 == 0 and per * threads >= length
    slots = [emu.range_slot(p, per) for p in range(0, length, 4)]
    assert all(s % 4 == 0 for s in slots) and len(set(slots)) == len(slots)
    cap = (length + 3) & ~3
    assert all(s + 4 <= cap + emu.RANGE_PAD * threads for s in slots)
    for t0 in range(0, threads, 8):
        for m in range(0, per, 4):
            groups = {(emu.range_slot((t0 + t) * per + m, per) // 4) % 8 for t in range(8)}
            assert len(groups) == 8


def test_the_cluster_launch_refuses_logits_narrower_than_the_host_width():
    """The cluster kernel may read a row's first ``sel_width`` scores before it knows the live
    length: narrower logits are refused before anything is compiled or launched."""
    x = torch.zeros(2, 100)
    lens = torch.tensor([50, 50], dtype=torch.int32)
    out = torch.empty(2, 8, dtype=torch.int32)
    for bad, width in [(x, 101), (x.flatten(), 100)]:
        with pytest.raises(ValueError, match=r"at least sel_width=\d+ columns.*got shape"):
            cuda_topk.launch_cuda_topk_cluster(bad, 100, lens, None, out, 8, width)


def test_the_kernel_source_uses_the_emulation_constants():
    src = cuda_topk.source()
    for name in ("RANGE_PAD", "SOLO_MAX", "TIE_MAX", "SOLO_TIE_MAX", "SOLO_EXP_LO"):
        assert f"#define {name} {getattr(emu, name)} " in src, name
    assert f"#define CLUSTER_UNROLL {emu.REG_GROUPS} " in src
    assert emu.WIDE_SPLIT_KEYS == cuda_topk.WIDE_CLUSTER_MIN_KEYS == 65536
    assert "#define WIDE_SPLIT_KEYS (8 * 8192) " in src
    assert "#define SHORT_ACT 512 " in src  # in_registers' docstring
    # a register row's hand-over ((threads - act) * 16 * act / threads words, topk_reg_body)
    # fits the keys' words of the smallest plan (cap 4) of every launch the host makes
    for cluster, threads in itertools.product(cuda_topk.CLUSTER_SIZES, cuda_topk.CLUSTER_THREADS):
        act = min(512, threads)
        passes = cuda_topk.SOLO_PASS_WORDS if cluster == 1 else 2 * cuda_topk.CLUSTER_PASS_WORDS
        spare = cuda_topk.cluster_smem_bytes(4, cluster, threads) // 4 - passes
        assert (threads - act) * 16 * act // threads <= spare, (cluster, threads)
    assert (cuda_topk.RANGE_PAD, cuda_topk.SOLO_MAX) == (emu.RANGE_PAD, emu.SOLO_MAX)
    # the pass counts' layout the host sizes shared memory with
    layouts = [("PASS_WORDS", cuda_topk.CLUSTER_PASS_WORDS), ("SOLO_WORDS", cuda_topk.SOLO_PASS_WORDS)]
    for name, words in layouts:
        expr = re.search(rf"#define {name} (\([0-9 +*]+\))", src)
        assert expr and eval(expr.group(1)) == words, name  # noqa: S307 (digits and + * only)


def test_cluster_chunks_and_ranges():
    assert emu.cluster_chunks(10, 4) == [(0, 4), (4, 4), (8, 2), (12, 0)]
    assert emu.cluster_chunks(65536, 8) == [(8192 * r, 8192) for r in range(8)]
    assert [emu.thread_range(n, 1024) for n in (0, 1, 8192, 8193, 32768, 43516)] == [8, 8, 8, 16, 32, 48]
    for n, c in [(0, 2), (3, 8), (2049, 4), (131071, 8)]:
        assert sum(length for _, length in emu.cluster_chunks(n, c)) == n
        assert all(lo % 4 == 0 for lo, _ in emu.cluster_chunks(n, c))  # float4 loads stay aligned


H200_SMEM = 232448 - 1024  # opt-in shared memory less the kernel's static share


def test_plan_cluster_table():
    plan = lambda rows, width: cuda_topk.plan_cluster(rows, width, 132, H200_SMEM)  # noqa: E731
    table = {  # (rows, width): (CTAs per row, keys per CTA)
        (1, 4096): (1, 4096), (1, 16384): (1, 16384), (1, 16388): (8, 2052), (1, 65536): (8, 8192),
        (1, 131072): (16, 16384), (2, 131072): (16, 16384), (4, 131072): (16, 16384),
        (5, 131072): (8, 16384), (1, 65540): (16, 16384), (8, 65536): (8, 8192),
        (16, 65536): (4, 16384), (32, 16384): (1, 16384), (32, 65536): (2, 32768),
        (64, 65536): (2, 32768), (64, 131072): (2, 43520), (128, 8192): (1, 8192),
        (128, 131072): (1, 45568), (1000, 8192): (1, 8192),
    }
    for (rows, width), want in table.items():
        got = plan(rows, width)
        assert (got.cluster, got.cap) == want, (rows, width, got)
        assert got.smem <= H200_SMEM and got.cap % 4 == 0
    # a wide bound's cluster runs a short row on its first CTA: its capacity must cover one
    assert plan(8, 131072).cap >= emu.SOLO_MAX and plan(1, 131072).cap >= emu.SOLO_MAX
    assert plan(64, 131072).cap >= emu.SOLO_MAX
    assert cuda_topk.plan_cluster(0, 4096, 132, H200_SMEM) is None
    assert cuda_topk.plan_cluster(70000, 4096, 132, H200_SMEM) is None
    assert cuda_topk.plan_cluster(4, 4096, 132, H200_SMEM, cluster=2).cluster == 2
    with pytest.raises(ValueError, match="cluster size"):
        cuda_topk.plan_cluster(4, 4096, 132, H200_SMEM, cluster=3)
    # more CTAs than SMs: 512-thread CTAs share an SM, so each keeps half the keys
    assert cuda_topk.plan_cluster(300, 131072, 132, H200_SMEM, threads=512).cap < plan(300, 131072).cap
    # one CTA per row and a bound that 512 threads hold in registers: 512 threads; else 1024
    threads = {(1, 4096): 512, (1, 8192): 512, (128, 8192): 512, (1000, 8192): 512, (1, 8196): 1024,
               (1, 16384): 1024, (32, 16384): 1024, (1, 65536): 1024, (8, 131072): 1024}
    assert {shape: plan(*shape).threads for shape in threads} == threads
    assert cuda_topk.plan_cluster(1, 4096, 132, H200_SMEM, cluster=2).threads == 1024  # a cluster
    assert cuda_topk.plan_cluster(1, 4096, 132, H200_SMEM, threads=1024).threads == 1024  # forced
    assert cuda_topk.SMALL_ROW_KEYS == 4 * 4 * 512 and emu.in_registers(cuda_topk.SMALL_ROW_KEYS, 512)


H200_SMEM_PER_SM = 233472


def test_a_dependent_launch_of_one_wave_holds_one_cta_an_sm():
    """A PDL launch of at most one CTA an SM asks for enough shared memory that an SM cannot take
    two (each with the static reserve), never past the opt-in; more CTAs than SMs or no PDL: the
    plan's."""
    reserve = cuda_topk.STATIC_SMEM_RESERVE
    for rows, width in [(128, 8192), (1, 4096), (64, 16384), (8, 65536), (132, 4096), (32, 65536)]:
        plan = cuda_topk.plan_cluster(rows, width, 132, H200_SMEM)
        smem = cuda_topk.launch_smem(plan, rows, 132, H200_SMEM_PER_SM, H200_SMEM, pdl=True)
        assert smem >= plan.smem and smem <= H200_SMEM, (rows, width)
        assert 2 * (smem + reserve) > H200_SMEM_PER_SM >= smem + reserve, (rows, width)
        assert cuda_topk.launch_smem(plan, rows, 132, H200_SMEM_PER_SM, H200_SMEM, pdl=False) == plan.smem
    for rows, width in [(133, 4096), (1000, 8192), (200, 65536)]:  # past one wave
        plan = cuda_topk.plan_cluster(rows, width, 132, H200_SMEM)
        assert rows * plan.cluster > 132
        assert cuda_topk.launch_smem(plan, rows, 132, H200_SMEM_PER_SM, H200_SMEM, pdl=True) == plan.smem
    small = cuda_topk.plan_cluster(128, 8192, 132, H200_SMEM)  # an opt-in below half an SM: at most it
    optin = small.smem + 4
    assert cuda_topk.launch_smem(small, 128, 132, H200_SMEM_PER_SM, optin, pdl=True) == optin


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
    assert torch.equal(emu.topk_row(torch.ones(5000), 2048), torch.arange(2048, dtype=torch.int32))


def test_the_order_does_not_depend_on_the_early_exit():
    """A row resolved by its first pass and the same selection resolved by all three write the
    same row: the ascending positions of the selection."""
    x = torch.tensor([8.0, 1.0, 16.0, 2.0, 4.0, 0.5])  # one exponent each: resolved by pass A
    assert emu.plan_row(emu.order_keys(x), 3).mode == "none"
    assert emu.topk_row(x, 3).tolist() == [0, 2, 4]
    y = 1 + torch.tensor([0.08, 0.01, 0.12, 0.03, 0.1, 0.02])  # one top-11-bit bin: resolved below it
    assert emu.plan_row(emu.order_keys(y), 3).bits > 11
    assert emu.topk_row(y, 3).tolist() == [0, 2, 4]


# --- NVRTC ------------------------------------------------------------------------------------

NVRTC_OK, NVRTC_WHY = cuda_topk.compiler_status()


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
@pytest.mark.parametrize("arch", ["sm_70", "sm_75", "sm_80"])
def test_kernel_source_compiles_before_sm90(arch):
    """The one-CTA kernels serve every device from ``MIN_CAPABILITY`` up, so the source compiles
    for the archs before Hopper too (sm_70 and sm_75 have no warp redux), the cluster kernels
    compiled out."""
    cap = (int(arch[3]), int(arch[4]))
    assert cuda_topk.MIN_CAPABILITY <= cap
    if not cuda_topk.compiles_for(cap):  # CUDA 13's NVRTC dropped sm_70: the device takes Triton there
        pytest.skip(f"{NVRTC_WHY} does not compile for {arch}")
    code, _ = cuda_topk.compile_source(arch, output="ptx")
    text = code.decode(errors="replace")
    for threads, vec in cuda_topk.VARIANTS:
        for aligned in (True, False):
            assert f".entry {cuda_topk.kernel_name(threads, vec, aligned)}" in text
    assert ".reqnctapercluster" not in text


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
                assert f".entry {cuda_topk.cluster_kernel_name(cluster, aligned, threads)}(" in text
                assert ".reqnctapercluster" in text  # compiled cluster dims: a plain launch clusters
        for per in cuda_dcp_merge.KEYS_PER_THREAD:  # the DCP merge, in the same module
            assert f".entry dcp_merge_p{per}(" in text
    else:
        spills = [line for line in log.splitlines() if "spill" in line]
        clusters = len(cuda_topk.CLUSTER_SIZES) * len(cuda_topk.CLUSTER_THREADS)
        kernels = 2 * (len(cuda_topk.VARIANTS) + clusters) + len(cuda_dcp_merge.KEYS_PER_THREAD)
        # ptxas -v: one line per function, the kernels and the device functions compiled out of
        # line (split_smem_row: mangled names)
        names = re.findall(r"Function properties for (\w+)", log)
        assert len(spills) == len(names), log
        assert sum(not name.startswith("_Z") for name in names) == kernels, log
        assert all(name.startswith("_Z") == ("split_smem_row" in name) for name in names), names
        # no spills, except one word in a cluster kernel's (or its out-of-line body's) unaligned
        # variant (nvcc 13: the cluster body's chunk bound, stored once before the row's passes
        # and read once after them)
        for name, line in zip(names, spills):
            stores, loads = (int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", line))
            unaligned = re.fullmatch(r"topk_cluster_c[248]_t\d+_a0(_slots)?"
                                     r"|_Z14split_smem_rowILi\d+ELi\d+ELb0E\w*", name)
            allowed = 8 if unaligned else 0
            assert stores <= allowed and loads <= allowed, (name, line)
        # a cluster kernel's static shared memory within what the host leaves beside a plan's
        static = re.findall(r"Function properties for (topk_cluster_\w+)\n.*\n.*?(\d+) bytes smem", log)
        assert len(static) == 2 * clusters, log
        assert max(int(b) for _, b in static) <= cuda_topk.STATIC_SMEM_RESERVE, static
        assert "_slots" not in log  # (the slots entries: their own module)


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_the_slots_module_holds_every_cluster_kernels_slots_entry_and_nothing_else():
    options = (*cuda_topk.SLOTS_OPTIONS, "--ptxas-options=-v")
    code, log = cuda_topk.compile_source("sm_90", extra_options=options)
    assert len(code) > 1000
    names = re.findall(r"Function properties for (\w+)", log)
    entries = sorted(n for n in names if not n.startswith("_Z"))
    want = sorted(cuda_topk.cluster_kernel_name(c, a, t, slots=True) for c in cuda_topk.CLUSTER_SIZES
                  for a in (True, False) for t in cuda_topk.CLUSTER_THREADS)
    assert entries == want, entries
    spills = [ln for ln in log.splitlines() if "spill" in ln]
    assert len(spills) == len(names)
    for name, line in zip(names, spills):  # as the library's: a word at most in an unaligned entry
        stores, loads = (int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", line))
        unaligned = re.fullmatch(r"topk_cluster_c[248]_t\d+_a0_slots|_Z14split_smem_rowILi\d+ELi\d+ELb0E\w*",
                                 name)
        allowed = 8 if unaligned else 0
        assert stores <= allowed and loads <= allowed, (name, line)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 64, regs
    static = re.findall(r"Function properties for (topk_cluster_\w+)\n.*\n.*?(\d+) bytes smem", log)
    assert len(static) == len(want) and max(int(b) for _, b in static) <= cuda_topk.STATIC_SMEM_RESERVE


def test_status_says_why_without_a_device():
    ok, why = cuda_topk.status()
    if not torch.cuda.is_available():
        assert not ok and why == "no CUDA device"
    assert isinstance(why, str) and why


def _bench_tool(name: str):
    """tools/<name>.py as a module."""
    from scripts import load_script

    return load_script(name)


def _phases_tool():
    return _bench_tool("cuda_topk_phases")


def test_the_phase_tool_sizes_each_source_by_its_own_layout():
    """tools/cuda_topk_phases.py: a copy of the source is launched with the shared memory its
    own pass counts take (a copy that lays out more than the library's host sizes for would read
    past its allocation); the library's source gets the planner's sizes; a copy that cannot fit
    or whose layout cannot be read is refused."""
    ph = _phases_tool()
    lib = cuda_topk.source()
    assert ph.source_pass_words(lib) == (cuda_topk.SOLO_PASS_WORDS, 2 * cuda_topk.CLUSTER_PASS_WORDS)
    for rows, width, threads in [(1, 4096, None), (64, 65536, None), (1, 131072, None), (16, 131072, 512)]:
        plan = cuda_topk.plan_cluster(rows, width, 132, H200_SMEM, threads=threads)
        assert ph.source_plan(plan, plan.cluster, lib, H200_SMEM) == plan
    words = "constexpr int words = C == 1 ? SOLO_WORDS : 2 * PASS_WORDS;"
    assert lib.count(words) == 1
    bigger = lib.replace(words, "constexpr int words = C == 1 ? SOLO_WORDS : SPLIT_WORDS;").replace(
        "#define SOLO_WORDS", "#define SPLIT_WORDS (2 * 4096 + 4 * 2048 + 256)\n#define SOLO_WORDS")
    assert ph.source_pass_words(bigger) == (cuda_topk.SOLO_PASS_WORDS, 16640)
    plan = cuda_topk.plan_cluster(64, 65536, 132, H200_SMEM)
    assert (plan.cluster, plan.cap) == (2, 32768)
    assert ph.source_plan(plan, 2, bigger, H200_SMEM).smem == 4 * (16640 + 32768 + 4 * 1024) > plan.smem
    with pytest.raises(ValueError, match="bytes of shared memory"):
        ph.source_plan(cuda_topk.plan_cluster(64, 131072, 132, H200_SMEM), 2, bigger, H200_SMEM)
    with pytest.raises(ValueError, match="no `constexpr int words"):
        ph.source_pass_words(lib.replace(words, ""))
    with pytest.raises(ValueError, match="UNKNOWN_WORDS is not a #define"):
        ph.source_pass_words(lib.replace(words, "constexpr int words = C == 1 ? UNKNOWN_WORDS : 8;"))


def test_phase_cuts_anchor_in_the_library_source():
    """tools/cuda_topk_phases.py: every cut finds its place in topk.cu (a refactor that
    moves one fails here, not on the GPU host), and keeping one kernel drops every other one."""
    ph = _phases_tool()
    source = cuda_topk.source()
    for stop, anchor, _ in ph.CUTS:
        assert anchor in source, (stop, anchor)
    text = ph.cut_source(22, keep={(8, 1024)})
    assert text.startswith("#define STOP_AT 22\n") and "if (STOP_AT == 22)" in text
    kernels = re.findall(r"^(?:TOPK_CLUSTER_KERNEL|TOPK_KERNEL|DCP_MERGE_KERNEL)\(.*$", text, flags=re.M)
    assert kernels == ["TOPK_CLUSTER_KERNEL(8, 1024, 1)"]
    # an instantiation with a trailing comment (16 CTAs) is kept too
    kept = ph.keep_kernels(source, {(16, 1024)})
    kernels = re.findall(r"^(?:TOPK_CLUSTER_KERNEL|TOPK_KERNEL|DCP_MERGE_KERNEL)\(.*$", kept, flags=re.M)
    assert [k.split("//")[0].strip() for k in kernels] == ["TOPK_CLUSTER_KERNEL(16, 1024, 1)"]
    with pytest.raises(ValueError, match="instantiates none"):
        ph.keep_kernels(source, {(3, 1024)})


def test_the_phase_tool_times_the_slots_entries(monkeypatch, capsys):
    """tools/cuda_topk_phases.py --slots PAGE: the slots module's entry of a cut source (the
    one the tool launches, by the library's name), a page table of distinct pages per row that
    covers the width, and a page size that is not a power of two up to 2^20 refused (the library's
    check, reference.page_size_bits, whose message the tool prefixes with ``--slots:``)."""
    ph = _phases_tool()
    assert ph.ref.page_size_bits(64) == 6 and ph.ref.page_size_bits(1) == 0
    for bad in (48, 2 ** 21):
        with pytest.raises(ValueError, match="page_size: must be a power of two"):
            ph.ref.page_size_bits(bad)
    with pytest.raises(ValueError, match="page_size: must be >= 1"):
        ph.ref.page_size_bits(0)
    monkeypatch.setattr(sys, "argv", ["cuda_topk_phases.py", "--slots", "48"])
    with pytest.raises(SystemExit) as exit_:  # refused before it looks for a device
        ph.main()
    assert exit_.value.code == 2 and "--slots: page_size: must be a power of two" in capsys.readouterr().err
    table = ph.slots_page_table(3, 4097, 6, 5, "cpu")
    assert table.dtype == torch.int32 and tuple(table.shape) == (3, 65)
    assert all(len(set(row.tolist())) == 65 for row in table)
    ok, why = cuda_topk.compiler_status()
    if not ok:
        pytest.skip(why)
    text = ph.cut_source(99, (ph.SLOTS_DEFINE,), keep={(1, 512)})
    cubin, _ = cuda_topk.compile_source("sm_90a", text=text)
    name = cuda_topk.cluster_kernel_name(1, True, 512, slots=True)
    positions = cuda_topk.cluster_kernel_name(1, True, 512).encode() + b"\0"
    assert name.encode() in cubin and positions not in cubin


class _FakeDriver:
    """What load_cluster_function asks of cuda-bindings' driver, recorded."""

    class CUfunction_attribute:  # noqa: N801 (the driver's name)
        CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = "non-portable"
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = "smem"

    def __init__(self):
        self.set = []

    def cuModuleGetFunction(self, module, name):  # noqa: N802
        return 0, ("fn", module, name)

    def cuFuncSetAttribute(self, fn, attr, value):  # noqa: N802
        self.set.append((fn[2], attr, value))
        return (0,)


@pytest.mark.parametrize("cluster", cuda_topk.CLUSTER_SIZES)
def test_a_tool_loaded_kernel_gets_its_cluster_size_and_shared_memory(cluster):
    """cuda_topk.load_cluster_function (the phase, trace and profile tools' kernels): a 16-CTA
    kernel is allowed the non-portable size (without it the launch is refused), a
    smaller one is not touched, and every kernel gets its shared memory."""
    drv = _FakeDriver()
    name = cuda_topk.cluster_kernel_name(cluster, True)
    fn = cuda_topk.load_cluster_function(drv, "module", name, 123456)
    assert fn == ("fn", "module", name.encode())
    want = [(name.encode(), "smem", 123456)]
    if cluster > cuda_topk.PORTABLE_CLUSTER:
        want.insert(0, (name.encode(), "non-portable", 1))
    assert drv.set == want


def test_phase_tool_compares_selections_as_sets_per_row():
    """cuda_topk_phases.same_sets: a source whose rows hold the same positions in another order is
    the same selection; one position changed, or positions moved to another row, is not."""
    ph = _phases_tool()
    a = torch.tensor([[0, 5, 9, -1], [1, 2, 3, 4]])
    assert ph.same_sets(a, torch.tensor([[9, 0, 5, -1], [4, 3, 2, 1]]))
    assert not ph.same_sets(a, torch.tensor([[0, 5, 8, -1], [1, 2, 3, 4]]))
    assert not ph.same_sets(a, torch.tensor([[1, 2, 3, 4], [0, 5, 9, -1]]))


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_phase_cut_compiles():
    """The finest cuts inside the register body compile (one kept kernel: seconds), and the whole
    kernel's registers and spills are read from ptxas's report as the tool prints them."""
    ph = _phases_tool()
    for stop in (22, 31):
        cubin, _ = cuda_topk.compile_source("sm_90", text=ph.cut_source(stop, keep={(8, 1024), (1, 1024)}))
        assert len(cubin) > 1000
    cubin, log = ph._compile_reported("sm_90a", ph.cut_source(99, keep={(8, 1024)}))
    regs, spilled = ph.kernel_resources(log, cuda_topk.cluster_kernel_name(8, True, 1024))
    assert 32 <= regs <= 64 and spilled == 0  # __launch_bounds__(1024, 1): at most 64
    assert ph.kernel_resources(log, cuda_topk.cluster_kernel_name(4, True, 1024)) is None  # not kept
    # the trace tool loads what its _compile (the phases tool's) returns: the cubin itself
    tr = _bench_tool("cuda_topk_trace")
    assert isinstance(tr._compile("sm_90a", ph.cut_source(99, keep={(8, 1024)})), bytes)


def test_phase_tool_reads_each_kernels_resources_from_a_ptxas_log():
    ph = _phases_tool()
    log = """ptxas info    : Compiling entry function 'topk_cluster_c16_t1024_a1' for 'sm_90a'
ptxas info    : Function properties for topk_cluster_c16_t1024_a1
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 880 bytes smem
ptxas info    : Compiling entry function 'topk_cluster_c1_t1024_a1' for 'sm_90a'
ptxas info    : Function properties for topk_cluster_c1_t1024_a1
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 58 registers, used 1 barriers, 880 bytes smem
"""
    assert ph.kernel_resources(log, "topk_cluster_c16_t1024_a1") == (64, 4)
    assert ph.kernel_resources(log, "topk_cluster_c1_t1024_a1") == (58, 0)
    assert ph.kernel_resources(log, "topk_cluster_c1_t512_a1") is None


def test_trace_stamps_anchor_in_the_library_source():
    """tools/cuda_topk_trace.py: every stamp finds its place in topk.cu, each slot is
    stamped, and a source without an anchor is refused by name."""
    tr = _bench_tool("cuda_topk_trace")
    text = tr.traced_source(None, {(1, 512)})
    for slot, _, anchor, _ in tr.POINTS:
        assert f"vss_stamp({slot});\n{anchor}" in text, (slot, anchor)
    assert len({p[0] for p in tr.POINTS}) == len(tr.POINTS) and max(p[0] for p in tr.POINTS) < tr.GT_END
    with pytest.raises(ValueError, match="anchor not in the source"):
        tr.traced_source(cuda_topk.source().replace("    // collect: per group", "    // gather"), None)


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_traced_source_compiles():
    tr = _bench_tool("cuda_topk_trace")
    cubin, _ = cuda_topk.compile_source("sm_90", text=tr.traced_source(None, {(1, 512)}))
    assert len(cubin) > 1000


def test_step_timeline_stamps_every_cluster_kernel_once():
    """tools/step_timeline.py: the entry, release and end stamps find their one place each in
    topk.cu (the release right after the dependency wait, the end after the row), and a
    source that moved an anchor is refused by name."""
    st = _bench_tool("step_timeline")
    text = st.stamped_source(cuda_topk.source())
    assert text.count("vss_released();") == 1  # the one call (the prelude defines it)
    assert 'griddepcontrol.wait;" ::: "memory");\n    vss_released();' in text
    macro = text[text.index("#define TOPK_CLUSTER_ENTRY"):]
    macro = macro[:macro.index("TOPK_CLUSTER_KERNEL(1, 1024, 1)")]
    assert macro.index("vss_entry();") < macro.index("topk_cluster_row<") < macro.index("vss_end();")
    assert "pages); vss_end();" in macro
    # sources from before the kernels' page-table and lens_early parameters (--source variants) too
    before_pages, n = re.subn(r"cap,[\s\\]*lens_early, page_table, page_stride, page_bits,[\s\\]*pages\);",
                              "cap, lens_early);", cuda_topk.source())
    assert n == 1 and "lens_early); vss_end();" in st.stamped_source(before_pages)
    older = before_pages.replace("cap, lens_early);", "cap);")
    assert "nan_low, cap); vss_end();" in st.stamped_source(older)
    with pytest.raises(ValueError, match="anchor not once"):
        st.stamped_source(cuda_topk.source().replace("griddepcontrol.wait;", "griddepcontrol.wait ;"))


def test_step_timeline_means_follow_the_launch_records():
    """step_timeline.launch_stats on records of known times: the gap skips each replay's first
    launch, the clock is cycles over nanoseconds, and a launch with no CTA recorded is refused."""
    st = _bench_tool("step_timeline")
    rec = st.empty_records()
    f = {name: i for i, name in enumerate(st.FIELDS)}
    ends = [10_000, 30_000, 51_000, 100_000]  # ns: two replays of two launches
    for i, end in enumerate(ends):
        rec[i, f["entry_min"]] = end - 6000
        rec[i, f["release_min"]] = end - 4000
        rec[i, f["release_max"]] = end - 3000 - 1000 * (i % 2)
        rec[i, f["end_max"]] = end
        rec[i, f["slowest_cycles"]] = 7000
        rec[i, f["cycles"]] = 2 * 3500
        rec[i, f["ns"]] = 2 * 2000
        rec[i, f["ctas"]] = 2
    s = st.launch_stats(rec, 4, 2)
    assert s["mhz"] == pytest.approx(1750.0)
    assert s["gap_us"] == pytest.approx(((30_000 - 4000 - 10_000) + (100_000 - 4000 - 51_000)) / 2e3)
    assert s["span_us"] == pytest.approx(4.0) and s["early_us"] == pytest.approx(2.0)
    assert s["spread_us"] == pytest.approx(0.0) and s["slowest_us"] == pytest.approx(4.0)
    assert s["ctas"] == 2 and s["launches"] == 4
    rec[3, f["ctas"]] = 0
    with pytest.raises(ValueError, match="unequal CTA counts"):
        st.launch_stats(rec, 4, 2)
    with pytest.raises(ValueError, match="at most"):
        st.launch_stats(rec, st.SLOTS + 1, 2)


def test_step_timeline_variants_parse_and_a_malformed_one_is_refused_by_name():
    """``NAME=[TOPK_PATH][:MACRO=V,...]``: the top-k copy may be empty (the library's), the macros
    go to the scorer's build in order; a missing name or a macro that is not MACRO=INT is refused."""
    st = _bench_tool("step_timeline")
    assert st.parse_variant("evict=:KEYS_EVICT_FIRST=1,STAGES_SHORT=8") == (
        "evict", "", (("KEYS_EVICT_FIRST", 1), ("STAGES_SHORT", 8)))
    assert st.parse_variant("old=.dev/old.cu") == ("old", ".dev/old.cu", ())
    for bad, why in (("noname", "want NAME="), ("a b=x.cu", "want NAME="), ("e=:keys=1", "'keys=1'"),
                     ("e=:K=one", "'K=one'")):
        with pytest.raises(ValueError, match=why):
            st.parse_variant(bad)


def test_step_timeline_times_the_configured_step_and_refuses_a_bad_config_before_the_gpu(monkeypatch, capsys):
    """``--config`` (as indexer.py's) is the step's config, the defaults without it; a bad key or
    value ends the run with argparse's exit 2 naming the option, before anything needs a GPU."""
    import argparse
    import sys

    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG

    tl = _bench_tool("step_timeline")
    ap = argparse.ArgumentParser()
    assert tl.step_config(ap, "precise=false").precise is False
    assert tl.step_config(ap, "") == DEFAULT_CONFIG
    for bad, why in (("precise=maybe", "takes true or false"), ("nope=1", "nope")):
        monkeypatch.setattr(sys, "argv", ["step_timeline.py", "--shapes", "1x4096", "--config", bad])
        with pytest.raises(SystemExit) as exc:
            tl.main()
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--config" in err and why in err


def test_step_timeline_names_each_variant_whose_selection_differs_once():
    """The rows a run writes decide its exit: every shape and variant whose step selected
    otherwise (either part's row says so) is named once, in order; none, and the run passes."""
    st = _bench_tool("step_timeline")

    def row(B, variant, part, same):
        return dict(B=B, L=4096, variant=variant, part=part, same_selection=same)

    rows = [row(1, "late", "step", True), row(1, "late", "topk", True), row(1, "A", "step", False),
            row(1, "A", "topk", False), row(8, "A", "step", True), row(8, "B", "step", False)]
    assert st.selection_failures(rows) == ["1x4096 A", "8x4096 B"]
    assert st.selection_failures([r for r in rows if r["same_selection"]]) == []


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_step_timeline_stamped_source_compiles():
    st = _bench_tool("step_timeline")
    ph = _phases_tool()
    text = st.stamped_source(ph.keep_kernels(cuda_topk.source(), {(2, 1024)}))
    cubin, _ = cuda_topk.compile_source("sm_90", text=text)
    assert len(cubin) > 1000


def test_benchmark_cases_parse_to_the_planner_launches():
    """``C:BxL[/W][@T]``: the width defaults to L and the threads to the planner's; a malformed
    case or one the planner refuses raises naming it."""
    ph = _phases_tool()
    got = ph.parse_cases("1:1x4096,8:1x4096/131072,1:128x8192@1024,2:64x65536", 132, H200_SMEM)
    assert [(c, b, n, w, p.cluster, p.threads) for c, b, n, w, p in got] == [
        (1, 1, 4096, 4096, 1, 512), (8, 1, 4096, 131072, 8, 1024), (1, 128, 8192, 8192, 1, 1024),
        (2, 64, 65536, 65536, 2, 1024)]
    assert got[0][4] == cuda_topk.plan_cluster(1, 4096, 132, H200_SMEM, cluster=1)
    for bad in ("1x4096", "1:1x4096@", "a:1x4096", "1:1x4096/"):
        with pytest.raises(ValueError, match="want C:BxL"):
            ph.parse_cases(bad, 132, H200_SMEM)
    with pytest.raises(ValueError, match="cannot plan"):
        ph.parse_cases("1:0x4096", 132, H200_SMEM)
    with pytest.raises(ValueError, match="cluster threads"):
        ph.parse_cases("1:1x4096@256", 132, H200_SMEM)
