"""The CUDA wgmma scorer (``kernels.cuda.scorer``) on a compute-capability-9.0 device, against the
torch reference: random lengths, tables with holes and out-of-range pages, both heads counts,
both length and table dtypes, the active-width clamp, the dense tail fill, NaN weights, the
exact and the e4m3 path, the rings (short, deep, chosen per program from its live tiles) and a
few split counts; keys and queries of every e4m3 byte (NaN keys included); a captured graph
replayed with new lengths across the ring's threshold; the ring under shuffled timings
(``RING_STRESS_NS``). Skips elsewhere, with the reason."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from late_writer import late_copier

from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG
from vllm_sparse_sync.kernels.synth import make_case
from vllm_sparse_sync.testing import decode_graph


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer

    ok, why = cuda_scorer.status(torch.cuda.current_device())
    return None if ok else why


WHY = _why_not()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=f"CUDA scorer: {WHY}")]
DEV = "cuda"


MIXED = 40
"""a ``DEEP_TILES`` under which the tests' programs (up to ~150 tiles) run both rings in one launch"""


@contextlib.contextmanager
def _ring(deep):
    """The launcher's ring: deep (True: every program), short (False: the short-ring kernel), an
    int (``DEEP_TILES``: chosen per program) or the library's default (None)."""
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer

    saved = cuda_scorer.DEEP_TILES
    if deep is not None:
        cuda_scorer.DEEP_TILES = None if deep is False else (0 if deep is True else deep)
    try:
        yield
    finally:
        cuda_scorer.DEEP_TILES = saved


def _score(case, width, *, precise, active=None, fill=True, splits=None, lens=None, table=None, deep=None,
           module=None):
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer
    from vllm_sparse_sync.kernels.planner import score_splits

    table = case.block_table if table is None else table
    lens = case.row_lens if lens is None else lens
    rows = case.q_fp8.shape[0]
    sel = min(width, table.shape[1] * 64)
    out = torch.full((rows, width), 7.0, device=DEV)  # a sentinel where nothing is written
    splits = splits or score_splits(rows, torch.cuda.get_device_properties(0).multi_processor_count)
    assert cuda_scorer.takes(case.q_fp8, case.k_cache, table, 64, splits)
    with _ring(deep):
        cuda_scorer.launch_cuda_score(case.q_fp8, case.weights, case.k_cache, table, lens, active, out,
                                      page_size=64, sel_width=sel, fill_width=width if fill else 0,
                                      splits=splits, precise=precise, module=module)
    return out


def _check(got, want, precise, n_written):
    """``got`` equals the reference where written, to the path's precision; the sentinel elsewhere."""
    rows, width = want.shape
    for r in range(rows):
        g, w = got[r, : n_written[r]], want[r, : n_written[r]]
        assert torch.equal(torch.isneginf(g), torch.isneginf(w)), f"row {r}: -inf positions"
        assert torch.equal(torch.isnan(g), torch.isnan(w)), f"row {r}: NaN positions"
        fin = torch.isfinite(w)
        if fin.any():
            scale = float(w[fin].abs().max())
            atol = 1e-3 + 1e-5 * scale if precise else 4e-3 * scale
            torch.testing.assert_close(g[fin], w[fin], rtol=1e-4 if precise else 2e-2, atol=atol,
                                       msg=lambda m, r=r: f"row {r}: {m}")
        assert bool((got[r, n_written[r]:] == 7.0).all()), f"row {r}: written past {n_written[r]}"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 9000), min_size=1, max_size=6),
    heads=st.sampled_from([64, 32]),
    precise=st.booleans(),
    wide=st.booleans(),
    active=st.one_of(st.none(), st.integers(-5, 9000)),
    lens64=st.booleans(),
    table64=st.booleans(),
    fill=st.booleans(),
    bad_pages=st.integers(0, 3),
    deep=st.sampled_from([True, False, MIXED, None]),
    splits=st.sampled_from([None, 1, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_scores_match_the_reference(lens, heads, precise, wide, active, lens64, table64, fill, bad_pages,
                                    deep, splits, seed):
    case = make_case(lens, heads=heads, table_pages=150, device=DEV, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(bad_pages):  # holes and pages past the cache inside live rows
        r, p = int(torch.randint(len(lens), (1,), generator=g)), int(torch.randint(150, (1,), generator=g))
        case.block_table[r, p] = -1 if p % 2 else case.k_cache.shape[0] + p
    width = 150 * 64 if wide else max(64, max(lens))
    act = None if active is None else torch.tensor([active], dtype=torch.int64 if lens64 else torch.int32,
                                                  device=DEV)
    lens_t = case.row_lens.to(torch.int64) if lens64 else case.row_lens
    table = case.block_table.to(torch.int64) if table64 else case.block_table
    got = _score(case, width, precise=precise, active=act, fill=fill, lens=lens_t, table=table, splits=splits,
                 deep=deep)
    want = ref.paged_indexer_logits(*case.args, width, active_width=act)
    n = ref.effective_lengths(case.row_lens, min(width, 150 * 64), act)
    _check(got, want, precise, [width if fill else int(x) for x in n])


def test_nan_weights_and_one_page_rows():
    case = make_case([64, 1, 65, 4096], heads=64, device=DEV, seed=3)
    case.weights[1, 5] = float("nan")
    for precise in (True, False):
        got = _score(case, 4096, precise=precise)
        want = ref.paged_indexer_logits(*case.args, 4096)
        assert bool(torch.isnan(got[1, 0])) and got[1, 0].view(torch.int32) < 0  # a negative NaN
        _check(got, want, precise, [4096] * 4)


@pytest.mark.parametrize("deep", [True, False, MIXED])
@pytest.mark.parametrize("splits", [1, 3, 600])
def test_any_split_count_scores_every_tile(splits, deep):
    case = make_case([20000, 7, 0, 12345], heads=64, device=DEV, seed=5)
    got = _score(case, 20480, precise=True, splits=splits, deep=deep)
    _check(got, ref.paged_indexer_logits(*case.args, 20480), True, [20480] * 4)


def test_the_step_takes_the_cuda_scorer_and_stays_exact(monkeypatch):
    from vllm_sparse_sync.kernels import ops, planner
    from vllm_sparse_sync.kernels.verify import topk_violations
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    lens = [0, 1000, 2049, 30000, 64 * 200, 5, 64, 4097]
    assert len(lens) == planner.CUDA_SCORER_MIN_ROWS
    case = make_case(lens, heads=64, device=DEV, seed=13)
    width = case.block_table.shape[1] * 64
    assert width >= planner.CUDA_SCORER_MIN_WIDTH
    ws = IndexerTopkWorkspace(len(lens), 2048, width, DEV)
    assert ws.plan_call(len(lens), width, 64).scorer == "cuda"
    assert ws.plan_call(len(lens) - 1, width, 64).scorer == "cuda"  # by its width bound
    got = ops.indexer_topk(*case.args, 2048, workspace=ws)
    want = ref.paged_indexer_logits(*case.args, width)
    finite = want[torch.isfinite(want)]
    assert topk_violations(got, want, case.row_lens.long(), 2048, tol=1e-5 * float(finite.abs().max())) == []
    monkeypatch.setattr(planner, "CUDA_SCORER_MIN_WIDTH", 2**31)  # by rows only
    rows_only = IndexerTopkWorkspace(len(lens), 2048, width, DEV)
    assert rows_only.plan_call(len(lens), width, 64).scorer == "cuda"
    assert rows_only.plan_call(len(lens) - 1, width, 64).scorer == "triton"


@pytest.mark.parametrize("deep", [None, 3])
def test_capture_then_replay_with_new_lengths(deep):
    """Replays with new lengths; with ``DEEP_TILES`` 3 (the deep-ring kernel captured, 40 splits) a
    program of 1-2 tiles runs the short ring and one of 3 the deep one, and which programs do
    changes from replay to replay with the lengths: the graph does not fix the ring."""
    case = make_case([64, 3000, 64], heads=64, table_pages=100, device=DEV, seed=9)
    out = torch.full((3, 6400), 7.0, device=DEV)
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer

    cuda_scorer.warmup(DEV)

    def step():
        cuda_scorer.launch_cuda_score(case.q_fp8, case.weights, case.k_cache, case.block_table, case.row_lens,
                                      None, out, page_size=64, sel_width=6400, fill_width=0, splits=40)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _ring(deep), torch.cuda.graph(graph):
        step()
    for lens in ([5000, 3000, 64], [64, 6400, 4097], [0, 0, 1]):
        out.fill_(7.0)
        case.row_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, ref.paged_indexer_logits(*case.args, 6400), True, lens)


@pytest.mark.parametrize("deep", [True, False, MIXED])
@pytest.mark.parametrize("precise", [True, False])
def test_the_ring_holds_under_shuffled_timings(deep, precise):
    """The library source built with ``RING_STRESS_NS``: producer lanes and consumer warpgroups
    pause pseudo-randomly (up to 3 us a tile), so copies are issued and slots read out of their
    usual order; every score still matches the reference. Guards the ring's barrier phases (a
    slot refilled before its reader arrived, a wait passing on a stale parity). In this build a
    wait longer than 2 s traps, so a deadlocked ring fails here instead of hanging."""
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer

    mod = cuda_scorer.module_for(torch.cuda.current_device(), (("RING_STRESS_NS", 3000),))
    case = make_case([30000, 64 * 300 + 5, 9000], heads=64, device=DEV, seed=21)
    width = case.block_table.shape[1] * 64
    want = ref.paged_indexer_logits(*case.args, width)
    for splits in (1, 2):  # 469 and 235 tiles a program of the first row
        got = _score(case, width, precise=precise, splits=splits, deep=deep, module=mod)
        _check(got, want, precise, [width] * 3)


@pytest.mark.parametrize("heads", [64, 32])
def test_every_key_byte_scores_as_the_reference(heads):
    """Keys and queries of every e4m3 byte (±0, subnormals, ±448; NaN keys) on the exact path,
    with 0-2, 11-64 and 4-22 tiles a program: the scores are the reference's, a NaN key byte
    making its token's dots NaN (relu 0, the reference's maxNum)."""
    case = make_case([4096, 700, 64 * 20 + 3], heads=heads, device=DEV, seed=31)
    g = torch.Generator(device=DEV).manual_seed(7)
    keys = case.k_cache[:, : 64 * 128]
    keys.copy_(torch.randint(0, 256, keys.shape, generator=g, device=DEV, dtype=torch.int32).to(torch.uint8))
    first = int(case.block_table[0, 0])
    keys.view(-1, 64, 128)[first, :2] = torch.arange(256, device=DEV, dtype=torch.uint8).view(2, 128)
    nan_token = ((keys.view(-1, 64, 128) & 0x7F) == 0x7F).any(dim=2)
    assert bool(nan_token.any()) and not bool(nan_token.all())
    qb = torch.randint(0, 256, case.q_fp8.shape, generator=g, device=DEV, dtype=torch.int32).to(torch.uint8)
    qb[qb & 0x7F == 0x7F] = 0x01  # queries finite
    case.q_fp8.view(torch.uint8).copy_(qb)
    case.weights.copy_(torch.rand(case.weights.shape, generator=g, device=DEV) - 0.3)
    width = case.block_table.shape[1] * 64
    want = ref.paged_indexer_logits(*case.args, width)
    assert bool((want[0, :2] == 0).all())  # tokens 0, 1 hold NaN bytes: every dot relu 0
    for splits in (None, 1, 3):
        _check(_score(case, width, precise=True, splits=splits), want, True, [width] * 3)


def _chained_outputs(cases, ws, steps, k):
    """Each of ``steps`` steps in one CUDA graph on ``cases[i % len(cases)]``, every step on ``ws``
    (one logits buffer: a step's scorer overwrites the scores the step before it selects from)
    into its own output; the outputs after one replay."""
    from vllm_sparse_sync.kernels import ops

    rows = cases[0].row_lens.numel()
    outs = [torch.full((rows, k), -7, dtype=torch.int32, device=DEV) for _ in range(steps)]

    def run():
        for i, out in enumerate(outs):
            ops.indexer_topk(*cases[i % len(cases)].args, k, workspace=ws, out=out)

    graph = decode_graph(run)  # also: no host sync in the chained capture
    for out in outs:
        out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    return outs


def test_chained_steps_select_what_each_step_alone_does():
    """The scorer is a dependent launch after the step before it, whose top-k lets it launch once
    its own wait is over: it must wait for that top-k before it writes the logits the top-k still
    reads. Steps chained in a graph select exactly what each step does alone."""
    from vllm_sparse_sync.kernels import ops
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    k, width = 2048, 4096
    cases = [make_case([4096], heads=64, table_pages=width // 64, device=DEV, seed=40 + s) for s in range(4)]
    ws = IndexerTopkWorkspace(1, k, width, DEV)
    route = ws.plan_call(1, width, 64)
    assert route.scorer == "cuda" and route.kind == "cuda_radix" and ws.config.pdl
    alone = IndexerTopkWorkspace(1, k, width, DEV, config=DEFAULT_CONFIG.with_values(pdl=False))
    want = []
    for case in cases:
        want.append(ops.indexer_topk(*case.args, k, workspace=alone).clone())
        torch.cuda.synchronize()
    for _ in range(3):
        outs = _chained_outputs(cases, ws, 48, k)
        assert all(torch.equal(out, want[i % len(cases)]) for i, out in enumerate(outs))


@pytest.mark.parametrize("waits", [True, False], ids=["library", "planted-no-wait"])
def test_the_scorer_reads_what_the_kernel_before_it_wrote(waits):
    """After a kernel that lets it launch at once and writes the head weights 20 ms later, the
    step's scorer (a dependent launch) scores with the new weights: it waits for that kernel
    before it reads them. A scorer built without the wait (``PDL_WAIT=0``, planted) reads the old
    ones, and the selection follows them."""
    from vllm_sparse_sync.kernels import ops
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    k, width = 512, 4096
    case = make_case([4096, 3000], heads=64, table_pages=width // 64, device=DEV, seed=77)
    w_old, w_new = case.weights.clone(), -case.weights
    ws = IndexerTopkWorkspace(2, k, width, DEV)
    assert ws.plan_call(2, width, 64).scorer == "cuda" and ws.config.pdl
    want = {}
    for name, wt in (("old", w_old), ("new", w_new)):
        case.weights.copy_(wt)
        want[name] = _sets(ops.indexer_topk(*case.args, k, workspace=ws))
    assert not torch.equal(want["old"], want["new"])
    copy = late_copier(DEV)
    real = cuda_scorer.module_for
    if not waits:
        cuda_scorer.module_for = lambda index, defines=(): real(index, tuple(defines) + (("PDL_WAIT", 0),))
    try:
        out = torch.empty(2, k, dtype=torch.int32, device=DEV)
        for _ in range(2):  # the first call loads every kernel (CUDA loads a kernel's code lazily)
            case.weights.copy_(w_old)
            torch.cuda.synchronize()
            # 20 ms late: 2 ms lost the planted race once under four xdist workers on one GPU
            copy(case.weights, w_new, 20_000_000)
            ops.indexer_topk(*case.args, k, workspace=ws, out=out)
            torch.cuda.synchronize()
    finally:
        cuda_scorer.module_for = real
    got = _sets(out)
    if waits:
        assert torch.equal(got, want["new"])
    else:
        assert torch.equal(got, want["old"]), "the planted scorer did not read the old weights"


def _sets(t):
    """Each row's selected positions, sorted."""
    return t.sort(dim=1).values
