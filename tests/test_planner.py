"""The planner: ``plan_route`` as a table (a pure host function of the call's shape, the
configuration and the device, never of a larger capacity), ``StepPlan`` as the step's frozen
table, and a run that takes no route decision."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_sparse_sync.kernels import planner
from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG, KernelConfig, parse_config
from vllm_sparse_sync.kernels.planner import (
    CUDA_RADIX,
    FUSED,
    RADIX,
    SAMPLE,
    DeviceInfo,
    Route,
    fused_grid,
    plan_route,
    plan_step,
    topk_algo_for,
    width_bands,
)
from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

H200 = DeviceInfo(num_sms=132)
K128, K64 = 131072, 65536
HOPPER = DeviceInfo(num_sms=132, cuda_topk=True, cluster_smem=232448 - 1536, smem_per_sm=233472, cluster16=True,
                    cuda_scorer=True)

# (rows, width, device, config) -> route
TABLE = [
    ((1, 4096, H200, DEFAULT_CONFIG), Route(FUSED, 1, fused_parts=64, fused_tiles=1)),
    ((1, K128, H200, DEFAULT_CONFIG), Route(FUSED, 1, fused_parts=128, fused_tiles=16)),
    ((8, K64, H200, DEFAULT_CONFIG), Route(FUSED, 8, fused_parts=32, fused_tiles=32)),
    ((8, K128, H200, DEFAULT_CONFIG), Route(RADIX, 8, score_splits=66, topk_chunks=66)),  # 4096 keys
    ((9, 4096, H200, DEFAULT_CONFIG), Route(RADIX, 9, score_splits=58, topk_chunks=58)),
    ((31, K64, H200, DEFAULT_CONFIG), Route(RADIX, 31, score_splits=17, topk_chunks=17)),
    ((32, K64, H200, DEFAULT_CONFIG), Route(SAMPLE, 32, score_splits=16, topk_chunks=16)),
    ((256, 8192, H200, DEFAULT_CONFIG), Route(SAMPLE, 256, score_splits=2, topk_chunks=2)),
    ((1, 4096, DeviceInfo(132, cooperative=False), DEFAULT_CONFIG),
     Route(RADIX, 1, score_splits=528, topk_chunks=512)),
    ((1, 4096, H200, KernelConfig(fused=False)), Route(RADIX, 1, score_splits=528, topk_chunks=512)),
    ((1, 4096, H200, KernelConfig(topk="sample", fused=False)), Route(SAMPLE, 1, score_splits=528, topk_chunks=512)),
    ((4, K128, DeviceInfo(132, fused_ctas_per_sm=1), DEFAULT_CONFIG),
     Route(RADIX, 4, score_splits=132, topk_chunks=132)),  # one program an SM: 8192 keys each
    ((0, 4096, H200, DEFAULT_CONFIG), Route(RADIX, 0, score_splits=528, topk_chunks=512)),
    ((2, 0, H200, DEFAULT_CONFIG), Route(RADIX, 2, score_splits=264, topk_chunks=264)),
]


@pytest.mark.parametrize("args, want", TABLE, ids=[f"{a[0]}x{a[1]}" for a, _ in TABLE])
def test_route_table(args, want):
    rows, width, device, config = args
    assert plan_route(rows, width, 64, device, config) == want


def test_topk_only_calls_never_fuse():
    assert plan_route(1, 4096, 64, H200, score=False) == Route(RADIX, 1, topk_chunks=512)
    assert plan_route(40, 4096, 64, H200, score=False).kind == SAMPLE


def test_a_small_call_on_a_large_workspace_takes_the_small_route():
    ws = IndexerTopkWorkspace(256, 2048, K128, "cpu", num_sms=132)
    assert ws.fused_rows == 8
    assert ws.plan_call(1, K64, 64) == plan_route(1, K64, 64, ws.device_info())
    ws_small = IndexerTopkWorkspace(1, 2048, K128, "cpu", num_sms=132)
    assert ws.plan_call(1, K64, 64) == ws_small.plan_call(1, K64, 64)
    assert ws.plan_call(256, 8192, 64).kind == SAMPLE


@given(rows=st.integers(1, 300), width=st.integers(1, 300_000), sms=st.integers(1, 200),
       ctas=st.sampled_from([1, 2, 4]), page=st.sampled_from([16, 64, 128]))
def test_routes_fit_the_device_and_cover_the_width(rows, width, sms, ctas, page):
    r = plan_route(rows, width, page, DeviceInfo(sms, fused_ctas_per_sm=ctas))
    if r.fused:
        assert rows <= planner.FUSED_MAX_ROWS
        assert rows * r.fused_parts <= sms * ctas  # every program resident at once
        assert r.fused_parts <= planner.FUSED_MAX_PARTS
        assert r.fused_parts * r.fused_tiles * page >= width  # every tile has an owner
        # any live length up to the width: contiguous chunks of cdiv(live tiles, parts) fit
        tiles = -(-width // page)
        for live in {1, tiles // 2 + 1, tiles}:
            assert -(-live // r.fused_parts) <= r.fused_tiles
        assert r.fused_tiles * page <= planner.FUSED_MAX_KEYS
        assert r.fused_tiles & (r.fused_tiles - 1) == 0
    else:
        assert r.kind == topk_algo_for(rows, DEFAULT_CONFIG)
        assert 1 <= r.topk_chunks <= planner.TOPK_MAX_CHUNKS and r.score_splits >= 1


def test_fused_grid_edges():
    assert fused_grid(1, K128, 64, 132, 16384, 128) == (128, 16)
    assert fused_grid(8, 262144, 64, 132, 16384, 128) == (16, 256)
    assert fused_grid(8, 262145, 64, 132, 16384, 128) is None  # 512 tiles of keys a part
    assert fused_grid(200, 4096, 64, 132, 16384, 128) is None  # more rows than resident programs
    assert fused_grid(2, 0, 64, 132, 16384, 128) is None
    assert fused_grid(1, 4096, 48, 132, 16384, 128) is None  # not a power-of-two page


def test_the_configuration_is_five_checked_choices():
    assert len(KernelConfig.__dataclass_fields__) <= 12
    cfg = DEFAULT_CONFIG.with_values(topk="radix", precise=False)
    assert (cfg.topk, cfg.precise) == ("radix", False)
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert parse_config("topk=radix, precise=false") == cfg
    for bad, match in (({"precise": 0}, "config.precise"), ({"topk": "bitonic"}, "config.topk"),
                       ({"pdl": "no"}, "config.pdl")):
        with pytest.raises((TypeError, ValueError), match=match):
            KernelConfig(**bad)
    with pytest.raises(ValueError, match="unknown"):
        DEFAULT_CONFIG.with_values(bogus=1)
    with pytest.raises(ValueError, match="unknown field 'scorer.precise'"):
        parse_config("scorer.precise=false")
    with pytest.raises(ValueError, match="takes true or false"):
        parse_config("cuda=1")
    with pytest.raises(ValueError, match="rows"):
        plan_route(-1, 4096, 64, H200)


def test_the_cuda_top_k_where_the_device_can_run_it():
    nvrtc = DeviceInfo(num_sms=132, cuda_topk=True)  # before sm_90: no cluster route
    assert plan_route(64, K64, 64, nvrtc, KernelConfig(topk="cuda")) == Route(CUDA_RADIX, 64, score_splits=8,
                                                                              topk_chunks=1)
    assert plan_route(1, 4096, 64, nvrtc, KernelConfig(topk="cuda"), score=False) == Route(
        CUDA_RADIX, 1, topk_chunks=1)
    # small scored calls still fuse there; the CUDA top-k serves the unfused and top-k-only calls
    assert plan_route(1, 4096, 64, nvrtc, KernelConfig(topk="cuda")).kind == FUSED
    # without NVRTC the Triton choice runs, pinned or not
    assert plan_route(64, K64, 64, H200, KernelConfig(topk="cuda")) == plan_route(64, K64, 64, H200)
    # "auto" takes it from CUDA_TOPK_MIN_ROWS rows up; cuda=False never
    assert plan_route(planner.CUDA_TOPK_MIN_ROWS, K64, 64, nvrtc).kind == CUDA_RADIX
    assert plan_route(planner.CUDA_TOPK_MIN_ROWS - 1, K64, 64, nvrtc, score=False).kind == RADIX
    assert plan_route(64, K64, 64, nvrtc, KernelConfig(cuda=False)).kind == SAMPLE


def test_the_cluster_route_on_sm90_resolves_its_launch():
    # every call, whatever its rows, with the cluster's size, capacity, threads and shared memory
    r = plan_route(64, K64, 64, HOPPER, score=False)
    assert (r.kind, r.topk_cluster, r.topk_cap, r.topk_threads) == (CUDA_RADIX, 2, 32768, 1024)
    assert r.topk_smem >= 4 * r.topk_cap
    one = plan_route(1, 4096, 64, HOPPER)
    assert (one.kind, one.scorer, one.topk_cluster, one.topk_threads, one.topk_cap) == (CUDA_RADIX, "cuda", 1, 512,
                                                                                      4096)
    assert plan_route(1, 32768, 64, HOPPER).topk_cluster == 8
    assert plan_route(1, K128, 64, HOPPER).topk_cluster == 16
    # a device that cannot hold 16-CTA clusters runs that plan as 8
    assert plan_route(1, K128, 64, DeviceInfo(**{**HOPPER.__dict__, "cluster16": False})).topk_cluster == 8
    # pinned to a Triton algorithm, or without the CUDA routes: the fused step at one row
    assert plan_route(1, 4096, 64, HOPPER, KernelConfig(topk="radix")).kind == FUSED
    assert plan_route(1, 4096, 64, HOPPER, KernelConfig(cuda=False)).kind == FUSED


def test_the_scorer_thresholds_are_the_planners_constants(monkeypatch):
    assert plan_route(planner.CUDA_SCORER_MIN_ROWS, 2048, 64, HOPPER, score=True).scorer == "cuda"
    assert plan_route(planner.CUDA_SCORER_MIN_ROWS - 1, 2048, 64, HOPPER).scorer == "triton"
    assert plan_route(2, planner.CUDA_SCORER_MIN_WIDTH, 64, HOPPER).scorer == "cuda"
    e4m3 = KernelConfig(precise=False)
    assert plan_route(1, planner.CUDA_FP8_SCORER_MIN_TOKENS, 64, HOPPER, e4m3).scorer == "cuda"
    assert plan_route(1, planner.CUDA_FP8_SCORER_MIN_TOKENS - 64, 64, HOPPER, e4m3).scorer == "triton"
    assert plan_route(64, K64, 32, HOPPER).scorer == "triton"  # pages of another size
    assert plan_route(64, K64, 64, HOPPER, scorer_fits=False).scorer == "triton"
    monkeypatch.setattr(planner, "CUDA_SCORER_MIN_WIDTH", 1 << 40)
    assert plan_route(2, K64, 64, HOPPER).scorer == "triton"  # read at plan time


def test_a_cpu_workspace_has_no_cuda_route():
    ws = IndexerTopkWorkspace(4, 2048, 0, "cpu", config=KernelConfig(topk="cuda"), num_sms=132)
    info = ws.device_info()
    assert not info.cuda_topk and info.cluster_smem == 0 and not info.cuda_scorer
    assert ws.plan_call(4, 4096, 1, score=False).kind == RADIX
    if not torch.cuda.is_available():
        from vllm_sparse_sync.kernels.cuda.topk import cluster_smem_limit

        assert cluster_smem_limit(0) == 0


def test_width_bands_cover_every_width_up_to_the_capacity():
    assert width_bands(4096, 64) == (64, 128, 256, 512, 1024, 2048, 4096)
    assert width_bands(5000, 64)[-2:] == (4096, 5000)
    assert width_bands(32, 64) == (32,)


@given(max_rows=st.integers(1, 40), capacity=st.integers(1, 200_000), rows=st.integers(1, 40),
       width=st.integers(0, 200_000), sms=st.integers(1, 140))
def test_a_step_plan_holds_a_route_that_serves_every_call_it_admits(max_rows, capacity, rows, width, sms):
    """The planned route of a call is the planner's route for its band's upper edge: wide enough
    for the call (a plan for a wider bound serves a narrower one), and the same rows."""
    device = DeviceInfo(num_sms=sms, cuda_topk=True, cluster_smem=232448 - 1536, smem_per_sm=233472)
    plan = plan_step(max_rows, width_bands(capacity), 64, device)
    if rows > max_rows or width > capacity:
        with pytest.raises(ValueError, match="outside this plan"):
            plan.route(rows, width)
        return
    route = plan.route(rows, width)
    edge = next(w for w in plan.widths if w >= width)
    assert route == plan_route(rows, edge, 64, device)
    assert route.rows == rows
    if route.fused:
        assert route.fused_parts * route.fused_tiles * 64 >= width
    if route.topk_cluster:
        assert route.topk_cap * route.topk_cluster >= min(width, 16384) or route.topk_cap >= 4


def test_the_plan_prints_as_a_table():
    plan = plan_step(256, width_bands(K128), 64, HOPPER)
    text = repr(plan)
    assert text.startswith("StepPlan: 132 SMs, page 64")
    lines = text.splitlines()
    assert lines[1].split()[:3] == ["width", "<=", "rows"]
    assert any("cuda top-k topk_cluster_c16_t1024: 16 CTAs a row" in line for line in lines)
    assert len(lines) < 120  # runs of row counts that take the same kernels share a line
    assert plan.max_rows == 256 and plan.max_width == K128
