"""The NVRTC-compiled CUDA top-k (``cuda_radix``) on a CUDA device: exact sets against the
reference, the whole step on the route "auto" picks for many rows, capture and replay with new
lengths, no host sync. Skips without CUDA or without cuda-bindings/NVRTC (with the reason)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from late_writer import late_copier

from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.cuda import topk_emu as emu
from vllm_sparse_sync.kernels.synth import make_case
from vllm_sparse_sync.kernels.verify import topk_violations


def _status() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "needs a CUDA device"
    from vllm_sparse_sync.kernels.cuda.topk import status

    return status("cuda")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _status()[0], reason=f"CUDA top-k: {_status()[1]}")]
DEV = "cuda"
K = 2048


ROUTES = ["cta", 1, 2, 4, 8, 16, "auto"]
"""the one-CTA-per-row kernel, then the cluster route with N CTAs per row or the planner's size"""


def _launch(x, lens, out, active=None, k=K, route="cta", cap=None):
    from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk, launch_cuda_topk_cluster

    if route == "cta":
        launch_cuda_topk(x, x.stride(0), lens, active, out, k, x.shape[1])
    else:
        if torch.cuda.get_device_capability() < (9, 0):
            pytest.skip("the cluster route needs sm_90+")
        launch_cuda_topk_cluster(x, x.stride(0), lens, active, out, k, x.shape[1],
                                 cluster=None if route == "auto" else route, cap=cap)
    return out


def _sets(t):
    return t.sort(1).values


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("ties", [False, True])
def test_exact_sets_on_every_length(ties, route):
    g = torch.Generator(device=DEV).manual_seed(3)
    lens = [0, 1, 100, K - 1, K, K + 1, 5000, 65536, 131072, 70001]
    x = torch.randn(len(lens), 131072, device=DEV, generator=g)
    if ties:
        x = x.round(decimals=0)
    row_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for active in (None, torch.tensor([60000], dtype=torch.int32, device=DEV)):
        got = _launch(x, row_lens, torch.empty(len(lens), K, dtype=torch.int32, device=DEV), active,
                      route=route)
        want = ref.topk_indices(x, row_lens, K, active_width=active)
        assert torch.equal(_sets(got), _sets(want))
        # every route writes the specification's row: the selection in ascending position order
        one_cta = _launch(x, row_lens, torch.empty_like(got), active)
        assert torch.equal(got, one_cta)
        assert torch.equal(got.cpu(), emu.topk_indices(x.cpu(), row_lens.cpu(), K,
                                                       active_width=None if active is None else active.cpu()))


def test_the_default_route_for_many_rows_is_the_cuda_top_k_and_is_exact():
    from vllm_sparse_sync.kernels import ops
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    lens = [(i * 7919) % 40000 for i in range(48)]
    lens[0] = 40000
    case = make_case(lens, heads=64, device=DEV, seed=5)
    width = case.block_table.shape[1] * 64
    ws = IndexerTopkWorkspace(len(lens), K, width, DEV)
    assert ws.plan_call(len(lens), width, 64).kind == "cuda_radix"
    got = ops.indexer_topk(*case.args, K, workspace=ws)
    dense = ops.paged_indexer_logits(*case.args, width)
    eff = ref.effective_lengths(case.row_lens, width)
    finite = dense[torch.isfinite(dense)]
    tol = 1e-5 * float(finite.abs().max()) + 1e-5
    assert topk_violations(got, dense, eff, K, tol=tol) == []


@pytest.mark.parametrize("nan_low", [True, False])
@pytest.mark.parametrize("route", [1, 8])
def test_nan_and_inf_order_like_the_one_cta_kernel(route, nan_low):
    from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk, launch_cuda_topk_cluster

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster route needs sm_90+")
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(3, 30000, device=DEV, generator=g)
    p = torch.rand(3, 30000, device=DEV, generator=g)
    x[p < 0.2] = float("-inf")
    x[(p >= 0.2) & (p < 0.3)] = float("nan")
    x[(p >= 0.3) & (p < 0.35)] = -float("nan")
    x[(p >= 0.35) & (p < 0.37)] = float("inf")
    lens = torch.tensor([30000, 20000, 4000], dtype=torch.int32, device=DEV)
    got = torch.empty(3, K, dtype=torch.int32, device=DEV)
    want = torch.empty_like(got)
    launch_cuda_topk_cluster(x, x.stride(0), lens, None, got, K, x.shape[1], nan_low=nan_low, cluster=route)
    launch_cuda_topk(x, x.stride(0), lens, None, want, K, x.shape[1], nan_low=nan_low)
    assert torch.equal(got, want)
    if nan_low:  # NaN ranks below every number: none is picked while numbers remain
        assert torch.equal(_sets(got), _sets(ref.topk_indices(x, lens, K)))


@pytest.mark.parametrize("threads", [1024, 512])
@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 16])
def test_every_cluster_launch_size_runs(cluster, threads):
    """Every shared-memory size the planner can ask for launches (48 KB and up need the opt-in,
    the kernel's static share included), and writes the one-CTA kernel's output."""
    from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk_cluster

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster route needs sm_90+")
    g = torch.Generator(device=DEV).manual_seed(cluster)
    for width in (2500, 4096, 8192, 12000, 16384, 65536, 131072):
        x = torch.randn(2, width, device=DEV, generator=g)
        lens = torch.tensor([width, width // 2], dtype=torch.int32, device=DEV)
        got = torch.empty(2, K, dtype=torch.int32, device=DEV)
        launch_cuda_topk_cluster(x, x.stride(0), lens, None, got, K, width, cluster=cluster, threads=threads)
        assert torch.equal(got, _launch(x, lens, torch.empty_like(got))), width


@pytest.mark.parametrize("cluster", [8, 16])
def test_wide_clusters_run_chunks_past_the_registers_out_of_line(cluster):
    """8 and 16 CTAs of 1024 threads: a row whose chunk is longer than the registers hold (past
    cluster x 16K keys) runs the shared-memory body compiled out of line (split_smem_row), and
    selects what the one-CTA kernel does, in the same order; rows on either side of the edge too."""
    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster route needs sm_90+")
    edge = cluster * 4 * 4 * 1024  # cuda_topk_emu.chunks_in_registers' longest row
    width = edge + 60000
    g = torch.Generator(device=DEV).manual_seed(cluster)
    x = torch.randn(5, width, device=DEV, generator=g)
    x[4] = x[4].round()  # many equal keys: the threshold's ties span the chunks
    lens = torch.tensor([width, edge + 4, edge, edge - 4, width - 3], dtype=torch.int32, device=DEV)
    got = torch.empty(5, K, dtype=torch.int32, device=DEV)
    plan = cuda_topk.launch_cuda_topk_cluster(x, x.stride(0), lens, None, got, K, width, cluster=cluster,
                                              threads=1024)
    if cluster > cuda_topk.PORTABLE_CLUSTER and plan.cluster != cluster:
        pytest.skip(f"this device cannot launch {cluster}-CTA clusters")
    assert plan.cluster == cluster and plan.threads == 1024
    assert torch.equal(got, _launch(x, lens, torch.empty_like(got)))
    assert torch.equal(_sets(got), _sets(ref.topk_indices(x, lens, K)))


@pytest.mark.parametrize("route", [1, 4])
@pytest.mark.parametrize("cap", [4, 1000, 6000])
def test_cluster_chunks_longer_than_shared_memory_read_the_rest_from_global(route, cap):
    g = torch.Generator(device=DEV).manual_seed(cap + route)
    lens = [0, K, K + 1, 5000, 23999, 24000]
    x = torch.randn(len(lens), 24000, device=DEV, generator=g)
    x[1::2] = x[1::2].round(decimals=0)  # ties across the shared/global boundary
    row_lens = torch.tensor(lens, dtype=torch.int64, device=DEV)
    got = _launch(x, row_lens, torch.empty(len(lens), K, dtype=torch.int32, device=DEV), route=route, cap=cap)
    assert torch.equal(got, _launch(x, row_lens, torch.empty_like(got)))


def _listed_rows(n=40000):
    """Rows whose k-th key's bin is small: resolved from a list of at most TIE_MAX keys, ranked by
    key then position, at 11 bits (row 0: four keys in one bin, two needed, equal keys) and at
    22 bits (row 1: five keys sharing 22 bits inside a bin of 45)."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for big, tail in [(K - 2, [1.01, 1.0, 1.01, 1.01]),
                      (K - 16, [1.0 + j * 0.004 for j in range(40)]
                       + [1.1 + d * 2**-23 for d in (3, 1, 3, 2)])]:
        x = -1.0 - torch.rand(n, generator=g)  # below every selected key
        pos = torch.randperm(n, generator=g)
        x[pos[:big]] = 100.0 + torch.arange(big, dtype=torch.float32)
        x[pos[big:big + len(tail)]] = torch.tensor(tail)
        rows.append(x)
    return torch.stack(rows)


@pytest.mark.parametrize("route", [1, 2, 4, 8])
def test_listed_bins_rank_by_key_then_position(route):
    from vllm_sparse_sync.kernels.cuda import topk_emu as emu

    x = _listed_rows()
    plans = [emu.plan_cluster_row(emu.order_keys(r), K, solo=route == 1) for r in x]
    want_plans = {1: [(15, True, 4, 2), (15, True, 8, 4)]}.get(route, [(11, True, 4, 2), (22, True, 5, 2)])
    assert [(p.bits, p.listed, p.count, p.need) for p in plans] == want_plans
    xd = x.to(DEV)
    lens = torch.full((2,), x.shape[1], dtype=torch.int32, device=DEV)
    got = _launch(xd, lens, torch.empty(2, K, dtype=torch.int32, device=DEV), route=route)
    assert torch.equal(got.cpu(), emu.topk_indices(x, lens.cpu(), K))
    assert torch.equal(got, _launch(xd, lens, torch.empty_like(got)))


@pytest.mark.parametrize("route", [1, 8])
@pytest.mark.parametrize("width", [12000, 131072])
def test_listed_bins_in_registers_rank_by_key_then_position(route, width):
    """A row held in registers (at most 16384 keys) gathers a listed bin's keys unordered and
    closes the selection at the last key it ranks in: equal keys and neighbouring positions,
    on the exact bound and under a wide one whose tail would win if read."""
    x = _listed_rows(12000)
    plans = [emu.plan_cluster_row(emu.order_keys(r), K, solo=True) for r in x]
    assert [(p.listed, p.count, p.need) for p in plans] == [(True, 4, 2), (True, 8, 4)]
    rows = torch.full((2, width), 1e30)
    rows[:, :12000] = x
    lens = torch.full((2,), 12000, dtype=torch.int32)
    got = _launch(rows.to(DEV), lens.to(DEV), torch.empty(2, K, dtype=torch.int32, device=DEV), route=route)
    assert torch.equal(got.cpu(), emu.topk_indices(rows, lens, K))


def _row_with_ties(n: int, k: int, need: int, listed: int, distinct: int, seed: int) -> torch.Tensor:
    """n scores whose k-th largest lies among `listed` keys of 1..distinct values in [1, 1 +
    2^-13), one pass-A bin on every route (64 per octave, or u >> 21), at random positions:
    k - need keys above them, the rest below; `need` of them selected."""
    g = torch.Generator().manual_seed(seed)
    x = -1.0 - torch.rand(n, generator=g)  # below every selected key
    pos = torch.randperm(n, generator=g)
    above = k - need
    x[pos[:above]] = 100.0 + torch.arange(above, dtype=torch.float32)
    values = 1.0 + torch.randint(0, min(distinct, listed), (listed,), generator=g).float() * 2**-20
    x[pos[above:above + listed]] = values
    return x


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# n leaves room for the k - need keys above the listed bin and its up to 128 keys at k = 2048
@given(n=st.integers(2048 + 128, 16384), listed=st.integers(2, 128), distinct=st.integers(1, 128),
       k=st.sampled_from([64, 2048]), data=st.data())
def test_one_cta_listed_bins_of_every_size_write_the_emulated_row(n, listed, distinct, k, data):
    """A row in registers whose pass-A bin of the k-th key holds 2-128 keys (ranked by groups
    of threads by key, then position), with 1..listed distinct values in it and equal keys at
    random positions: element for element against the emulation, on the C = 1 kernel of 1024
    and 512 threads and on a cluster's first CTA under the 128K bound."""
    from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk_cluster

    need = data.draw(st.integers(1, min(listed - 1, k)), label="need")
    x = _row_with_ties(n, k, need, listed, distinct, data.draw(st.integers(0, 2**31 - 1), label="seed"))
    plan = emu.plan_cluster_row(emu.order_keys(x), k, solo=True)
    assert (plan.listed, plan.count, plan.need, plan.passes) == (True, listed, need, 0)
    lens = torch.tensor([n], dtype=torch.int32)
    want = emu.topk_indices(x[None], lens, k)
    launches = [(1, n, 1024), (8, 131072, 1024)] + ([(1, n, 512)] if n <= 8192 else [])
    for route, width, threads in launches:
        row = torch.full((1, width), 1e30)  # a tail past the live length that would win
        row[0, :n] = x
        xd = row.to(DEV)
        out = torch.empty(1, k, dtype=torch.int32, device=DEV)
        launch_cuda_topk_cluster(xd, xd.stride(0), lens.to(DEV), None, out, k, width, cluster=route,
                                 threads=threads)
        assert torch.equal(out.cpu(), want), (route, width, threads)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=st.sampled_from([2, 4]), extra=st.integers(1, 20000), listed=st.integers(2, 128),
       distinct=st.integers(1, 128), k=st.sampled_from([64, 2048]), small_cap=st.booleans(), data=st.data())
def test_split_rows_from_shared_memory_with_ties_of_every_size(cluster, extra, listed, distinct, k,
                                                                small_cap, data):
    """A split row whose chunks exceed the registers (read into shared memory): the k-th key's
    pass-A bin holds 2-128 keys of 1..listed distinct values at random positions of every chunk:
    listed at once (at most TIE_MAX: gathered into every CTA's list, ranked by key, then
    position), else refined; keys past a small ``cap`` from global memory. Element for element
    against the emulation."""
    from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk_cluster

    n = 16384 * cluster + extra
    need = data.draw(st.integers(1, min(listed - 1, k)), label="need")
    x = _row_with_ties(n, k, need, listed, distinct, data.draw(st.integers(0, 2**31 - 1), label="seed"))
    cap = 8192 if small_cap else None
    assert not emu.runs_solo(n, cluster, cap or n) and not emu.chunks_in_registers(n, cluster, cap or n)
    plan = emu.plan_cluster_row(emu.order_keys(x), k)
    assert (plan.passes == 0) == (listed <= emu.TIE_MAX) and plan.count <= listed
    lens = torch.tensor([n], dtype=torch.int32)
    xd = x[None].to(DEV)
    out = torch.empty(1, k, dtype=torch.int32, device=DEV)
    launch_cuda_topk_cluster(xd, xd.stride(0), lens.to(DEV), None, out, k, n, cluster=cluster, cap=cap)
    assert torch.equal(out.cpu(), emu.topk_indices(x[None], lens, k)), (n, cluster, cap)


@pytest.mark.parametrize("cluster", [2, 4])
@pytest.mark.parametrize("exact", [True, False])
def test_split_rows_from_shared_memory_at_every_level(cluster, exact):
    """The split body from shared memory (chunks of more than 16384 keys) on rows for each of its
    levels: a list after pass A and after one refine pass, indexer-like rows, one key value
    after two passes (inner and edge keys); live lengths below a host width whose tail would
    win if read, and rows that split into other chunks than the host width's. Element for
    element against the emulation."""
    g = torch.Generator().manual_seed(30 + cluster)
    n = 16384 * cluster + 3000
    edge = torch.cat([torch.full((100,), 2.0**-14 * (1 + 2**-6)), torch.full((n // 2,), 2.0**-14),
                      torch.zeros(n - n // 2 - 100)])
    listed = _listed_rows(n)
    cases = [  # (live scores, k, refine passes, listed)
        (listed[0], K, 0, True),
        (listed[1], K, 1, True),
        (torch.randn(n, generator=g) * 19 + 8.5, K, 1, None),
        (torch.ones(n), K, 2, False),
        (torch.full((n,), -0.0), K, 2, False),
        (edge[torch.randperm(n, generator=g)], 150, 2, False),
        (1.0 + torch.randperm(n, generator=g).float() * 2**-22, 100, 2, False),
        (torch.randn(n - 2999, generator=g) * 19 + 8.5, K, None, None),  # other chunks than the width's
    ]
    for live, k, passes, is_listed in cases:
        m = live.numel()
        assert not emu.chunks_in_registers(m, cluster, m) and not emu.runs_solo(m, cluster, m)
        plan = emu.plan_cluster_row(emu.order_keys(live), k)
        assert passes is None or plan.passes == passes, (k, plan)
        assert is_listed is None or plan.listed == is_listed, (k, plan)
        _assert_row_and_mirror(live, k, cluster, m if exact else 131072)


def test_sixteen_ctas_split_only_rows_past_eight_ctas_worth(monkeypatch):
    """The 16-CTA cluster runs a row of at most ``WIDE_SPLIT_KEYS`` live keys on its first 8
    CTAs (the rest leave at once) and splits a longer one over all 16: rows of every side of that
    edge under the 128K bound, element for element against the emulation; where the device cannot
    launch 16 (planted), the same call runs 8 CTAs and writes the same."""
    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster route needs sm_90+")
    edge = emu.WIDE_SPLIT_KEYS
    assert edge == cuda_topk.WIDE_CLUSTER_MIN_KEYS
    g = torch.Generator().manual_seed(16)
    lens = torch.tensor([16385, 40000, edge - 4, edge, edge + 1, edge + 4, 100000, 131072], dtype=torch.int32)
    x = torch.randn(len(lens), 131072, generator=g) * 7
    x[1, :30000] = 3.0  # one value taken across the chunks of 8
    assert [emu.split_ctas(int(n), 16) for n in lens] == [8] * 4 + [16] * 4
    want = emu.topk_indices(x, lens, K)
    mod = cuda_topk.module_for(0)
    out = torch.empty(len(lens), K, dtype=torch.int32, device=DEV)
    for able in (mod.cluster16, False):
        monkeypatch.setattr(mod, "cluster16", able)
        out.fill_(-7)
        plan = cuda_topk.launch_cuda_topk_cluster(x.to(DEV), 131072, lens.to(DEV), None, out, K, 131072,
                                                  cluster=16)
        assert plan.cluster == (16 if able else 8)
        assert torch.equal(out.cpu(), want), able


@pytest.mark.parametrize("cluster", [2, 4, 8, 16])
@pytest.mark.parametrize("exact", [True, False])
def test_chunks_in_registers_write_the_emulated_row(cluster, exact):
    """A row the cluster splits into chunks of at most 16384 keys runs from registers on every
    CTA: one key value taken across chunks (the first chunk holds half of what is needed; on the
    second row none), a 22-bit list, indexer-like rows of odd lengths; live lengths below a host
    width whose tail would win if read; chunks as long as the registers hold and rows whose
    live length splits into other chunks than the host width's. Element for element against the
    emulation."""
    from test_cuda_topk import _tie_across_chunks

    g = torch.Generator().manual_seed(cluster)
    n = 16384 * cluster - 100
    chunk = emu.cluster_chunks(n, cluster)[0][1]
    none_first = torch.ones(n)
    none_first[: chunk + 100] = 0.0
    cases = [_tie_across_chunks(n, cluster, K), none_first, _listed_rows(n)[1]]
    # rows shorter than the widest: chunks other than the host width's
    cases += [torch.randn(n - d, generator=g) * 19 + 8.5 for d in (0, 3, 40, 8000)]
    width = max(c.numel() for c in cases) if exact else 16384 * cluster
    rows = torch.full((len(cases), width), 1e30)
    for r, c in enumerate(cases):
        assert emu.chunks_in_registers(c.numel(), cluster, 8192)
        rows[r, :c.numel()] = c
    lens = torch.tensor([c.numel() for c in cases], dtype=torch.int32)
    got = _launch(rows.to(DEV), lens.to(DEV), torch.empty(len(cases), K, dtype=torch.int32, device=DEV),
                  route=cluster)
    assert torch.equal(got.cpu(), emu.topk_indices(rows, lens, K))


def _assert_row_and_mirror(live: torch.Tensor, k: int, route, width: int) -> None:
    """The live scores and their mirror as two rows of ``width`` whose tails past the live length
    would win if read: ``route``'s output equals the emulation's, element for element."""
    n = live.numel()
    rows = torch.full((2, width), 1e30)
    rows[:, :n] = live
    rows[1, :n] = live.flip(0)
    lens = torch.tensor([n, n], dtype=torch.int32)
    out = torch.empty(2, k, dtype=torch.int32, device=DEV)
    got = _launch(rows.to(DEV), lens.to(DEV), out, k=k, route=route)
    assert torch.equal(got.cpu(), emu.topk_indices(rows, lens, k)), (n, k, route, width)


@pytest.mark.parametrize("route,exact", [(1, False), (8, False), (1, True)])
def test_one_cta_levels_write_the_emulated_row(route, exact):
    """The one-CTA code (the C = 1 kernel, which reads a row's first keys beside its live length,
    and a short row on a cluster's first CTA) on rows for each of its levels: a list after pass A,
    refine passes in an inner and an edge bin, one key value; live lengths below the host width
    whose tails would win if read; keys past a small ``cap`` from global memory. Element for
    element against the emulation. ``exact``: the host width is the live length. These rows (at
    most 16384 keys) run from registers on either bound (keys past a small ``cap``: the
    longer rows of ``test_cluster_chunks_longer_than_shared_memory_read_the_rest_from_global``)."""
    from test_cuda_topk import _edge_row

    g = torch.Generator().manual_seed(3)
    cases = [  # (live scores, k, refine passes of the one-CTA plan)
        (torch.randn(4096, generator=g) * 19 + 8.5, K, 0),
        (torch.ones(5000), K, 2),
        (torch.full((5000,), -0.0), K, 3),
        (1.0 + torch.arange(4000) * 2**-22, 100, 1),
        (_edge_row(), 150, 3),
        (torch.randn(16384, generator=g) * 19 + 8.5, K, None),
    ]
    for live, k, passes in cases:
        plan = emu.plan_cluster_row(emu.order_keys(live), k, solo=True)
        assert passes is None or plan.passes == passes
        # a cluster's chunks of the 128K bound hold a 16K row: it runs on the first CTA
        _assert_row_and_mirror(live, k, route, live.numel() if exact else 131072)


@pytest.mark.parametrize("route", ["cta", 8, "auto"])
def test_capture_then_replay_with_new_lengths_and_width(route):
    rows, width = 8, 65536
    g = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(rows, width, device=DEV, generator=g)
    lens = torch.full((rows,), width, dtype=torch.int32, device=DEV)
    act = torch.tensor([width], dtype=torch.int32, device=DEV)
    out = torch.empty(rows, K, dtype=torch.int32, device=DEV)
    _launch(x, lens, out, act, route=route)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(x, lens, out, act, route=route)
    for seed, new_lens, a in [(1, [65536, 100, 0, 2048, 2049, 40000, 65535, 30000], 65536),
                              (2, [65536] * 8, 50000), (3, [5000] * 8, 4000)]:
        x.copy_(torch.randn(rows, width, device=DEV, generator=g).round(decimals=1 if seed == 2 else 4))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        act.fill_(a)
        graph.replay()
        want = ref.topk_indices(x, lens, K, active_width=act)
        assert torch.equal(_sets(out), _sets(want)), seed
        eager = _launch(x, lens, torch.empty_like(out), act, route=route)
        assert torch.equal(out, eager), seed  # deterministic order too


@pytest.mark.parametrize("route", ["cta", "auto", 8])
def test_no_host_sync(route):
    from vllm_sparse_sync.testing import check_step

    x = torch.randn(40, 16384, device=DEV)
    lens = torch.full((40,), 16384, dtype=torch.int32, device=DEV)
    out = torch.empty(40, K, dtype=torch.int32, device=DEV)
    _launch(x, lens, out, route=route)  # compile and load outside the check
    check = check_step(lambda: _launch(x, lens, out, route=route), where="cuda top-k")
    assert check.ran and not check.records


# the late writer waits 20 ms: longer than any kernel the suite's other xdist workers keep on the GPU,
# so the dependent launch has started by the time it writes
_LATE_NS = 20_000_000


@pytest.mark.parametrize("cluster", [1, 8])
def test_early_lengths_are_read_before_the_wait_and_only_where_asked(cluster):
    """``lens_early`` reads the lengths before the dependency wait: after a kernel that writes them
    late it sees the old ones (why only a step's top-k, after its scorer, asks for it); without
    it, and through ``topk_indices``, the top-k sees the new ones."""
    from vllm_sparse_sync.kernels import ops
    from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk_cluster

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster route needs sm_90+")
    copy = late_copier(DEV)
    rows, width, old, new = 2, 65536, 65536, 3000
    new_lens = torch.full((rows,), new, dtype=torch.int32, device=DEV)
    x = torch.randn(rows, width, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3))
    want = {n: ref.topk_indices(x, torch.full((rows,), n, dtype=torch.int32, device=DEV), K)
            for n in (old, new)}
    for early in (True, False):
        lens = torch.full((rows,), old, dtype=torch.int32, device=DEV)
        out = torch.empty(rows, K, dtype=torch.int32, device=DEV)
        # the kernel launched once first: CUDA's lazy loading would load its code at the first launch,
        # after the running writer's end (a load waits for it), and the top-k would start only then
        launch_cuda_topk_cluster(x, x.stride(0), lens, None, out, K, width, cluster=cluster, lens_early=early)
        torch.cuda.synchronize()
        copy(lens, new_lens, _LATE_NS)
        launch_cuda_topk_cluster(x, x.stride(0), lens, None, out, K, width, cluster=cluster, lens_early=early)
        torch.cuda.synchronize()
        assert torch.equal(_sets(out), _sets(want[old if early else new])), early
    lens = torch.full((rows,), old, dtype=torch.int32, device=DEV)
    copy(lens, new_lens, _LATE_NS)
    got = ops.topk_indices(x, lens, K)
    assert torch.equal(_sets(got), _sets(want[new]))


def test_the_step_reads_lengths_written_just_before_it():
    """The step's cluster top-k reads the lengths early (``lens_early``), after its scorer: a
    kernel that writes them just before the step is still seen, as the scorer starts after it."""
    from vllm_sparse_sync.kernels import ops
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster route needs sm_90+")
    copy = late_copier(DEV)
    lens = [40000, 30000, 5000, 64 * 300]
    case = make_case(lens, heads=64, device=DEV, seed=21)
    width = case.block_table.shape[1] * 64
    ws = IndexerTopkWorkspace(len(lens), K, width, DEV)
    assert ws.plan_call(len(lens), width, 64).topk_cluster
    new = 2100
    new_lens = torch.full_like(case.row_lens, new)
    want = ops.indexer_topk(*case.args[:4], new_lens, K, workspace=ws)
    copy(case.row_lens, new_lens, _LATE_NS)
    got = ops.indexer_topk(*case.args, K, workspace=ws)
    torch.cuda.synchronize()
    assert case.row_lens.tolist() == [new] * len(lens)
    assert torch.equal(got, want)


def _page_table(rows: int, pages: int, seed: int) -> torch.Tensor:
    """Distinct physical pages per row, on the device."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(2 * pages + 5, generator=g)[:pages] for _ in range(rows)]).to(
        device=DEV, dtype=torch.int32)


@pytest.mark.parametrize("route,cap", [(1, None), (2, None), (4, None), (8, None), (16, None), ("auto", None),
                                       (1, 1000), (4, 1000)])
def test_the_cluster_top_k_writes_kv_cache_slots_in_the_same_launch(route, cap):
    # every body (registers, shared memory, keys past cap from global, a split row, a short row)
    # writes each position's slot where a page table is given: the same row, mapped
    from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk_cluster

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster route needs sm_90+")
    g = torch.Generator(device=DEV).manual_seed(21)
    lens = [0, 1, 100, K - 1, K, K + 1, 5000, 12000, 40000, 65536, 131072, 70001]
    x = torch.randn(len(lens), 131072, device=DEV, generator=g)
    row_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for active in (None, torch.tensor([60000], dtype=torch.int32, device=DEV)):
        pos = _launch(x, row_lens, torch.empty(len(lens), K, dtype=torch.int32, device=DEV), active,
                      route=route, cap=cap)
        assert torch.equal(_sets(pos), _sets(ref.topk_indices(x, row_lens, K, active_width=active)))
        for page_size, pages in ((64, 2048), (16, 8192), (1, 131072), (64, 700)):  # 700: rows past it
            table = _page_table(len(lens), pages, seed=page_size + pages)
            got = torch.full_like(pos, -7)
            launch_cuda_topk_cluster(x, x.stride(0), row_lens, active, got, K, x.shape[1],
                                     cluster=None if route == "auto" else route, cap=cap, page_table=table,
                                     page_bits=page_size.bit_length() - 1)
            want = ref.page_table_slots(pos, table, page_size)
            assert torch.equal(got, want), (page_size, pages, active)
            assert (want >= 0).sum() > 0
