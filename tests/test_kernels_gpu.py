"""Compiled Triton indexer kernels on a CUDA device: reference agreement, bounds, shapes, capture.

Every test carries ``@pytest.mark.gpu`` and skips without CUDA. The kernel modules are imported
inside the tests so that collecting this module on a CPU host never decorates them un-interpreted
(``test_kernels_interpret`` owns that).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.synth import make_case
from vllm_sparse_sync.kernels.verify import topk_violations

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEV = "cuda"


def _ops():
    from vllm_sparse_sync.kernels import ops

    return ops


ALGOS = ["radix", "sample", "fused"]
# step configurations by name: config fields, then module constants patched before the workspace
# is made; "sample_small": candidates for rows of 2K+ (the default: 8K+); "fused": one fused launch
# for calls of <= 8 rows (the others run score, then top-k), planned as on a device without the
# cluster top-k (where the fused step is the default), up to 8 rows of a 128K capacity
TOPK_CFG = {"radix": {"topk": "radix", "fused": False},
            "sample": {"topk": "sample", "fused": False},
            "sample_small": {"topk": "sample", "fused": False},
            "fused": {}}
PATCHES = {"sample_small": {"vllm_sparse_sync.kernels.triton.topk_sample.CAP": 2048,
                            "vllm_sparse_sync.kernels.triton.topk_sample.SAMPLE_ABOVE": 2048,
                            "vllm_sparse_sync.kernels.triton.topk_sample.SAMPLES": 512},
           "fused": {"vllm_sparse_sync.kernels.planner.FUSED_MAX_KEYS": 4096}}


def _ws(monkeypatch, rows, k, width=0, algo="radix"):
    """A workspace of ``algo``'s configuration (its constants patched for the rest of the test)."""
    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG
    from vllm_sparse_sync.kernels.device import device_info
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    for target, value in PATCHES.get(algo, {}).items():
        monkeypatch.setattr(target, value)
    config = DEFAULT_CONFIG.with_values(**TOPK_CFG[algo])
    info = replace(device_info(DEV, config), cluster_smem=0) if algo == "fused" else None
    return IndexerTopkWorkspace(rows, k, width, DEV, config=config, device_info=info)


def _assert_reset(ws):
    """Every histogram and counter of the workspace is back at zero; no fused barrier stalled."""
    for t in (ws.hist, ws.ticks, ws.fused_hist, ws.fused_sync, ws.fused_stall):
        assert int(t.abs().sum()) == 0


def _tol(logits):
    finite = logits[torch.isfinite(logits)]
    return 1e-5 * float(finite.abs().max()) + 1e-5 if finite.numel() else 0.0


def _active(n):
    return torch.tensor([n], dtype=torch.int32, device=DEV)


def test_write_index_k_cache_matches_reference():
    torch.manual_seed(0)
    k8, ks = ref.quantize_index_k(torch.randn(3000, 128, device=DEV))
    slots = torch.randperm(64 * 64, device=DEV)[:3000]
    slots[::7] = -1
    a = torch.zeros(64, 64 * 132, dtype=torch.uint8, device=DEV)
    b = a.clone()
    ref.write_index_k_cache(a, k8, ks, slots)
    _ops().write_index_k_cache(b, k8, ks, slots)
    assert torch.equal(a, b)


@pytest.mark.parametrize("heads", [64, 32])
def test_dense_logits_match_reference(heads):
    lens = [0, 64, 4096, 1000, 3333, 64 * 50]
    case = make_case(lens, heads=heads, table_pages=70, device=DEV, seed=1)
    case.block_table[2, 3] = -1
    for width, active in [(4096, None), (70 * 64, None), (70 * 64, _active(4096)), (8000, _active(2000))]:
        got = _ops().paged_indexer_logits(*case.args, width, active_width=active)
        want = ref.paged_indexer_logits(*case.args, width, active_width=active)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("algo", ["radix", "sample", "sample_small"])
@pytest.mark.parametrize("k", [512, 1024, 2048])
@pytest.mark.parametrize("rows", [1, 8, 64, 256])
def test_topk_exact_on_dense_logits(k, rows, algo, monkeypatch):
    g = torch.Generator(device="cpu").manual_seed(rows * 7 + k)
    lens = torch.randint(0, 12000, (rows,), generator=g)
    lens[0] = k  # length == k
    if rows > 2:
        lens[1], lens[2] = 0, k + 1
    width = 12288
    logits = torch.randn(rows, width, device=DEV)
    logits[:, ::5] = logits[:, 1::5][:, : logits[:, ::5].shape[1]]  # many exact ties
    lens = lens.to(torch.int32).to(DEV)
    ws = _ws(monkeypatch, rows, k, algo=algo)
    got = _ops().topk_indices(logits, lens, k, workspace=ws)
    assert topk_violations(got, logits, ref.effective_lengths(lens, width), k) == []
    assert torch.equal(got, _ops().topk_indices(logits, lens, k, workspace=ws))
    other = _ws(monkeypatch, rows, k, algo="sample" if algo == "radix" else "radix")
    assert torch.equal(got, _ops().topk_indices(logits, lens, k, workspace=other))  # Triton algos: same order
    default = _ops().topk_indices(logits, lens, k)  # the CUDA top-k from 32 rows, where it can run
    assert torch.equal(got.sort(1).values, default.sort(1).values)


def test_fused_route_gives_threshold_ties_to_the_lowest_positions(monkeypatch):
    lens = [12000, 2047, 64]
    case = make_case(lens, heads=16, ties=True, device=DEV, seed=3)
    g = torch.Generator().manual_seed(3)
    case.weights.copy_(torch.randint(-2, 3, tuple(case.weights.shape), generator=g).float())  # exact sums
    ws = _ws(monkeypatch, len(lens), 2048, case.block_table.shape[1] * 64, "fused")
    got = _ops().indexer_topk(*case.args, 2048, workspace=ws)
    want = ref.indexer_topk(*(t.cpu() for t in case.args), 2048)
    assert torch.equal(got.cpu().sort(1).values, want.sort(1).values)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("heads,k", [(64, 2048), (32, 2048), (64, 512), (64, 1024)])
@pytest.mark.parametrize("bound", ["exact", "host_128k", "active_128k"])
def test_indexer_topk_bounds(heads, k, bound, algo, monkeypatch):
    lens = [0, 17, k, k + 1, 9000, 64 * 100, 20000]
    case = make_case(lens, heads=heads, table_pages=2048, device=DEV, seed=heads + k)
    width, active = {
        "exact": (max(lens), None),
        "host_128k": (131072, None),
        "active_128k": (131072, _active(max(lens))),
    }[bound]
    ws = _ws(monkeypatch, len(lens), k, width, algo)
    assert ws.plan_call(len(lens), width, 64).fused == (algo == "fused")
    got = _ops().indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws)
    logits = ref.paged_indexer_logits(*case.args, width, active_width=active)
    eff = ref.effective_lengths(case.row_lens, width, active)
    assert topk_violations(got, logits, eff, k, tol=_tol(logits)) == []
    again = _ops().indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws)
    assert torch.equal(got, again)
    _assert_reset(ws)


@pytest.mark.parametrize("algo", ALGOS)
def test_indexer_topk_long_rows_and_ties(algo, monkeypatch):
    k = 2048
    lens = [131072, 131000, 65536]
    case = make_case(lens, heads=64, device=DEV, seed=9, ties=True)
    dense = _ops().paged_indexer_logits(*case.args, 131072)
    ws = _ws(monkeypatch, 3, k, 131072, algo)
    got = _ops().indexer_topk(*case.args, k, width=131072, workspace=ws)
    _assert_reset(ws)
    eff = ref.effective_lengths(case.row_lens, 131072)
    assert topk_violations(got, dense, eff, k, tol=_tol(dense)) == []
    want = ref.paged_indexer_logits(*case.args, 131072)
    torch.testing.assert_close(dense, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("algo", ALGOS)
def test_compressed_and_mtp_rows(algo, monkeypatch):
    # ratio-4 compressed rows (L/4 entries, k=512) and MTP: two rows per request sharing a table
    ctx = [131072, 40000, 9000, 2052]
    lens = []
    for c in ctx:
        lens += [c // 4 - 1, c // 4]
    case = make_case(lens, heads=64, device=DEV, seed=11)
    case.block_table[0::2] = case.block_table[1::2]
    for k in (512, 1024):
        width = case.block_table.shape[1] * 64
        got = _ops().indexer_topk(*case.args, k, workspace=_ws(monkeypatch, len(lens), k, width, algo))
        logits = ref.paged_indexer_logits(*case.args, width)
        eff = ref.effective_lengths(case.row_lens, logits.shape[1])
        assert topk_violations(got, logits, eff, k, tol=_tol(logits)) == []


@pytest.mark.parametrize("algo", ["sample", "sample_small"])
def test_sample_topk_adversarial_rows(algo, monkeypatch):
    """Rows that defeat the sampled threshold (fallback) or stress it, exact against the reference."""
    k, S, width = 2048, 2048, 65536
    g = torch.Generator(device="cpu").manual_seed(5)
    logits = torch.randn(8, width, generator=g)
    n = 60000
    logits[0, torch.arange(S) * n // S] = 10.0 + torch.rand(S, generator=g)  # samples hold the top
    logits[1] = 1.0  # all equal: every key is a candidate
    logits[2] = torch.randint(0, 4, (width,), generator=g).float()  # few distinct values
    logits[3, torch.randperm(width, generator=g)[: width - 1000]] = float("-inf")  # < k finite
    logits[4, 5000:] = float("-inf")
    logits[5, 30000:30000 + k + 50] = 100.0  # a block of large values in one region
    logits[6] = torch.rand(width, generator=g) * 1e-30  # tiny and subnormal scores
    lens = torch.tensor([n, width, 50000, width, 9000, 40000, width, 2048 + 1], dtype=torch.int32)
    logits, lens = logits.to(DEV), lens.to(DEV)
    ws = _ws(monkeypatch, 8, k, algo=algo)
    got = _ops().topk_indices(logits, lens, k, workspace=ws)
    eff = ref.effective_lengths(lens, width)
    assert topk_violations(got, logits, eff, k) == []
    want = ref.topk_indices(logits, lens, k)
    for r in range(8):
        assert set(got[r].tolist()) == set(want[r].tolist()), f"row {r}"
    assert torch.equal(got, _ops().topk_indices(logits, lens, k, workspace=ws))
    # the Triton radix writes the same order (the default route may be the CUDA top-k, which
    # writes each row in ascending position order: sets are the contract across routes)
    radix = _ws(monkeypatch, 8, k, algo="radix")
    assert torch.equal(got, _ops().topk_indices(logits, lens, k, workspace=radix))


def _capture(fn):
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def _refill(case, new):
    """Write ``new``'s lengths, page table and cache into ``case``'s tensors in place."""
    case.row_lens.copy_(new.row_lens)
    case.block_table.copy_(new.block_table)
    case.k_cache.copy_(new.k_cache)
    case.q_fp8.copy_(new.q_fp8)
    case.weights.copy_(new.weights)


@pytest.mark.parametrize("algo", [*ALGOS, "sample_small"])
@pytest.mark.parametrize("contract", ["host_width", "active_width"])
def test_capture_replay_with_new_lengths_tables_and_bounds(contract, algo, monkeypatch):
    k, rows, table = 512, 4, 128
    width = table * 64
    mk = lambda lens, seed: make_case(lens, heads=64, table_pages=table, num_pages=600,  # noqa: E731
                                      device=DEV, seed=seed)
    case = mk([3000, 0, 8192, 600], 1)
    active = _active(8192) if contract == "active_width" else None
    ws = _ws(monkeypatch, rows, k, width, algo)
    out_idx = torch.empty(rows, k, dtype=torch.int32, device=DEV)
    dense = torch.empty(rows, width, dtype=torch.float32, device=DEV)
    top_dense = torch.empty(rows, k, dtype=torch.int32, device=DEV)
    ws_dense = _ws(monkeypatch, rows, k, algo=algo)
    ops = _ops()

    def step():
        ops.indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws, out=out_idx)
        ops.paged_indexer_logits(*case.args, width, active_width=active, out=dense)
        ops.topk_indices(dense, case.row_lens, k, active_width=active, workspace=ws_dense, out=top_dense)
        return out_idx

    graph, _ = _capture(step)
    for seed, lens, bound in [(2, [8000, 5, 512, 7000], 8000), (3, [100, 4000, 0, 8192], 8192)]:
        new = mk(lens, seed)
        _refill(case, new)
        if active is not None:
            active.fill_(bound)
        before = torch.cuda.memory_allocated()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
        replayed = (out_idx.clone(), dense.clone(), top_dense.clone())
        eager = (
            ops.indexer_topk(*case.args, k, active_width=active, width=width,
                             workspace=_ws(monkeypatch, rows, k, width, algo)),
            ops.paged_indexer_logits(*case.args, width, active_width=active),
        )
        assert torch.equal(replayed[0], eager[0])
        assert torch.equal(replayed[1], eager[1])
        logits = ref.paged_indexer_logits(*case.args, width, active_width=active)
        torch.testing.assert_close(replayed[1], logits, rtol=1e-4, atol=1e-3)
        eff = ref.effective_lengths(case.row_lens, width, active)
        assert topk_violations(replayed[0], logits, eff, k, tol=_tol(logits)) == []
        assert topk_violations(replayed[2], replayed[1], eff, k) == []


def test_capture_write_index_k_cache():
    cache = torch.zeros(32, 64 * 132, dtype=torch.uint8, device=DEV)
    k8, ks = ref.quantize_index_k(torch.randn(100, 128, device=DEV))
    slots = torch.arange(100, device=DEV, dtype=torch.int64)
    ops = _ops()
    graph, _ = _capture(lambda: ops.write_index_k_cache(cache, k8, ks, slots))
    new8, news = ref.quantize_index_k(torch.randn(100, 128, device=DEV))
    k8.copy_(new8)
    ks.copy_(news)
    slots.copy_(torch.randperm(32 * 64, device=DEV)[:100])
    slots[::9] = -1
    graph.replay()
    want = torch.zeros_like(cache)
    ref.write_index_k_cache(want, k8, ks, slots)
    # the graph also wrote the first (pre-capture) slots; compare the newly written ones
    got_vals, got_scales = ref.split_index_k_cache(cache)
    want_vals, want_scales = ref.split_index_k_cache(want)
    live = slots[slots >= 0]
    p, o = live // 64, live % 64
    assert torch.equal(got_vals[p, o].view(torch.uint8), want_vals[p, o].view(torch.uint8))
    assert torch.equal(got_scales[p, o], want_scales[p, o])


TRITON = "vllm_sparse_sync.kernels.triton."
PLANNER = "vllm_sparse_sync.kernels.planner."
SAMPLE = {"topk": "sample"}
VARIANTS = {  # name: (config fields, module constants, device changes)
    "e4m3": ({"precise": False}, {}, {}),
    "e4m3-triton-by-size": ({"precise": False}, {PLANNER + "CUDA_FP8_SCORER_MIN_TOKENS": 2**62}, {}),
    "triton-scorer": ({}, {}, {"cuda_scorer": False}),
    "triton-scorer-e4m3": ({"precise": False}, {}, {"cuda_scorer": False}),
    "triton-scorer-tile32": ({}, {TRITON + "scorer.TILE": 32}, {"cuda_scorer": False}),
    "triton-scorer-stages2": ({}, {TRITON + "scorer.STAGES": 2}, {"cuda_scorer": False}),
    "triton-scorer-tile128-block512": ({}, {TRITON + "scorer.TILE": 128, TRITON + "topk_radix.BLOCK": 512,
                                            TRITON + "topk_sample.BLOCK": 512}, {"cuda_scorer": False}),
    "triton-scorer-no-pdl": ({"pdl": False}, {}, {"cuda_scorer": False}),
    "sample": (SAMPLE, {}, {}),
    "sample-cap4096": (SAMPLE, {TRITON + "topk_sample.CAP": 4096, TRITON + "topk_sample.SAMPLES": 512,
                                TRITON + "topk_sample.RESOLVE_BLOCK": 1024,
                                TRITON + "topk_sample.RESOLVE_WARPS": 4}, {}),
    "sample-above2048": (SAMPLE, {TRITON + "topk_sample.SAMPLE_ABOVE": 2048}, {}),
    "fused": ({"fused": True}, {}, {"cluster_smem": 0}),
    "fused-e4m3": ({"fused": True, "precise": False}, {}, {"cluster_smem": 0}),
    "fused-warps8-stages2": ({"fused": True}, {TRITON + "fused.WARPS": 8, TRITON + "fused.STAGES": 2},
                             {"cluster_smem": 0}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants(variant, monkeypatch):
    """Other fixed configurations: fp8 tensor-core dot (looser scores), the Triton scorer (where
    the CUDA one is the default) with its pipeliner and tiles, the sampled top-k's sizes, the
    fused step's (planned as where the cluster top-k cannot run)."""
    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG
    from vllm_sparse_sync.kernels.device import cuda_scorer_ok, device_info
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    values, patches, device = VARIANTS[variant]
    for target, value in patches.items():
        monkeypatch.setattr(target, value)
    cfg = DEFAULT_CONFIG.with_values(**{"fused": False, **values})
    k = 1024
    lens = [0, 1000, 1025, 30000, 64 * 200]
    case = make_case(lens, heads=64, device=DEV, seed=13)
    width = case.block_table.shape[1] * 64
    info = replace(device_info(DEV, cfg), **device) if device else None
    ws = IndexerTopkWorkspace(len(lens), k, width, DEV, config=cfg, device_info=info)
    route = ws.plan_call(len(lens), width, 64)
    if variant == "e4m3":  # the e4m3 path on the CUDA scorer by default, where it runs
        assert route.scorer == ("cuda" if cuda_scorer_ok(torch.device(DEV)) else "triton")
    if variant == "e4m3-triton-by-size" or device.get("cuda_scorer") is False:
        assert route.scorer == "triton"
    assert route.fused == cfg.fused
    got = _ops().indexer_topk(*case.args, k, workspace=ws)
    # the dense scores by the step's scorer: Triton's where the step scores there (fused included)
    dense_cfg = cfg.with_values(cuda=False) if device else cfg
    dense = _ops().paged_indexer_logits(*case.args, width, config=dense_cfg)
    want = ref.paged_indexer_logits(*case.args, width)
    scale = float(want[torch.isfinite(want)].abs().max())
    atol = 3e-3 * scale if not cfg.precise else 1e-3
    torch.testing.assert_close(dense, want, rtol=1e-4, atol=atol)
    eff = ref.effective_lengths(case.row_lens, width)
    assert topk_violations(got, dense, eff, k, tol=_tol(dense)) == []


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("heads,k", [(64, 2048), (32, 512), (64, 1024)])
def test_fused_step_shapes_and_both_contracts(rows, heads, k, monkeypatch):
    """The fused route over 1 to 8 rows: lengths 0, <= k, page multiples, to 128K; three bounds."""
    pool = [0, k - 1, k, k + 1, 64 * 37, 131072, 100000, 65536 + 5]
    lens = [pool[(i * 3 + rows) % len(pool)] for i in range(rows)]
    lens[0] = 131072 if rows > 1 else 65536  # every call has a long row
    case = make_case(lens, heads=heads, table_pages=2048, device=DEV, seed=rows * 7 + k)
    for width, active in [(max(lens), None), (131072, None), (131072, _active(max(lens)))]:
        ws = _ws(monkeypatch, rows, k, width, "fused")
        assert ws.plan_call(rows, width, 64).fused
        got = _ops().indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws)
        dense = _ops().paged_indexer_logits(*case.args, width, active_width=active)
        eff = ref.effective_lengths(case.row_lens, width, active)
        assert topk_violations(got, dense, eff, k, tol=_tol(dense)) == []
        assert torch.equal(got, _ops().indexer_topk(*case.args, k, active_width=active, width=width,
                                                    workspace=ws))
        _assert_reset(ws)


def test_fused_step_repeated_calls_stay_exact(monkeypatch):
    """Many back-to-back fused launches (barrier counters reset by each call) agree with one another."""
    k, rows = 2048, 8
    case = make_case([131072 - 64 * r for r in range(rows)], heads=64, device=DEV, seed=21)
    ws = _ws(monkeypatch, rows, k, 131072, "fused")
    first = _ops().indexer_topk(*case.args, k, workspace=ws)
    outs = [_ops().indexer_topk(*case.args, k, workspace=ws) for _ in range(50)]
    assert all(torch.equal(first, o) for o in outs)
    _assert_reset(ws)
