"""DCP across processes on the CPU (gloo): the exact global top-k of ``DcpIndexerStep``, its
bad-input errors, and the ``multirank`` fixture that runs it.

Ranks are spawned once per world size for the session (the ``multirank`` fixture) and every
test sends them many cases per call. Each rank's step runs under the sentinel
(``check_step(layers="sentinel")``) watching every device-standing tensor, and is compared with
the single-process reference over the whole rows (``dcp_cases``).
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from dcp_cases import Case, cross_rank_errors, run_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_sparse_sync import DcpIndexerStep, IndexerLayout, dcp, rank_layout
from vllm_sparse_sync.distributed import torch_local_candidates, torch_logits
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.synth import make_case
from vllm_sparse_sync.testing import RankFailure, RankPool

pytest_plugins = ["pytester"]

TIMEOUT = 240


def _check(multirank, cases, world, **kw):
    per_rank = multirank.run(run_cases, list(cases), world_size=world, timeout=TIMEOUT, **kw)
    return cross_rank_errors(per_rank)


# ------------------------------------------------------------------ exactness, edge cases
EDGE = [  # (seq_lens, query_lens, k, interleave, ratio, backend, ties)
    ((700, 40, 1500), (1, 2, 1), 64, 1, 1, "b12x", False),  # long rows, MTP, a row shorter than k
    ((700, 40, 150), (1, 1, 3), 64, 64, 1, "deepgemm", True),  # interleave 64, ties everywhere
    ((5, 1, 2000), (1, 1, 1), 100, 1, 4, "b12x", False),  # ratio 4: compressed rows of 1 and 0
    ((70, 130, 64), (1, 1, 1), 16, 64, 1, "b12x", True),  # interleave 64: ranks that own no token
    ((1, 2, 3), (1, 1, 1), 8, 1, 1, "deepgemm", False),  # rows shorter than the world
    ((2048,), (4,), 256, 2, 1, "deepgemm", True),  # the longest rows, k of 256, MTP of 4
    ((300, 300), (1, 1), 1, 1, 1, "b12x", True),  # k = 1: the lowest position among the best
]


@pytest.mark.parametrize("world", [2, 4])
def test_edge_cases_equal_the_single_process_top_k(multirank, world):
    cases = [Case(world=world, seq_lens=s, query_lens=q, k=k, interleave=i, ratio=r, backend=b, ties=t,
                  seed=n) for n, (s, q, k, i, r, b, t) in enumerate(EDGE)]
    assert _check(multirank, cases, world) == []


@st.composite
def cases(draw, world):
    interleave = draw(st.sampled_from([1, 1, 2, 64]))
    ratio = draw(st.sampled_from([1, 1, 4]))
    n = draw(st.integers(1, 4))
    query_lens = tuple(draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)))
    max_model_len = draw(st.sampled_from([256, 2048]))
    short = draw(st.booleans())
    top = min(max_model_len, 200) if short else max_model_len
    seq_lens = tuple(draw(st.integers(q, top)) for q in query_lens)
    return Case(world=world, seq_lens=seq_lens, query_lens=query_lens,
                k=draw(st.sampled_from([1, 7, 64, 256])), interleave=interleave, ratio=ratio,
                backend=draw(st.sampled_from(["b12x", "deepgemm"])), max_model_len=max_model_len,
                ties=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
                authoritative=draw(st.booleans()))


RANDOM = settings(max_examples=8, deadline=None, derandomize=False,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("world", [2, 4])
@RANDOM
@given(data=st.data())
def test_random_batches_equal_the_single_process_top_k(multirank, world, data):
    batch = data.draw(st.lists(cases(world), min_size=3, max_size=3), label="cases")
    assert _check(multirank, batch, world) == []


@pytest.mark.parametrize("plant", ["tiebreak", "map", "remap"])
def test_the_checks_catch_a_planted_bug(multirank, plant):
    """A tie-break to the highest position, a local->global map that ignores the interleave,
    a global->local map off by one: each one makes these checks fail."""
    cases = [Case(world=2, seq_lens=s, query_lens=q, k=k, interleave=i, ratio=r, backend=b, ties=True,
                  seed=n, plant=plant) for n, (s, q, k, i, r, b, _) in enumerate(EDGE[:4])]
    assert _check(multirank, cases, 2, sentinel=False) != []


def test_the_triton_local_route_agrees_in_the_interpreter(multirank):
    """The CUDA route's host code (unfused Triton scorer and top-k, scores read back from the
    workspace) in Triton's interpreter, merged across 2 ranks."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton's CPU interpreter (the GPU tests run the compiled kernels)")
    cases = [Case(world=2, seq_lens=(300, 90), query_lens=(1, 1), k=32, interleave=i, backend=b,
                  max_model_len=256 * 2, ties=t, seed=i, local_route="triton")
             for i, b, t in ((1, "b12x", False), (64, "deepgemm", True))]
    assert _check(multirank, cases, 2, sentinel=False) == []


@pytest.mark.parametrize("world", [2, 4])
def test_the_triton_merge_route_agrees_in_the_interpreter(multirank, world):
    """The CUDA merge route (send-key kernel, all-gather, merge + remap kernel) in Triton's
    interpreter: after the Triton local route (send keys read from the scorer's logits) and
    after the torch one (send keys from per-slot scores), under the sentinel."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton's CPU interpreter (the GPU tests run the compiled kernels)")
    cases = [Case(world=world, seq_lens=(300, 90, 5), query_lens=(1, 2, 1), k=32, interleave=i,
                  backend=b, max_model_len=256 * 2, ties=t, seed=i, local_route=lr,
                  merge_route="triton")
             for i, b, t, lr in ((1, "b12x", False, "triton"), (64, "deepgemm", True, "torch"),
                                 (2, "b12x", True, "torch"))]
    assert _check(multirank, cases, world) == []


# ------------------------------------------------------------------ bad input, every rank
def _construct(ctx, how: str):
    """Construct a step with a misconfiguration; the error text on this rank (or 'ok')."""
    lay = IndexerLayout(backend="b12x", topk=16, max_model_len=512, dcp_world_size=ctx.world_size,
                        dcp_rank=ctx.rank)
    kw = dict(max_rows=4, max_pages_per_req=8, device="cpu")
    if how == "world":  # every rank: a layout for a larger world than the group
        lay = dataclasses.replace(lay, dcp_world_size=ctx.world_size * 2)
    elif how == "rank" and ctx.rank == 1:  # one rank: a layout naming another rank
        lay = dataclasses.replace(lay, dcp_rank=0)
    elif how == "topk" and ctx.rank == ctx.world_size - 1:  # one rank disagrees on k
        lay = dataclasses.replace(lay, topk=32)
    elif how == "max_rows" and ctx.rank == 0:
        kw["max_rows"] = 0
    elif how == "merge_route" and ctx.rank == 1:
        kw["merge_route"] = "sorted"
    elif how == "cuda_merge_on_cpu" and ctx.rank == 1:
        kw["merge_route"] = "cuda"
    try:
        DcpIndexerStep(lay, **kw)
    except ValueError as exc:
        return str(exc)
    return "ok"


@pytest.mark.parametrize("how, text", [
    ("world", "layout.dcp_world_size=4 does not match the process group's size 2"),
    ("rank", "rank 1: layout.dcp_rank=0 is not this process's rank 1"),
    ("topk", "rank 1: topk=32 differs from rank 0's 16"),
    ("max_rows", "rank 0: max_rows: must be >= 1, got 0"),
    ("merge_route", "rank 1: merge_route: must be one of auto, cuda, triton, torch, got 'sorted'"),
    ("cuda_merge_on_cpu", "rank 1: merge_route='cuda': the CUDA merge cannot run here (device cpu)"),
])
def test_a_misconfigured_rank_gets_the_same_clear_error_on_every_rank(multirank, how, text):
    msgs = multirank.run(_construct, how, world_size=2, timeout=60)
    assert msgs[0] == msgs[1] and text in msgs[0], msgs


def _bad_candidates(ctx):
    lay = rank_layout(IndexerLayout(backend="b12x", topk=8, max_model_len=512))
    step = DcpIndexerStep(lay, max_rows=4, max_pages_per_req=8, device="cpu")
    errors = []
    for idx, scores in ((torch.zeros(3, 5, dtype=torch.int32), torch.zeros(3, 5)),  # k wrong
                        (torch.zeros(9, 8, dtype=torch.int32), torch.zeros(9, 8)),  # rows > max
                        (torch.zeros(3, 8, dtype=torch.int32), torch.zeros(3, 7)),  # scores differ
                        (torch.zeros(3, 8), torch.zeros(3, 8))):  # float positions
        try:
            step.merge(idx, scores)
        except ValueError as exc:
            errors.append(str(exc).split(":")[0])
    # the ranks are still in step: a good merge after the refused ones
    local = torch.arange(8, dtype=torch.int32).repeat(2, 1)
    out = step.merge(local, torch.full((2, 8), float(ctx.rank)))
    return errors, out.global_idx.tolist(), out.local_mask.tolist()


def test_candidates_of_the_wrong_shape_are_refused_before_the_collective(multirank):
    results = multirank.run(_bad_candidates, world_size=2, timeout=60)
    for errors, _, _ in results:
        assert errors == ["local_idx", "local_idx", "local_scores", "local_idx/local_scores"]
    # rank 1's scores (1.0) beat rank 0's (0.0): its 8 tokens 1, 3, ..., 15 win, in order
    assert results[0][1] == results[1][1] == [[1, 3, 5, 7, 9, 11, 13, 15]] * 2
    assert results[0][2] == [[False] * 8] * 2 and results[1][2] == [[True] * 8] * 2


def test_a_step_without_a_process_group_says_so():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        DcpIndexerStep(IndexerLayout(backend="b12x", max_model_len=64), max_rows=1,
                       max_pages_per_req=1, device="cpu")


# ------------------------------------------------------------------ single-process pieces
def test_candidate_keys_order_as_the_kernels_and_break_ties_to_the_lowest_id():
    scores = torch.tensor([float("nan"), -0.0, 0.0, 1.0, 1.0, float("-inf"), 2.0, 1.0])
    ids = torch.tensor([0, 1, 2, 7, 3, 4, 5, -1])
    order = torch.sort(dcp.candidate_keys(scores, ids), descending=True).indices
    assert ids[order].tolist() == [5, 3, 7, 2, 1, 4, 0, -1]
    assert dcp.key_ids(dcp.candidate_keys(scores, ids)).tolist() == ids.tolist()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_merge_of_simulated_ranks_equals_the_reference_with_nan_and_ties(gen, world):
    rows, length, k, interleave = 4, 900, 50, 2
    logits = torch.randint(-3, 4, (rows, length), generator=gen).float()
    logits[0, ::7] = float("nan")
    logits[1, 10:20] = -0.0
    keys = []
    for rank in range(world):
        mine = dcp.global_to_local(torch.arange(length), world, rank, interleave) >= 0
        local = logits[:, mine]
        idx = ref.topk_indices(local, torch.full((rows,), local.shape[1], dtype=torch.int32), k)
        s = local.gather(1, idx.clamp_min(0).long())
        keys.append(dcp.candidate_keys(s, dcp.local_to_global(idx, world, rank, interleave)))
    merged = dcp.merge_candidate_keys(torch.stack(keys), k)
    want = ref.topk_indices(logits, torch.full((rows,), length, dtype=torch.int32), k)
    for r in range(rows):  # ties to the lowest positions: the reference's set, exactly
        assert sorted(merged[r].tolist()) == sorted(want[r].tolist())


def test_the_merge_writes_the_k_largest_keys_in_gathered_order():
    pad = dcp.PAD_KEY
    keys = torch.tensor([[[10, 5, pad]], [[7, 10, 3]]])  # world 2, one row, 3 slots per rank
    ids = dcp.key_ids(keys).view(-1).tolist()  # gathered order: rank 0's slots, then rank 1's
    assert dcp.merge_candidate_keys(keys, 2)[0].tolist() == [ids[0], ids[4]]  # both 10s
    assert dcp.merge_candidate_keys(keys, 1)[0].tolist() == [ids[0]]  # the first 10 gathered
    assert dcp.merge_candidate_keys(keys, 5)[0].tolist() == [ids[0], ids[1], ids[3], ids[4], ids[5]]
    # fewer real keys than k: every real key, then -1 (padding keys are never ids)
    assert dcp.merge_candidate_keys(keys, 8)[0].tolist() == [ids[i] for i in (0, 1, 3, 4, 5)] + [-1] * 3


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=4), k=st.integers(1, 80),
       ties=st.booleans(), seed=st.integers(0, 2**16), active=st.one_of(st.none(), st.integers(0, 300)))
def test_torch_local_candidates_are_the_reference_top_k_of_the_reference_scores(lens, k, ties, seed,
                                                                                 active):
    case = make_case(lens, heads=16, ties=ties, seed=seed, table_pages=5)
    aw = None if active is None else torch.tensor([active], dtype=torch.int32)
    width = 5 * 64
    logits = torch_logits(*case.args, width, active_width=aw)
    want_logits = ref.paged_indexer_logits(*case.args, width, active_width=aw)
    assert torch.equal(torch.isinf(logits), torch.isinf(want_logits))
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    idx, scores = torch_local_candidates(*case.args, k, width, active_width=aw)
    want = ref.topk_indices(logits, case.row_lens, k, active_width=aw)
    eff = ref.effective_lengths(case.row_lens, width, aw)
    if ties:  # exact arithmetic: the full reference agrees too
        assert torch.equal(want, ref.indexer_topk(*case.args, k, active_width=aw, width=width))
    for r in range(len(lens)):
        if int(eff[r]) > k:
            assert torch.equal(idx[r], want[r])
        else:
            assert sorted(idx[r].tolist()) == sorted(want[r].tolist())
        got = idx[r][idx[r] >= 0].long()
        assert torch.equal(scores[r][: got.numel()], logits[r, got])


def test_torch_logits_of_a_token_do_not_depend_on_the_shapes_around_it(gen):
    """What lets a DCP rank's scores be compared exactly with the whole row's."""
    seed = int(torch.randint(0, 99, (1,), generator=gen))
    case = make_case([640, 300, 64], heads=32, table_pages=10, seed=seed)
    full = torch_logits(*case.args, 640)
    for rows, pages in ((slice(0, 1), 10), (slice(1, 3), 5), (slice(0, 3), 1)):
        part = torch_logits(case.q_fp8[rows], case.weights[rows], case.k_cache,
                            case.block_table[rows, :pages].contiguous(), case.row_lens[rows], 640)
        assert torch.equal(part, full[rows, : pages * 64])


# ------------------------------------------------------------------ the fixture itself
def _rank_info(ctx, x):
    import torch.distributed as dist

    t = torch.tensor([ctx.rank * 10 + x])
    out = [torch.zeros(1, dtype=torch.long) for _ in range(ctx.world_size)]
    dist.all_gather(out, t)
    return ctx.rank, ctx.world_size, ctx.device, [int(o) for o in out]


def _fail_on_rank_1(ctx):
    import torch.distributed as dist

    if ctx.rank == 1:
        raise KeyError("planted failure on rank 1")
    dist.barrier()  # rank 0 waits for rank 1, which never comes


def _hang_on_rank_0(ctx):
    if ctx.rank == 0:
        time.sleep(3600)
    return "done"


def test_results_come_back_in_rank_order(multirank):
    got = multirank.run(_rank_info, 3, world_size=2)
    assert got == [(0, 2, "cpu", [3, 13]), (1, 2, "cpu", [3, 13])]


def test_a_failing_rank_fails_the_call_with_its_traceback_and_never_hangs():
    with RankPool(2) as pool:
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_fail_on_rank_1, timeout=60)
        assert time.monotonic() - start < 30
        assert "rank 1 failed" in str(info.value)
        assert "KeyError: 'planted failure on rank 1'" in info.value.errors[1]
        assert "_fail_on_rank_1" in info.value.errors[1]  # the traceback, not just the message
        assert 0 in info.value.errors  # rank 0, stuck in the barrier, is reported too
        assert not pool.alive  # shut down: its ranks may be stuck in a collective


def test_a_hung_rank_times_out():
    with RankPool(2) as pool:
        start = time.monotonic()
        with pytest.raises(RankFailure, match="timed out") as info:
            pool.run(_hang_on_rank_0, timeout=3)
        assert time.monotonic() - start < 20
        assert "did not finish within 3 s" in info.value.errors[0]


def test_two_pools_at_once_pick_their_own_ports():
    with RankPool(2) as a, RankPool(2) as b:
        assert a.run(_rank_info, 1) == [(0, 2, "cpu", [1, 11]), (1, 2, "cpu", [1, 11])]
        assert b.run(_rank_info, 2)[1] == (1, 2, "cpu", [2, 12])


def test_an_unpicklable_function_is_refused_in_the_test_process():
    with RankPool(1) as pool, pytest.raises(TypeError, match="must pickle"):
        pool.run(lambda ctx: None)


def test_the_fixture_reaches_users_through_the_plugin(pytester):
    pytester.makepyfile(test_user="""
import torch.distributed as dist

def total(ctx, base):
    import torch
    t = torch.tensor([base + ctx.rank])
    dist.all_reduce(t)
    return int(t)

def test_sum(multirank):
    assert multirank.run(total, 10, world_size=2) == [21, 21]
""")
    result = pytester.runpytest_subprocess("-q")
    result.assert_outcomes(passed=1)
