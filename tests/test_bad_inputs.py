"""A sweep of bad host inputs over the public API: each is a ``TypeError`` or ``ValueError`` that
names the argument, raised by this package's own checks (never from inside torch, numpy or
Python), never a result. Plus the inputs that used to give a silent wrong answer, and numpy
integers wherever a host int is taken."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import vllm_sparse_sync
from vllm_sparse_sync import (
    DecodeBatch,
    IndexerLayout,
    IndexerMetadataBuilder,
    IndexerStep,
    SeqLenShadow,
    decode_topk_bound,
    dcp,
    kernels,
    lengths,
    rank_layout,
)
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.synth import make_case

PACKAGE = os.path.dirname(vllm_sparse_sync.__file__)
HEADS = 16
LAY = IndexerLayout(backend="b12x", topk=8, num_heads=HEADS, max_model_len=1024)
CAPS = dict(max_num_reqs=4, max_num_tokens=8, max_pages_per_req=16)


def assert_project_error(call: Callable[[], object], field: str) -> BaseException:
    """``call()`` raises a TypeError or ValueError naming ``field``, from this package's code."""
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert field in str(info.value), f"{field!r} not named in: {info.value}"
    tb = info.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename
    assert where.startswith(PACKAGE), f"raised from {where}:{tb.tb_lineno}, not this package: {info.value}"
    return info.value


# --------------------------------------------------------------------------- valid bases
def _batch(**change) -> DecodeBatch:
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    lens = torch.tensor([100, 200], dtype=torch.int32)
    base = dict(query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=lens.clone(),
                shadow=SeqLenShadow(lens.clone()), block_table=torch.zeros(2, 16, dtype=torch.int32),
                max_seq_len=200)
    return DecodeBatch(**{**base, **change})


def _case():
    return make_case([100, 30], heads=HEADS, seed=0)


def _builder(**kw):
    return IndexerMetadataBuilder(LAY, **{**CAPS, "device": "cpu", **kw})


def _step_call(**change):
    """``step.run(meta, q, w, k_cache, ...)`` with one argument replaced."""
    builder = _builder()
    step = IndexerStep.for_builder(builder)
    meta = builder.build(_batch())
    c = _case()
    args = dict(meta=meta, q_fp8=c.q_fp8, weights=c.weights, k_cache=c.k_cache)
    args.update(change)
    return lambda: step.run(**args)


META = torch.zeros(4, dtype=torch.int32, device="meta")
NOT_INTS = [2.5, "8", None, True, np.bool_(True), torch.tensor(8), [8]]
NOT_FLAGS = ["no", "False", 1, 0, None, [True]]
NOT_TENSORS = [[1, 2], np.zeros(2, dtype=np.int32), None, 3]


@dataclass(frozen=True)
class Bad:
    """One bad input: what it breaks (``field``, named in the error) and how to call it."""

    name: str
    field: str
    call: Callable[[], object]


def _layout_cases() -> list[Bad]:
    out = []
    for field in ("compress_ratio", "dcp_world_size", "cp_interleave", "page_size", "topk", "num_heads",
                  "head_dim", "max_model_len", "dcp_rank"):
        for i, v in enumerate(NOT_INTS):
            out.append(Bad(f"layout-{field}-{i}", field,
                           lambda f=field, v=v: IndexerLayout(**{"backend": "b12x", "max_model_len": 1024, f: v})))
    for name, kw, field in [
        ("model-len-2**40", dict(max_model_len=2**40), "max_model_len"),
        ("model-len-past-int32", dict(max_model_len=2**31), "max_model_len"),
        ("rows-past-limit", dict(max_model_len=2**31 - 1), "max_model_len"),
        ("topk-past-limit", dict(topk=2**30 + 1), "topk"),
        ("page-past-limit", dict(page_size=2**21), "page_size"),
        ("head-dim-60", dict(head_dim=60), "head_dim"),
        ("backend-int", dict(backend=3), "backend"),
    ]:
        out.append(Bad(f"layout-{name}", field,
                       lambda kw=kw: IndexerLayout(**{"backend": "b12x", "max_model_len": 1024, **kw})))
    return out


def _bound_cases() -> list[Bad]:
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    out = [
        Bad("bound-layout-dict", "layout", lambda: decode_topk_bound({"backend": "b12x"}, max_seq_len=5,
                                                                    query_start_loc_cpu=qsl)),
        Bad("bound-capturing-no", "capturing", lambda: decode_topk_bound(LAY, max_seq_len=5,
                                                                         query_start_loc_cpu=qsl, capturing="no")),
        Bad("bound-capturing-1", "capturing", lambda: decode_topk_bound(LAY, max_seq_len=5,
                                                                        query_start_loc_cpu=qsl, capturing=1)),
        Bad("bound-qsl-list", "query_start_loc_cpu", lambda: decode_topk_bound(LAY, max_seq_len=5,
                                                                               query_start_loc_cpu=[0, 1])),
        Bad("bound-qsl-float", "query_start_loc_cpu",
            lambda: decode_topk_bound(LAY, max_seq_len=5, query_start_loc_cpu=qsl.float())),
        Bad("bound-qsl-meta", "query_start_loc_cpu",
            lambda: decode_topk_bound(LAY, max_seq_len=5, query_start_loc_cpu=qsl.to("meta"))),
        Bad("shadow-list", "seq_lens_cpu", lambda: SeqLenShadow([5])),
        Bad("shadow-authoritative-no", "authoritative", lambda: SeqLenShadow(torch.tensor([5]), "no")),
        Bad("shadow-float", "shadow.seq_lens_cpu",
            lambda: decode_topk_bound(LAY, max_seq_len=5, query_start_loc_cpu=qsl,
                                      shadow=SeqLenShadow(torch.tensor([5.0])))),
    ]
    for i, v in enumerate(NOT_INTS):
        out.append(Bad(f"bound-max-seq-len-{i}", "max_seq_len",
                       lambda v=v: decode_topk_bound(LAY, max_seq_len=v, query_start_loc_cpu=qsl)))
    return out


def _builder_cases() -> list[Bad]:
    out = [
        Bad("builder-layout-dict", "layout", lambda: IndexerMetadataBuilder({"backend": "b12x"}, device="cpu", **CAPS)),
        Bad("builder-device-cuda", "device", lambda: _builder(device="cuda") if not torch.cuda.is_available()
            else pytest.skip("a CUDA host")),
        Bad("builder-device-nonsense", "device", lambda: _builder(device="nonsense")),
        Bad("builder-device-int-list", "device", lambda: _builder(device=[0])),
        Bad("builder-rows-past-limit", "max_num_tokens", lambda: _builder(max_num_tokens=2**20 + 1)),
        Bad("builder-pages-past-limit", "max_pages_per_req", lambda: _builder(max_pages_per_req=2**24 + 1)),
        Bad("build-none", "batch", lambda: _builder().build(None)),
        Bad("build-capture-reqs", "num_reqs", lambda: _builder().build_for_capture(1.5, 2)),
        Bad("build-capture-tokens", "num_tokens", lambda: _builder().build_for_capture(1, "2")),
    ]
    for cap in ("max_num_reqs", "max_num_tokens", "max_pages_per_req"):
        for i, v in enumerate([*NOT_INTS, 0, -3]):
            out.append(Bad(f"builder-{cap}-{i}", cap, lambda cap=cap, v=v: _builder(**{cap: v})))
    for flag in ("legacy_device_sync", "check_bound"):
        for i, v in enumerate(NOT_FLAGS[:-2] + NOT_FLAGS[-1:]):
            out.append(Bad(f"builder-{flag}-{i}", flag, lambda flag=flag, v=v: _builder(**{flag: v})))
    batch_bad = {
        "seq_lens": [[100, 200], torch.tensor([100.0, 200.0]), torch.tensor([100, 200]), META[:2]],
        "query_start_loc": [[0, 1, 2], torch.tensor([0.0, 1.0, 2.0]), META[:3]],
        "block_table": [torch.zeros(2, 16), torch.zeros(2, 16, dtype=torch.int64), torch.zeros(32, dtype=torch.int32),
                        [[0] * 16] * 2],
        "query_start_loc_cpu": [[0, 1, 2], torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 2, 1], dtype=torch.int32)],
        "max_seq_len": [200.0, "200", None, True, 5000],
        "shadow": ["x", [100, 200]],
    }
    for field, values in batch_bad.items():
        for i, v in enumerate(values):
            out.append(Bad(f"build-{field}-{i}", field,
                           lambda field=field, v=v: _builder().build(_batch(**{field: v}))))
    return out


def _step_cases() -> list[Bad]:
    c = _case()
    out = [
        Bad("step-layout-dict", "layout", lambda: IndexerStep({"backend": "b12x"}, max_rows=4, max_pages_per_req=4,
                                                              device="cpu")),
        Bad("step-device-meta", "device", lambda: IndexerStep(LAY, max_rows=4, max_pages_per_req=4, device="meta")),
        Bad("step-device-cuda", "device", lambda: IndexerStep(LAY, max_rows=4, max_pages_per_req=4, device="cuda")
            if not torch.cuda.is_available() else pytest.skip("a CUDA host")),
        Bad("step-config", "config", lambda: IndexerStep(LAY, max_rows=4, max_pages_per_req=4, device="cpu",
                                                         config={})),
        Bad("step-max-rows-past-limit", "max_rows", lambda: IndexerStep(LAY, max_rows=2**20 + 1, max_pages_per_req=4,
                                                                        device="cpu")),
        Bad("run-meta-dict", "meta", _step_call(meta={})),
        Bad("run-q-list", "q_fp8", _step_call(q_fp8=[1.0])),
        Bad("run-q-meta", "q_fp8", _step_call(q_fp8=c.q_fp8.to("meta"))),
        Bad("run-q-heads", "q_fp8", _step_call(q_fp8=make_case([100, 30], heads=32).q_fp8)),
        Bad("run-q-rows", "q_fp8", _step_call(q_fp8=c.q_fp8[:1])),
        Bad("run-weights-list", "weights", _step_call(weights=[[1.0]])),
        Bad("run-weights-meta", "weights", _step_call(weights=c.weights.to("meta"))),
        Bad("run-k-cache-list", "k_cache", _step_call(k_cache=[0])),
        Bad("run-k-cache-page-32", "k_cache", _step_call(k_cache=make_case([100, 30], page=32).k_cache)),
        Bad("run-k-cache-page-128", "k_cache", _step_call(k_cache=make_case([100, 30], page=128).k_cache)),
        Bad("run-k-cache-int8", "k_cache", _step_call(k_cache=c.k_cache.view(torch.int8))),
        Bad("run-out-float", "out", _step_call(out=torch.zeros(2, 8))),
        Bad("run-out-shape", "out", _step_call(out=torch.zeros(2, 9, dtype=torch.int32))),
        Bad("run-out-list", "out", _step_call(out=[[0] * 8] * 2)),
        Bad("run-slots-str", "slots", _step_call(slots="yes")),
        Bad("run-slots-float-table", "page_table", _step_call(slots=torch.zeros(2, 16))),
        Bad("run-slots-int64-table", "page_table", _step_call(slots=torch.zeros(2, 16, dtype=torch.int64))),
        Bad("step-route-str", "rows", lambda: IndexerStep(LAY, max_rows=4, max_pages_per_req=4, device="cpu").route("2")),
        Bad("step-route-past-max", "rows", lambda: IndexerStep(LAY, max_rows=4, max_pages_per_req=4,
                                                               device="cpu").route(5)),
        Bad("step-contract-none", "meta", lambda: IndexerStep(LAY, max_rows=4, max_pages_per_req=4,
                                                              device="cpu").contract(None)),
        Bad("step-for-builder", "builder", lambda: IndexerStep.for_builder(None)),
    ]
    for i, v in enumerate([*NOT_INTS, 0]):
        out.append(Bad(f"step-max-rows-{i}", "max_rows",
                       lambda v=v: IndexerStep(LAY, max_rows=v, max_pages_per_req=4, device="cpu")))
    return out


def _kernel_cases() -> list[Bad]:
    c = _case()
    q, w, kc, bt, lens = c.args
    logits = torch.randn(2, 64)
    k8, ks = kernels.quantize_index_k(torch.randn(3, 128))
    k60, ks60 = kernels.quantize_index_k(torch.randn(3, 64))
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    slots = torch.tensor([0, 1, 2])
    out = [
        # the K cache
        Bad("write-head-dim-60", "k_fp8", lambda: kernels.write_index_k_cache(cache, k60[:, :60].contiguous(),
                                                                                 ks60, slots)),
        Bad("write-head-dim-64", "k_cache", lambda: kernels.write_index_k_cache(cache, k60, ks60, slots)),
        Bad("write-slots-float", "slot_mapping", lambda: kernels.write_index_k_cache(cache, k8, ks, slots.float())),
        Bad("write-slots-list", "slot_mapping", lambda: kernels.write_index_k_cache(cache, k8, ks, [0, 1, 2])),
        Bad("write-slots-bool", "slot_mapping", lambda: kernels.write_index_k_cache(cache, k8, ks, slots > 0)),
        Bad("write-cache-list", "k_cache", lambda: kernels.write_index_k_cache([0], k8, ks, slots)),
        Bad("write-cache-meta", "k_cache", lambda: kernels.write_index_k_cache(cache.to("meta"), k8, ks, slots)),
        Bad("write-k-list", "k_fp8", lambda: kernels.write_index_k_cache(cache, [0], ks, slots)),
        Bad("write-scale-list", "k_scale", lambda: kernels.write_index_k_cache(cache, k8, [1.0], slots)),
        Bad("write-slots-meta", "slot_mapping", lambda: kernels.write_index_k_cache(cache, k8, ks, slots.to("meta"))),
        Bad("quantize-list", "k", lambda: kernels.quantize_index_k([[1.0]])),
        # the scorer and the step
        Bad("logits-row-lens-float", "row_lens", lambda: kernels.paged_indexer_logits(q, w, kc, bt, lens.float(), 64)),
        Bad("logits-table-float", "block_table", lambda: kernels.paged_indexer_logits(q, w, kc, bt.float(), lens, 64)),
        Bad("logits-q-meta", "q_fp8", lambda: kernels.paged_indexer_logits(q.to("meta"), w, kc, bt, lens, 64)),
        Bad("logits-cache-meta", "k_cache", lambda: kernels.paged_indexer_logits(q, w, kc.to("meta"), bt, lens, 64)),
        Bad("logits-out-int", "out", lambda: kernels.paged_indexer_logits(q, w, kc, bt, lens, 64,
                                                                          out=torch.zeros(2, 64, dtype=torch.int32))),
        Bad("logits-out-shape", "out", lambda: kernels.paged_indexer_logits(q, w, kc, bt, lens, 64,
                                                                            out=torch.zeros(2, 63))),
        Bad("logits-width-huge", "width", lambda: kernels.paged_indexer_logits(q, w, kc, bt, lens, 2**31)),
        Bad("topk-active-two", "active_width", lambda: kernels.indexer_topk(q, w, kc, bt, lens, 8,
                                                                            active_width=torch.tensor([64, 1]))),
        Bad("topk-active-float", "active_width", lambda: kernels.indexer_topk(q, w, kc, bt, lens, 8,
                                                                              active_width=torch.tensor([64.0]))),
        Bad("step-k-huge", "k", lambda: kernels.indexer_topk(q, w, kc, bt, lens, 10**13)),
        Bad("step-out-float", "out", lambda: kernels.indexer_topk(q, w, kc, bt, lens, 8, out=torch.zeros(2, 8))),
        Bad("step-row-lens-list", "row_lens", lambda: kernels.indexer_topk(q, w, kc, bt, [100, 30], 8)),
        Bad("step-k-cache-list", "k_cache", lambda: kernels.indexer_topk(q, w, [0], bt, lens, 8)),
        # the top-k of given scores
        Bad("select-logits-list", "logits", lambda: kernels.topk_indices([[1.0, 2.0]], torch.tensor([2]), 1)),
        Bad("select-logits-int", "logits", lambda: kernels.topk_indices(logits.int(), torch.tensor([64, 64]), 8)),
        Bad("select-logits-meta", "logits", lambda: kernels.topk_indices(logits.to("meta"), torch.tensor([64, 64]), 8)),
        Bad("select-row-lens-float", "row_lens", lambda: kernels.topk_indices(logits, torch.tensor([64.0, 3.0]), 8)),
        Bad("select-row-lens-list", "row_lens", lambda: kernels.topk_indices(logits, [64, 3], 8)),
        Bad("select-active-two", "active_width", lambda: kernels.topk_indices(logits, torch.tensor([64, 64]), 8,
                                                                              active_width=torch.tensor([30, 2]))),
        Bad("select-active-list", "active_width", lambda: kernels.topk_indices(logits, torch.tensor([64, 64]), 8,
                                                                               active_width=[30])),
        Bad("select-k-huge", "k", lambda: kernels.topk_indices(logits, torch.tensor([64, 64]), 10**13)),
        Bad("select-k-float", "k", lambda: kernels.topk_indices(logits, torch.tensor([64, 64]), 8.0)),
        Bad("select-out-float", "out", lambda: kernels.topk_indices(logits, torch.tensor([64, 64]), 8,
                                                                    out=torch.zeros(2, 8))),
        Bad("select-out-shape", "out", lambda: kernels.topk_indices(logits, torch.tensor([64, 64]), 8,
                                                                    out=torch.zeros(3, 8, dtype=torch.int32))),
        Bad("select-unmapped-int64", "unmapped", lambda: kernels.topk_indices(
            logits, torch.tensor([64, 64]), 8, page_table=torch.zeros(2, 1, dtype=torch.int32), page_size=64,
            unmapped=torch.zeros(1, dtype=torch.int64))),
        Bad("quantize-meta", "k", lambda: kernels.quantize_index_k(torch.zeros(2, 8, device="meta"))),
        Bad("quantize-pow2-str", "pow2_scale", lambda: kernels.quantize_index_k(torch.ones(2, 8), pow2_scale="no")),
        Bad("workspace-device", "device", lambda: kernels.make_workspace(2, 8, 64, "nonsense")),
        Bad("route-page-zero", "page", lambda: kernels.plan_route(2, 64, 0, kernels.DeviceInfo(4))),
        Bad("route-page-48", "page", lambda: kernels.plan_route(2, 64, 48, kernels.DeviceInfo(4))),
        Bad("slots-indices-list", "indices", lambda: kernels.page_table_slots([[0]], torch.zeros(1, 1, dtype=torch.int32),
                                                                              64)),
        Bad("slots-page-size-bool", "page_size", lambda: kernels.page_table_slots(
            torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), True)),
    ]
    return out


def _lengths_cases() -> list[Bad]:
    pos = torch.tensor([0, 5])
    return [
        Bad("compress-ratio-float", "ratio", lambda: lengths.compress(8, 2.0)),
        Bad("compress-ratio-zero", "ratio", lambda: lengths.compress(8, 0)),
        Bad("ceil-ratio-str", "ratio", lambda: lengths.compress_ceil(8, "4")),
        Bad("localize-world-float", "world_size", lambda: lengths.dcp_localize(8, 2.0, 0)),
        Bad("localize-rank-out", "rank", lambda: lengths.dcp_localize(8, 2, 2)),
        Bad("local-to-global-rank-bool", "rank", lambda: dcp.local_to_global(pos, 2, True)),
        Bad("merge-k-float", "k", lambda: dcp.merge_topk_candidates(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), 2.0)),
        Bad("rank-layout-dict", "layout", lambda: rank_layout({"backend": "b12x"})),
        Bad("compress-list", "lengths", lambda: lengths.compress([5], 2)),
        Bad("compress-str", "lengths", lambda: lengths.compress("5", 2)),
        Bad("localize-float-array", "lengths", lambda: lengths.dcp_localize(np.array([5.0]), 2, 0)),
        Bad("localize-float-tensor", "lengths", lambda: lengths.dcp_localize(torch.tensor([5.0]), 2, 0)),
        Bad("expand-list", "seq_lens", lambda: lengths.expand_per_token([5], torch.tensor([0, 1]), 1)),
        Bad("expand-rows-float", "num_rows", lambda: lengths.expand_per_token(torch.tensor([5]), torch.tensor([0, 1]),
                                                                              1.0)),
        Bad("local-to-global-list", "local_pos", lambda: dcp.local_to_global([0, 5], 2, 0)),
        Bad("local-to-global-float", "local_pos", lambda: dcp.local_to_global(torch.tensor([0.5]), 2, 0)),
        Bad("global-to-local-list", "global_pos", lambda: dcp.global_to_local([0, 5], 2, 0)),
        Bad("keys-list", "scores", lambda: dcp.candidate_keys([1.0], torch.tensor([0]))),
        Bad("keys-int-scores", "scores", lambda: dcp.candidate_keys(torch.tensor([1]), torch.tensor([0]))),
        Bad("keys-float-ids", "global_ids", lambda: dcp.candidate_keys(torch.tensor([1.0]), torch.tensor([0.0]))),
        Bad("key-ids-list", "keys", lambda: dcp.key_ids([1])),
        Bad("merge-keys-list", "keys", lambda: dcp.merge_candidate_keys([[[1]]], 1)),
        Bad("merge-scores-list", "scores", lambda: dcp.merge_topk_candidates([1.0], torch.zeros(1, 1, 1), 1)),
    ]


CASES = _layout_cases() + _bound_cases() + _builder_cases() + _step_cases() + _kernel_cases() + _lengths_cases()


@pytest.mark.parametrize("bad", CASES, ids=[b.name for b in CASES])
def test_every_bad_input_is_a_clear_error_from_this_package(bad):
    assert_project_error(bad.call, bad.field)


def test_the_sweep_covers_every_public_entry_point():
    names = {b.name.split("-")[0] for b in CASES}
    assert names >= {"layout", "bound", "shadow", "builder", "build", "step", "run", "write", "quantize",
                     "logits", "topk", "select", "slots", "compress", "ceil", "localize", "merge", "expand",
                     "local", "global", "keys", "key", "workspace", "route"}
    assert len(CASES) > 200


# --------------------------------------------------------------- once silently wrong, now refused
def test_a_k_cache_of_another_page_size_is_refused_not_read():
    """Before: the step inferred the page size from the cache's bytes and returned another top-k."""
    err = assert_project_error(_step_call(k_cache=make_case([100, 30], page=32).k_cache), "k_cache")
    assert "page_size is 64" in str(err)


def test_a_key_of_another_head_dim_is_refused_not_written():
    """Before: head dim 60 into 132-byte rows re-read the cache as pages of 132 and wrote 122 bytes."""
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    k8, ks = kernels.quantize_index_k(torch.randn(3, 60 + 4))
    assert_project_error(lambda: kernels.write_index_k_cache(cache, k8[:, :60].contiguous(), ks,
                                                             torch.tensor([0, 1, 2])), "k_fp8")
    assert cache.eq(0).all()


@pytest.mark.parametrize("what", ["slot_mapping", "row_lens", "block_table"])
def test_float_index_tensors_are_refused_not_cast(what):
    c = _case()
    if what == "slot_mapping":
        k8, ks = kernels.quantize_index_k(torch.randn(2, 128))
        call = lambda: kernels.write_index_k_cache(c.k_cache, k8, ks, torch.tensor([0.9, 1.7]))  # noqa: E731
    elif what == "row_lens":
        call = lambda: kernels.indexer_topk(c.q_fp8, c.weights, c.k_cache, c.block_table,  # noqa: E731
                                            c.row_lens.float() + 0.5, 8)
    else:
        call = lambda: kernels.indexer_topk(c.q_fp8, c.weights, c.k_cache, c.block_table.float(),  # noqa: E731
                                            c.row_lens, 8)
    assert_project_error(call, what)


def test_a_two_element_active_width_is_refused_by_the_top_k_as_by_the_scorer():
    logits = torch.randn(2, 64)
    assert_project_error(lambda: kernels.topk_indices(logits, torch.tensor([64, 64]), 8,
                                                      active_width=torch.tensor([64, 3])), "active_width")


def test_out_of_another_dtype_is_refused_on_the_cpu_route():
    logits = torch.randn(2, 64)
    out = torch.zeros(2, 8)
    assert_project_error(lambda: kernels.topk_indices(logits, torch.tensor([64, 64]), 8, out=out), "out")
    assert out.eq(0).all()


@pytest.mark.parametrize("value", ["no", "yes", 1, 0, None])
def test_capturing_takes_bools_only(value):
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    assert_project_error(lambda: decode_topk_bound(LAY, max_seq_len=5, query_start_loc_cpu=qsl,
                                                   capturing=value), "capturing")


# ------------------------------------------------------------------------------ numpy integers
@pytest.mark.parametrize("np_int", [np.int32, np.int64, np.uint16])
def test_numpy_integers_are_taken_wherever_a_host_int_is(np_int):
    lay = IndexerLayout(backend="b12x", topk=np_int(8), num_heads=np_int(HEADS), page_size=np_int(64),
                        max_model_len=np_int(1024), compress_ratio=np_int(1))
    assert lay == LAY and all(type(getattr(lay, f)) is int for f in ("topk", "page_size", "max_model_len"))
    builder = IndexerMetadataBuilder(lay, max_num_reqs=np_int(4), max_num_tokens=np_int(8),
                                     max_pages_per_req=np_int(16), device="cpu")
    meta = builder.build(_batch(max_seq_len=np_int(200)))
    assert meta.bound.value == 200 and builder.build_for_capture(np_int(2), np_int(2)).num_rows == 2
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    assert decode_topk_bound(lay, max_seq_len=np_int(5), query_start_loc_cpu=qsl).value == 5
    step = IndexerStep(lay, max_rows=np_int(8), max_pages_per_req=np_int(16), device="cpu")
    c = _case()
    got = step.run(meta, c.q_fp8, c.weights, c.k_cache)
    assert got.shape == (2, 8)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kernels.topk_indices(x, torch.tensor([64, 3]), np_int(8)),
                       kernels.topk_indices(x, torch.tensor([64, 3]), 8))
    assert lengths.dcp_localize(np_int(9), np_int(2), np_int(1)) == 4
    assert replace(lay, dcp_world_size=np_int(2), dcp_rank=np_int(1)).dcp_rank == 1
    cfg = kernels.DEFAULT_CONFIG.with_values(fused=np.bool_(False))
    assert cfg.fused is False and type(cfg.fused) is bool
    assert kernels.plan_route(np_int(2), np_int(64), np_int(64), kernels.DeviceInfo(4)) == \
        kernels.plan_route(2, 64, 64, kernels.DeviceInfo(4))
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    assert IndexerTopkWorkspace(np_int(2), np_int(8), np_int(64), "cpu").rows == 2


@pytest.mark.parametrize("flag", [True, np.bool_(True)])
def test_numpy_bools_are_taken_where_a_flag_is_but_never_as_ints(flag):
    assert IndexerMetadataBuilder(LAY, device="cpu", check_bound=flag, **CAPS).check_bound is True
    assert_project_error(lambda: IndexerLayout(backend="b12x", max_model_len=1024, topk=flag), "topk")


# ------------------------------------------------------------------- the sweep, by hypothesis
def _entry_points():
    """Each kernel entry point as (call, {argument: (valid value, kind)}): kind "int", "float" or
    "uint8" for tensors of that family, "host" for a host int, "opt-int" for an optional int tensor."""
    c = _case()
    k8, ks = kernels.quantize_index_k(torch.randn(3, 128))
    logits = torch.randn(2, 64)
    lens = torch.tensor([64, 3], dtype=torch.int32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    return {
        "topk_indices": (kernels.topk_indices, dict(logits=(logits, "float"), row_lens=(lens, "int"), k=(8, "host"),
                                                    active_width=(None, "opt-int"))),
        "indexer_topk": (kernels.indexer_topk, dict(q_fp8=(c.q_fp8, "fp8"), weights=(c.weights, "float"),
                                                    k_cache=(c.k_cache, "uint8"), block_table=(c.block_table, "int"),
                                                    row_lens=(c.row_lens, "int"), k=(8, "host"),
                                                    active_width=(None, "opt-int"))),
        "paged_indexer_logits": (kernels.paged_indexer_logits,
                                 dict(q_fp8=(c.q_fp8, "fp8"), weights=(c.weights, "float"), k_cache=(c.k_cache, "uint8"),
                                      block_table=(c.block_table, "int"), row_lens=(c.row_lens, "int"),
                                      width=(64, "host"))),
        "page_table_slots": (kernels.page_table_slots, dict(indices=(lens.view(2, 1), "int"), page_table=(table, "int"),
                                                            page_size=(64, "host"))),
        "write_index_k_cache": (kernels.write_index_k_cache,
                                dict(k_cache=(torch.zeros(2, 64 * 132, dtype=torch.uint8), "uint8"), k_fp8=(k8, "fp8"),
                                     k_scale=(ks, "float"), slot_mapping=(torch.tensor([0, 1, 2]), "int"))),
    }


def _bad_values(kind: str, valid) -> list:
    common = [[1, 2], np.zeros(2, dtype=np.int32), "x", 3.5]
    if kind == "host":
        return [2.5, "8", True, np.bool_(False), torch.tensor(8), [8], -1, 2**40, None, np.float32(8)]
    if kind == "opt-int":
        return [*common, torch.tensor([64.0]), torch.tensor([64, 1]), torch.tensor([True]),
                torch.tensor([5], device="meta")]
    wrong_dtype = {"int": valid.float(), "float": valid.to(torch.int32), "uint8": valid.to(torch.int32),
                   "fp8": valid.float()}[kind]
    return [*common, None, wrong_dtype, valid.to("meta"), valid.reshape(-1)[:1].reshape(1, 1, 1, 1)]


ENTRY_NAMES = sorted(_entry_points())


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_bad_arguments_to_the_kernels_are_clear_errors(data):
    name = data.draw(st.sampled_from(ENTRY_NAMES))
    fn, args = _entry_points()[name]
    arg = data.draw(st.sampled_from(sorted(args)))
    valid, kind = args[arg]
    bad = data.draw(st.sampled_from(range(len(_bad_values(kind, valid)))))
    call = {a: v for a, (v, _) in args.items()}
    call[arg] = _bad_values(kind, valid)[bad]
    assert_project_error(lambda: fn(**call), arg)
