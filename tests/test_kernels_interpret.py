"""Triton indexer kernels under ``TRITON_INTERPRET=1`` on the CPU, against the torch reference.

Where no CUDA device exists this module sets ``TRITON_INTERPRET=1`` at import, before the
kernel modules are (re)loaded, so their ``@triton.jit`` functions become interpreted ones; with
CUDA present it leaves the environment alone and skips (``test_kernels_gpu`` covers the device).
Sizes are small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import pytest
import torch
from interpret_env import CUDA as _CUDA
from interpret_env import SKIP_WITH_CUDA

triton = pytest.importorskip("triton")

from vllm_sparse_sync.kernels import reference as ref  # noqa: E402
from vllm_sparse_sync.kernels import launch, planner  # noqa: E402
from vllm_sparse_sync.kernels import ops as tk  # noqa: E402
from vllm_sparse_sync.kernels.config import KernelConfig  # noqa: E402
from vllm_sparse_sync.kernels.synth import make_case  # noqa: E402
from vllm_sparse_sync.kernels.triton import fused, topk_sample  # noqa: E402
from vllm_sparse_sync.kernels.triton import scorer as triton_scorer  # noqa: E402
from vllm_sparse_sync.kernels.verify import topk_violations  # noqa: E402
from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace  # noqa: E402

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(_CUDA, reason=SKIP_WITH_CUDA),
]


SMALL_SAMPLE = dict(CAP=128, SAMPLE_ABOVE=128, SAMPLES=64, BLOCK=64, RESOLVE_BLOCK=64)
"""the sampled top-k shrunk so small rows take every path: candidates (n > 128), whole row, fallback"""
ALGOS = {"radix": KernelConfig(topk="radix", fused=False), "sample": KernelConfig(topk="sample", fused=False)}
FUSED = KernelConfig()


@pytest.fixture(autouse=True)
def small_kernels(monkeypatch):
    """``SMALL_SAMPLE``, and the fused step's resolve reading its candidates 64 at a time (over
    several iterations); set before any workspace is made (it sizes the candidate buffers)."""
    for name, value in SMALL_SAMPLE.items():
        monkeypatch.setattr(topk_sample, name, value)
    monkeypatch.setattr(fused, "RESOLVE_BLOCK", 64)


def test_workspace_holds_sample_buffers_only_when_a_call_can_route_there():
    small = IndexerTopkWorkspace(8, 16, 0, "cpu", num_sms=4)
    big = IndexerTopkWorkspace(planner.SAMPLE_MIN_ROWS, 16, 0, "cpu", num_sms=4)
    assert small.cand_key.numel() == 0 and big.cand_key.numel() == planner.SAMPLE_MIN_ROWS * topk_sample.CAP


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


@pytest.mark.parametrize("heads, tile", [(16, 64), (32, 64), (16, 32), (16, 128)])
def test_dense_logits_match_reference_with_holes_and_bounds(heads, tile, monkeypatch):
    # one-page tiles (a scalar page id) or gathered tiles (a tile of half a page, or of two)
    monkeypatch.setattr(triton_scorer, "TILE", tile)
    cfg = KernelConfig()
    # lengths: 0, page multiple, partial page, longer than the table (clamped)
    case = make_case([0, 128, 77, 190], heads=heads, table_pages=3, seed=2)
    case.block_table[2, 1] = -1  # a hole inside the live range scores -inf
    for width, active in [(192, None), (300, None), (192, torch.tensor([100], dtype=torch.int32))]:
        got = tk.paged_indexer_logits(*case.args, width, active_width=active, config=cfg)
        want = ref.paged_indexer_logits(*case.args, width, active_width=active)
        assert got.shape == want.shape
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("ties", [False, True])
def test_topk_is_exact_on_dense_logits(ties, algo):
    k = 24
    case = make_case([0, 5, 24, 25, 200, 333], heads=16, ties=ties, seed=3)
    width = 384
    logits = ref.paged_indexer_logits(*case.args, width)
    ws = IndexerTopkWorkspace(6, k, 0, "cpu", config=ALGOS[algo], num_sms=4)
    got = tk.topk_indices(logits, case.row_lens, k, workspace=ws)
    assert topk_violations(got, logits, _eff(case, width), k) == []


@pytest.mark.parametrize("algo", list(ALGOS))
def test_topk_follows_active_width_and_is_deterministic(algo):
    k = 16
    case = make_case([90, 300, 12], heads=16, ties=True, seed=4)
    logits = ref.paged_indexer_logits(*case.args, 320)
    ws = IndexerTopkWorkspace(3, k, 0, "cpu", num_sms=3, config=ALGOS[algo])
    active = torch.tensor([64 if algo == "radix" else 200], dtype=torch.int32)
    first = tk.topk_indices(logits, case.row_lens, k, active_width=active, workspace=ws)
    second = tk.topk_indices(logits, case.row_lens, k, active_width=active, workspace=ws)
    assert torch.equal(first, second)
    assert topk_violations(first, logits, _eff(case, 320, active), k) == []
    assert int(ws.hist.abs().sum()) == 0 and int(ws.ticks.abs().sum()) == 0


@pytest.mark.parametrize("bound, algo", [("exact", "radix"), ("host_width", "radix"),
                                         ("active_width", "radix"), ("host_width", "sample"),
                                         ("active_width", "sample"), ("exact", "fused"),
                                         ("host_width", "fused"), ("active_width", "fused")])
def test_indexer_topk_both_host_contracts(bound, algo):
    k = 32
    lens = [0, 31, 32, 64, 150, 257]
    case = make_case(lens, heads=32, table_pages=6, seed=5)
    exact = max(lens)
    width, active = {
        "exact": (exact, None),
        "host_width": (6 * 64, None),
        "active_width": (6 * 64, torch.tensor([exact], dtype=torch.int32)),
    }[bound]
    cfg = FUSED if algo == "fused" else ALGOS[algo]
    ws = IndexerTopkWorkspace(len(lens), k, width, "cpu", num_sms=5 if algo != "fused" else 16, config=cfg)
    assert ws.plan_call(len(lens), width, 64).fused == (algo == "fused")
    got = tk.indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws)
    logits = ref.paged_indexer_logits(*case.args, width, active_width=active)
    assert topk_violations(got, logits, _eff(case, width, active), k, tol=1e-3) == []
    again = tk.indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws)
    assert torch.equal(got, again)
    _assert_reset(ws)


def _assert_reset(ws):
    """Every histogram and counter of the workspace is back at zero; no barrier stalled."""
    for t in (ws.hist, ws.ticks, ws.fused_hist, ws.fused_sync, ws.fused_stall):
        assert int(t.abs().sum()) == 0


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


def _sample_topk(logits, lens, k, active=None, cfg=ALGOS["sample"]):
    """``sample`` top-k, checked exact against the reference (same set per row); rows' paths."""
    rows, width = logits.shape
    ws = IndexerTopkWorkspace(rows, k, 0, "cpu", num_sms=4, config=cfg)
    got = tk.topk_indices(logits, lens, k, active_width=active, workspace=ws)
    eff = ref.effective_lengths(lens, width, active)
    assert topk_violations(got, logits, eff, k) == []
    want = ref.topk_indices(logits, lens, k, active_width=active)
    for r in range(rows):
        assert set(got[r].tolist()) == set(want[r].tolist()), f"row {r}"
    assert torch.equal(got, tk.topk_indices(logits, lens, k, active_width=active, workspace=ws))
    chunks = ws.plan_call(rows, width, 1, score=False).topk_chunks
    c = ws.chunk_cnt[: rows * chunks].view(rows, chunks).sum(1).tolist()
    cap, smin = topk_sample.CAP, topk_sample.SAMPLE_ABOVE
    paths = ["short" if n <= k else "row" if n <= smin else "cand" if k <= cc <= cap else "fallback"
             for n, cc in zip(eff.tolist(), c)]
    return got, paths


def test_sample_topk_random_rows_take_every_path(monkeypatch):
    k = 16
    torch.manual_seed(20)
    lens = torch.tensor([0, 7, 16, 17, 100, 128, 129, 300, 700, 50], dtype=torch.int32)
    logits = torch.randn(len(lens), 768)
    logits[2, 3] = float("-inf")  # n <= k: positions regardless of scores
    _, paths = _sample_topk(logits, lens, k)
    assert paths[:3] == ["short"] * 3 and "row" in paths and "cand" in paths and "fallback" in paths
    # rows from 41 sampled (below the capacity)
    monkeypatch.setattr(topk_sample, "SAMPLE_ABOVE", 40)
    _, paths = _sample_topk(logits, lens, k)
    assert paths[4] == "cand"


def test_sample_topk_heavy_ties_fall_back():
    k = 16
    lens = torch.tensor([300, 400, 300, 129], dtype=torch.int32)
    logits = torch.ones(4, 448)  # all equal: every key meets the threshold (> CAP candidates)
    logits[1] = torch.randint(0, 2, (448,), generator=torch.Generator().manual_seed(1)).float()
    logits[2, ::2] = 2.0  # two values, the top one on every other position (> CAP of them)
    got, paths = _sample_topk(logits, lens, k)
    assert paths == ["fallback"] * 4
    assert got[0].tolist() == list(range(k))  # ties resolve to the lowest positions


def test_sample_topk_threshold_misses_fall_back(monkeypatch):
    # row 0: the samples (every n/S-th position) hold the largest scores, so the threshold keeps
    # fewer than k; row 1: the k + 50 largest sit between two sample positions (> CAP candidates)
    k, S = 32, 64
    n0, n1 = 400, 64 * 100
    logits = torch.full((2, n1), float("-inf"))
    g = torch.Generator().manual_seed(2)
    logits[0, :n0] = torch.rand(n0, generator=g)
    logits[0, torch.arange(S) * n0 // S] = 5.0 + torch.rand(S, generator=g)
    logits[1] = torch.rand(n1, generator=g) * 0.01
    logits[1, 101:101 + k + 50] = 10.0 + torch.rand(k + 50, generator=g)
    lens = torch.tensor([n0, n1], dtype=torch.int32)
    for name, value in dict(SAMPLES=S, BLOCK=256, RESOLVE_BLOCK=512).items():
        monkeypatch.setattr(topk_sample, name, value)
    _, paths = _sample_topk(logits, lens, k)
    assert paths == ["fallback", "fallback"]


def test_sample_topk_neg_inf_holes_active_clamp_and_wide_host_width():
    k = 16
    g = torch.Generator().manual_seed(3)
    width = 2048  # far above the live lengths
    logits = torch.randn(4, width, generator=g)
    logits[0, 20:300] = float("-inf")  # fewer than k finite of 300 live: -inf ties, lowest first
    logits[1, torch.randperm(500, generator=g)[:400]] = float("-inf")
    logits[2, :] = float("-inf")
    lens = torch.tensor([300, 500, 200, 1000], dtype=torch.int32)
    _sample_topk(logits, lens, k)
    _, paths = _sample_topk(logits, lens, k, active=torch.tensor([260], dtype=torch.int32))
    assert "cand" in paths or "fallback" in paths


def _fused_step(case, k, width, active=None, cfg=FUSED, num_sms=16):
    """The fused step on ``case``, checked against the reference; returns it and its workspace."""
    rows = case.row_lens.shape[0]
    ws = IndexerTopkWorkspace(rows, k, width, "cpu", num_sms=num_sms, config=cfg)
    assert ws.plan_call(rows, width, 64).fused
    got = tk.indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws)
    logits = ref.paged_indexer_logits(*case.args, width, active_width=active)
    assert topk_violations(got, logits, _eff(case, width, active), k, tol=1e-3) == []
    assert torch.equal(got, tk.indexer_topk(*case.args, k, active_width=active, width=width, workspace=ws))
    _assert_reset(ws)
    return got, ws


def test_fused_step_random_lengths_match_reference(gen):
    # lengths from 0 past several parts; k small so most rows select
    k = int(torch.randint(8, 64, (1,), generator=gen))
    lens = torch.randint(0, 700, (4,), generator=gen).tolist() + [k, k + 1, 640]
    case = make_case(lens, heads=16, table_pages=12, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
    got, _ = _fused_step(case, k, 12 * 64)
    want = ref.indexer_topk(*case.args, k, width=12 * 64)
    for r, n in enumerate(lens):
        assert set(got[r].tolist()) == set(want[r].tolist()), f"row {r} (len {n})"


def test_fused_step_heavy_ties():
    # scores from {-x, 0, x}: hundreds of ties at the k-th key, spread over every part
    k = 40
    case = make_case([700, 450, 41, 768], heads=16, table_pages=12, ties=True, seed=12)
    _fused_step(case, k, 12 * 64)


def test_fused_step_holes_and_rows_past_the_table():
    # a -1 hole inside a live range and a row longer than its table: -inf keys still count
    k = 16
    case = make_case([300, 200, 64], heads=16, table_pages=4, seed=13)
    case.block_table[1, 1] = -1
    got, _ = _fused_step(case, k, 320)
    assert bool((got[0] >= 0).all()) and int(got[0].max()) < 256  # finite scores beat the -inf tail


def test_fused_step_one_part_per_row_and_bound_far_above(monkeypatch):
    # 4 slots for 4 rows: each row is one program holding every tile; the host width is 8x the rows
    k = 32
    case = make_case([0, 33, 128, 500], heads=32, table_pages=64, seed=14)
    monkeypatch.setattr(planner, "FUSED_CTAS_PER_SM", 1)
    monkeypatch.setattr(planner, "FUSED_MAX_KEYS", 4096)
    one = KernelConfig()
    _, ws = _fused_step(case, k, 64 * 64, cfg=one, num_sms=4)
    route = ws.plan_call(4, 64 * 64, 64)
    assert (route.fused_parts, route.fused_tiles) == (1, 64)
    _fused_step(case, k, 64 * 64, active=torch.tensor([130], dtype=torch.int32), cfg=one, num_sms=4)


def test_a_stalled_row_is_marked_and_reported():
    """A row whose barrier gave up is written all -1 by its resolve, and health says so."""
    from vllm_sparse_sync import IndexerLayout, IndexerStep

    k = 16
    case = make_case([300, 200], heads=16, table_pages=5, seed=15)
    ws = IndexerTopkWorkspace(2, k, 320, "cpu", num_sms=16, config=FUSED)
    ws.fused_stall[1] = 1  # what a barrier that gave up leaves behind
    got = tk.indexer_topk(*case.args, k, width=320, workspace=ws)
    assert got[1].tolist() == [-1] * k  # marked, not silently wrong
    want = ref.indexer_topk(*case.args, k, width=320)
    assert set(got[0].tolist()) == set(want[0].tolist())
    assert ws.stalled_rows() == 1
    step = IndexerStep(IndexerLayout(backend="deepgemm", topk=k, max_model_len=320), max_rows=2,
                       max_pages_per_req=5, device="cpu")
    assert step.health().ok  # the reference route never stalls


def test_nan_scores_rank_below_every_number():
    logits = torch.tensor([[0.1, float("nan"), 0.5, float("-inf"), -3.0, -float("nan")]])
    lens = torch.tensor([6], dtype=torch.int32)
    for algo, cfg in ALGOS.items():
        ws = IndexerTopkWorkspace(1, 4, 0, "cpu", num_sms=4, config=cfg)
        got = tk.topk_indices(logits, lens, 4, workspace=ws)
        assert set(got[0].tolist()) == {0, 2, 3, 4}, algo
    assert ref.topk_indices(logits, lens, 2).tolist() == [[2, 0]]
    assert ref.topk_indices(logits, lens, 4).tolist() == [[2, 0, 4, 3]]


@pytest.mark.parametrize("ratio, world, rank, interleave", [(1, 1, 0, 1), (4, 1, 0, 1), (1, 4, 3, 8),
                                                             (4, 2, 1, 64)])
def test_metadata_kernel_matches_the_torch_path(ratio, world, rank, interleave, gen):
    """The builder's one-launch Triton path writes what its torch path writes, over batches that
    shrink (stale rows zeroed), grow, and mix uniform and ragged query lengths."""
    from vllm_sparse_sync import DecodeBatch, IndexerLayout, IndexerMetadataBuilder, SeqLenShadow
    from vllm_sparse_sync.bounds import capture_stable_bound
    from vllm_sparse_sync.kernels.triton.metadata import launch_decode_rows

    layout = IndexerLayout(backend="b12x", compress_ratio=ratio, dcp_world_size=world, dcp_rank=rank,
                           cp_interleave=interleave, max_model_len=4096)
    kw = dict(max_num_reqs=8, max_num_tokens=24, max_pages_per_req=70, device="cpu")
    fast, slow = IndexerMetadataBuilder(layout, **kw), IndexerMetadataBuilder(layout, **kw)
    fast._launch = launch_decode_rows
    for query_lens in ([1] * 8, [3, 0, 2, 4], [1, 1], [2] * 5, [0, 0], [4, 1, 4, 1, 4]):
        lens = [int(torch.randint(q, 4097, (1,), generator=gen)) for q in query_lens]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        qsl = torch.tensor(starts, dtype=torch.int32)
        need = -(-capture_stable_bound(layout) // 64)  # the bound of max_seq_len=max_model_len
        pages = int(torch.randint(need, 71, (1,), generator=gen))
        batch = DecodeBatch(qsl.clone(), qsl, torch.tensor(lens, dtype=torch.int32),
                            SeqLenShadow(torch.tensor(lens, dtype=torch.int32), authoritative=False),
                            torch.randint(-1, 5000, (len(lens), pages), dtype=torch.int32, generator=gen),
                            max_seq_len=4096)
        a, b = fast.build(batch), slow.build(batch)
        assert torch.equal(fast.row_lens_buffer, slow.row_lens_buffer), query_lens
        assert torch.equal(a.block_table, b.block_table), query_lens
        assert torch.equal(fast.active_width_buffer, slow.active_width_buffer)


@pytest.mark.parametrize("algo", ["radix", "sample", "fused"])
def test_nan_scores_from_the_scorer_rank_below_every_number(algo):
    """Tokens whose scale is NaN score NaN: every route leaves them for last, as the reference."""
    k = 16
    case = make_case([300, 200], heads=16, table_pages=5, seed=16)
    page_bytes = 64 * 128
    for page in case.block_table[0, :3].tolist():  # NaN scores at some positions of row 0
        scales = case.k_cache[page, page_bytes:].view(torch.float32)
        scales[::5] = float("nan")
    cfg = FUSED if algo == "fused" else ALGOS[algo]
    ws = IndexerTopkWorkspace(2, k, 320, "cpu", num_sms=16 if algo == "fused" else 4, config=cfg)
    assert ws.plan_call(2, 320, 64).fused == (algo == "fused")
    got = tk.indexer_topk(*case.args, k, width=320, workspace=ws)
    logits = ref.paged_indexer_logits(*case.args, 320)
    assert bool(torch.isnan(logits[0]).any())
    want = ref.indexer_topk(*case.args, k, width=320)
    for r in range(2):
        assert set(got[r].tolist()) == set(want[r].tolist()), r
        assert not bool(torch.isnan(logits[r, got[r].long()]).any())


def _tie_case(lens, table_pages, seed):
    """Scores from few integer-valued levels (exact in fp32): many ties at the k-th key. Row ``r``
    weighs its first 4, 2 or 1 heads (by ``seed + r``) with integers in [-2, 2], the others 0."""
    case = make_case(lens, heads=16, table_pages=table_pages, ties=True, seed=seed)
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-2, 3, tuple(case.weights.shape), generator=g).float()
    for r in range(len(lens)):
        w[r, (4, 2, 1)[(seed + r) % 3]:] = 0
    case.weights.copy_(w)
    return case


def _split_ties(logits, lens, k):
    """Rows whose k-th score is shared by more live positions than the top-k can take."""
    rows = []
    for r, n in enumerate(lens):
        if n > k:
            s = ref.sortable_keys(logits[r, :n])
            kth = s.sort(descending=True).values[k - 1]
            if int((s > kth).sum()) + int((s == kth).sum()) > k:
                rows.append(r)
    return rows


@pytest.mark.parametrize("num_sms, rows_lens, pages", [
    # 2 rows on 4 slots: 2 parts of up to 8 tiles
    (2, [700, 768], 12),
    # 2 rows on 6 slots: 3 parts of up to 4 tiles; lengths near k and at page multiples
    (3, [41, 640], 12),
    (3, [257, 129], 12),
    # 1 row on 4 slots: 3 parts of up to 4 tiles; 4 live tiles (chunks of 2) leave a part idle
    (2, [256], 10),
    (2, [300], 10),
    (2, [640], 10),
    # 4 rows on 16 slots: 4 parts of up to 4 tiles; 2 and 7 live tiles: idle or short parts
    (8, [65, 400, 512, 1000], 16),
])
def test_fused_step_gives_threshold_ties_to_the_lowest_positions(num_sms, rows_lens, pages):
    """The k-th score's ties go to the lowest positions (reference contract): the same set as the
    reference on every row, ties split over several parts and several tiles per part."""
    k = 40
    case = _tie_case(rows_lens, pages, seed=sum(rows_lens) + num_sms)
    width = pages * 64
    ws = IndexerTopkWorkspace(len(rows_lens), k, width, "cpu", num_sms=num_sms, config=FUSED)
    route = ws.plan_call(len(rows_lens), width, 64)
    assert route.fused and route.fused_parts > 1
    logits = ref.paged_indexer_logits(*case.args, width)
    assert _split_ties(logits, rows_lens, k)  # the case really splits ties at the k-th score
    got, _ = _fused_step(case, k, width, num_sms=num_sms)
    want = ref.indexer_topk(*case.args, k, width=width)
    for r, n in enumerate(rows_lens):
        assert set(got[r].tolist()) == set(want[r].tolist()), f"row {r} (len {n})"
        if n > k:  # the documented order: above the k-th key's 16-bit prefix, then the rest
            keys = ref.sortable_keys(logits[r, got[r].long()])  # above the k-th key, then its ties
            kth = int(keys.min())
            groups = [(keys >> 16) > (kth >> 16), ((keys >> 16) == (kth >> 16)) & (keys > kth),
                      keys == kth]
            sizes = [int(m.sum()) for m in groups]
            at = 0
            for m, size in zip(groups, sizes):  # each group in one run, positions ascending
                assert bool(m[at:at + size].all()) and bool((got[r][at:at + size].diff() > 0).all())
                at += size


def test_only_the_steps_top_k_reads_the_lengths_before_its_wait(monkeypatch):
    """The step launches its top-k as the one after its scorer (which does not write the lengths);
    a standalone top-k does not; the cluster launch asks for the early lengths only then."""
    from types import SimpleNamespace

    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk

    calls, real = [], launch.launch_topk

    def spy(*args, **kwargs):
        calls.append(kwargs.get("after_scorer", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "launch_topk", spy)
    monkeypatch.setattr(tk, "launch_topk", spy)
    case = make_case([300, 90], heads=16, seed=4)
    ws = IndexerTopkWorkspace(2, 16, 320, "cpu", config=ALGOS["radix"], num_sms=4)
    got = tk.indexer_topk(*case.args, 16, width=320, workspace=ws)
    logits = ref.paged_indexer_logits(*case.args, 320)
    ws_alone = IndexerTopkWorkspace(2, 16, 0, "cpu", num_sms=4)
    alone = tk.topk_indices(logits, case.row_lens, 16, workspace=ws_alone)
    assert calls == [True, False]
    assert topk_violations(got, logits, case.row_lens.long(), 16) == []
    assert topk_violations(alone, logits, case.row_lens.long(), 16) == []

    asked = []
    monkeypatch.setattr(cuda_topk, "launch_cuda_topk_cluster", lambda *a, **kw: asked.append(kw["lens_early"]))
    route = planner.Route(planner.CUDA_RADIX, 2, topk_chunks=8, topk_cluster=8, topk_cap=4096, topk_threads=1024,
                          topk_smem=0)
    for after in (True, False):
        out = torch.empty(2, 16, dtype=torch.int32)
        real(route, logits, case.row_lens, None, SimpleNamespace(config=KernelConfig()), out, 16, 320,
             nan_low=False, after_scorer=after)
    assert asked == [True, False]


def _slot_table(rows: int, pages: int, seed: int) -> torch.Tensor:
    """Distinct physical pages per row (the attention's own table, not the indexer's)."""
    g = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(4 * pages + 7, generator=g)[:pages] for _ in range(rows)]
    return torch.stack(perms).to(torch.int32)


@pytest.mark.parametrize("algo", ["radix", "sample", "fused"])
def test_indexer_topk_writes_kv_cache_slots_on_every_triton_route(algo):
    # the Triton routes write positions, then one transform launch turns them into slots in place
    k = 32
    lens = [0, 31, 32, 64, 150, 257]
    case = make_case(lens, heads=32, table_pages=6, seed=9)
    width = 6 * 64
    cfg = FUSED if algo == "fused" else ALGOS[algo]
    ws = IndexerTopkWorkspace(len(lens), k, width, "cpu", num_sms=5 if algo != "fused" else 16, config=cfg)
    assert ws.plan_call(len(lens), width, 64).fused == (algo == "fused")
    positions = tk.indexer_topk(*case.args, k, width=width, workspace=ws)
    for page_size, pages in ((64, 6), (16, 24), (64, 3), (1, 300)):  # (64, 3), (1, 300): rows past it
        table = _slot_table(len(lens), pages, seed=page_size + pages)
        got = tk.indexer_topk(*case.args, k, width=width, workspace=ws, page_table=table, page_size=page_size)
        assert torch.equal(got, ref.page_table_slots(positions, table, page_size)), (page_size, pages)
        assert (got >= 0).any()
        past = (positions >= 0) & (positions >= pages * page_size)  # positions the table does not reach
        assert bool(past.any()) == (pages * page_size < 257) and bool((got[past] == -1).all())
    _assert_reset(ws)


@pytest.mark.parametrize("algo", list(ALGOS))
def test_topk_indices_writes_kv_cache_slots(algo):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 300, generator=g)
    lens = torch.tensor([300, 10, 170], dtype=torch.int32)
    ws = IndexerTopkWorkspace(3, 16, 0, "cpu", num_sms=4, config=ALGOS[algo])
    table = _slot_table(3, 10, seed=12)
    got = tk.topk_indices(x, lens, 16, workspace=ws, page_table=table, page_size=32)
    assert torch.equal(got, ref.page_table_slots(tk.topk_indices(x, lens, 16, workspace=ws), table, 32))


def test_the_transform_kernel_matches_the_reference_past_one_block():
    from vllm_sparse_sync.kernels.triton.slots import SLOTS_BLOCK, launch_page_slots

    g = torch.Generator().manual_seed(13)
    k = SLOTS_BLOCK + 77  # two programs a row, the second partly masked
    idx = torch.randint(-1, 8000, (2, k), generator=g, dtype=torch.int32)
    table = _slot_table(2, 40, seed=14)  # positions from page 40 on are past the table
    out = idx.clone()
    launch_page_slots(out, table, 7)
    assert torch.equal(out, ref.page_table_slots(idx, table, 128))
    assert (out == -1).sum() > (idx == -1).sum()  # some positions fell past the table


def test_the_public_transform_takes_the_triton_kernel_where_tensors_are_on_cuda(monkeypatch):
    # kernels.page_table_slots' device branch (checks, a contiguous copy, the launch), run here by
    # the interpreter on CPU tensors; the input is left as it was
    from vllm_sparse_sync.kernels import dispatch

    monkeypatch.setattr(dispatch, "_on_device", lambda t: True)
    g = torch.Generator().manual_seed(15)
    idx = torch.randint(-1, 900, (3, 40), generator=g, dtype=torch.int32).t().contiguous().t()  # strided
    table = _slot_table(3, 12, seed=16)
    before = idx.clone()
    got = dispatch.page_table_slots(idx, table, 64)
    assert torch.equal(got, ref.page_table_slots(before, table, 64)) and torch.equal(idx, before)
    with pytest.raises(ValueError, match="page_size"):
        dispatch.page_table_slots(idx, table, 48)
