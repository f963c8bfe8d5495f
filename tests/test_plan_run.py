"""A step's ``run()`` takes no route decision: its plan is made when the step is, and every call
looks its route up. Proven on the CPU: the Triton kernels run in the interpreter on CPU tensors,
every planner function raises once the plan is made, and a step of every planned row count (and
width band) still runs, selecting what the reference selects."""

from __future__ import annotations

import pytest
import torch
from interpret_env import CUDA, SKIP_WITH_CUDA

triton = pytest.importorskip("triton")

from vllm_sparse_sync import DecodeBatch, IndexerLayout, IndexerMetadataBuilder, IndexerStep, SeqLenShadow  # noqa: E402
from vllm_sparse_sync.kernels import ops, planner, reference  # noqa: E402
from vllm_sparse_sync.kernels import device as device_mod  # noqa: E402
from vllm_sparse_sync.kernels.synth import make_case  # noqa: E402
from vllm_sparse_sync.kernels.triton import fused, topk_sample  # noqa: E402
from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace  # noqa: E402

pytestmark = [pytest.mark.interpret, pytest.mark.skipif(CUDA, reason=SKIP_WITH_CUDA)]

K, HEADS, PAGES = 16, 16, 6
MAX_ROWS = 11


def _boom(*args, **kwargs):
    raise AssertionError("a route decision on the run path")


def _interpreted_step(layout: IndexerLayout, builder: IndexerMetadataBuilder) -> IndexerStep:
    """The builder's step with the Triton routes on CPU tensors (the interpreter stands in for the
    GPU: a CPU step would run the torch reference, which has no plan)."""
    step = IndexerStep.for_builder(builder)
    assert step.plan is None  # the public CPU step: the torch reference
    step.workspace = IndexerTopkWorkspace(step.max_rows, layout.topk, step.width_capacity, "cpu", num_sms=4)
    step.unmapped = step.workspace.unmapped
    step.plan = step._plan()
    return step


@pytest.mark.parametrize("backend", ["b12x", "deepgemm"])
def test_every_planned_row_count_runs_with_the_planner_gone(backend, monkeypatch):
    # every route kind within MAX_ROWS rows: fused (1-3), radix (4-7), sampled (8-11)
    monkeypatch.setattr(planner, "FUSED_MAX_ROWS", 3)
    monkeypatch.setattr(planner, "SAMPLE_MIN_ROWS", 8)
    for name, value in dict(CAP=128, SAMPLE_ABOVE=128, SAMPLES=64, BLOCK=64, RESOLVE_BLOCK=64).items():
        monkeypatch.setattr(topk_sample, name, value)
    monkeypatch.setattr(fused, "RESOLVE_BLOCK", 64)
    layout = IndexerLayout(backend=backend, topk=K, num_heads=HEADS, max_model_len=PAGES * 64)
    builder = IndexerMetadataBuilder(layout, max_num_reqs=MAX_ROWS, max_num_tokens=MAX_ROWS,
                                     max_pages_per_req=PAGES, device="cpu")
    step = _interpreted_step(layout, builder)
    plan = step.plan
    kinds = {plan.route(rows, w).kind for rows in range(1, MAX_ROWS + 1) for w in plan.widths}
    assert kinds == {"fused", "radix", "sample"}, kinds
    if backend == "deepgemm":
        assert len(plan.widths) > 1  # the host bound's bands
    # the plan is made: from here any route decision fails the run
    for name in ("plan_route", "plan_step", "scorer_for", "topk_algo_for", "fused_grid", "score_splits",
                 "cluster_route", "width_bands"):
        monkeypatch.setattr(planner, name, _boom)
    monkeypatch.setattr(IndexerTopkWorkspace, "plan_call", _boom)
    monkeypatch.setattr(device_mod, "device_info", _boom)
    ran = set()
    g = torch.Generator().manual_seed(7)
    for rows in range(1, MAX_ROWS + 1):
        lens = torch.randint(0, PAGES * 64 + 1, (rows,), generator=g).tolist()
        lens[0] = PAGES * 64 // (1 + rows % 3)  # the batch's longest row sets the bound's band
        case = make_case(lens, heads=HEADS, table_pages=PAGES, seed=rows)
        qsl = torch.arange(rows + 1, dtype=torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32)
        batch = DecodeBatch(qsl.clone(), qsl, seq.clone(), SeqLenShadow(seq), case.block_table,
                            max_seq_len=max(lens))
        meta = builder.build(batch)
        got = step.run(meta, case.q_fp8, case.weights, case.k_cache)
        width = step.contract(meta)[1]
        ran.add((plan.route(rows, width).kind, width))
        want = reference.indexer_topk(case.q_fp8, case.weights, case.k_cache, meta.block_table, meta.row_lens,
                                      K, width=width)
        for r in range(rows):
            assert set(got[r].tolist()) == set(want[r].tolist()), (rows, r)
    assert {kind for kind, _ in ran} == {"fused", "radix", "sample"}
    assert step.health().ok


def test_a_step_route_is_looked_up_not_planned(monkeypatch):
    """``IndexerStep.run`` hands ``ops.indexer_topk`` the plan's route for the call's rows and width."""
    layout = IndexerLayout(backend="deepgemm", topk=K, num_heads=HEADS, max_model_len=PAGES * 64)
    builder = IndexerMetadataBuilder(layout, max_num_reqs=4, max_num_tokens=4, max_pages_per_req=PAGES,
                                     device="cpu")
    step = _interpreted_step(layout, builder)
    given = []
    monkeypatch.setattr(ops, "indexer_topk", lambda *a, route=None, **kw: given.append(route) or kw["out"])
    case = make_case([100, 40], heads=HEADS, table_pages=PAGES, seed=3)
    qsl = torch.arange(3, dtype=torch.int32)
    seq = torch.tensor([100, 40], dtype=torch.int32)
    meta = builder.build(DecodeBatch(qsl.clone(), qsl, seq.clone(), SeqLenShadow(seq), case.block_table,
                                     max_seq_len=100))
    out = torch.empty(2, K, dtype=torch.int32)
    step.run(meta, case.q_fp8, case.weights, case.k_cache, out=out)
    assert given == [step.plan.route(2, meta.bound.value)] and given[0] is step.plan.route(2, meta.bound.value)
