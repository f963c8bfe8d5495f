"""The route planner, as a table: a pure host function of the call's shape, the configuration and
the device, never of a larger capacity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_sparse_sync.kernels.config import (
    DEFAULT_CONFIG,
    FusedConfig,
    KernelConfig,
    ScorerConfig,
    TopkConfig,
    parse_assignments,
)
from vllm_sparse_sync.kernels.route import (
    FUSED,
    RADIX,
    SAMPLE,
    DeviceInfo,
    Route,
    fused_grid,
    plan_route,
    topk_algo_for,
)
from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

H200 = DeviceInfo(num_sms=132)
K128, K64 = 131072, 65536

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
    ((1, 4096, H200, KernelConfig(fused=FusedConfig(enabled=False))),
     Route(RADIX, 1, score_splits=528, topk_chunks=512)),
    ((1, 4096, H200, KernelConfig(topk=TopkConfig(algo="sample"), fused=FusedConfig(enabled=False))),
     Route(SAMPLE, 1, score_splits=528, topk_chunks=512)),
    ((4, K128, DeviceInfo(132, fused_ctas_per_sm=1), DEFAULT_CONFIG),
     Route(RADIX, 4, score_splits=132, topk_chunks=132)),  # one program per SM: 8192 keys each
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
    assert ws.route(1, K64, 64) == plan_route(1, K64, 64, ws.device_info())
    ws_small = IndexerTopkWorkspace(1, 2048, K128, "cpu", num_sms=132)
    assert ws.route(1, K64, 64) == ws_small.route(1, K64, 64)
    assert ws.route(256, 8192, 64).kind == SAMPLE


@given(rows=st.integers(1, 300), width=st.integers(1, 300_000), sms=st.integers(1, 200),
       ctas=st.sampled_from([1, 2, 4]), page=st.sampled_from([16, 64, 128]))
def test_routes_fit_the_device_and_cover_the_width(rows, width, sms, ctas, page):
    cfg = KernelConfig(fused=FusedConfig(ctas_per_sm=ctas))
    r = plan_route(rows, width, page, DeviceInfo(sms), cfg)
    if r.fused:
        assert rows <= cfg.fused.max_rows
        assert rows * r.fused_parts <= sms * ctas  # every program resident at once
        assert r.fused_parts <= cfg.fused.max_parts
        assert r.fused_parts * r.fused_tiles * page >= width  # every tile has an owner
        # any live length up to the width: contiguous chunks of cdiv(live tiles, parts) fit
        tiles = -(-width // page)
        for live in {1, tiles // 2 + 1, tiles}:
            assert -(-live // r.fused_parts) <= r.fused_tiles
        assert r.fused_tiles * page <= cfg.fused.max_keys
        assert r.fused_tiles & (r.fused_tiles - 1) == 0
    else:
        assert r.kind == topk_algo_for(rows, cfg)
        assert 1 <= r.topk_chunks <= cfg.topk.max_chunks and r.score_splits >= 1


def test_fused_grid_edges():
    assert fused_grid(1, K128, 64, 132, 16384, 128) == (128, 16)
    assert fused_grid(8, 262144, 64, 132, 16384, 128) == (16, 256)
    assert fused_grid(8, 262145, 64, 132, 16384, 128) is None  # 512 tiles of keys per part
    assert fused_grid(200, 4096, 64, 132, 16384, 128) is None  # more rows than resident programs
    assert fused_grid(2, 0, 64, 132, 16384, 128) is None
    assert fused_grid(1, 4096, 48, 132, 16384, 128) is None  # not a power-of-two page


def test_configs_are_checked_and_round_trip():
    cfg = DEFAULT_CONFIG.with_values(**{"topk.algo": "radix", "scorer.precise": False})
    assert cfg.topk.algo == "radix" and cfg.scorer.precise is False
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert parse_assignments("topk.algo=radix, scorer.precise=false,fused.max_rows=4") == {
        "topk.algo": "radix", "scorer.precise": False, "fused.max_rows": 4}
    with pytest.raises(TypeError, match="scorer.precise"):
        ScorerConfig(precise=0)
    with pytest.raises(ValueError, match="topk.algo"):
        TopkConfig(algo="bitonic")
    with pytest.raises(ValueError, match="fused.max_keys"):
        FusedConfig(max_keys=1000)
    with pytest.raises(ValueError, match="config key 'topk.bogus'"):
        DEFAULT_CONFIG.with_values(**{"topk.bogus": 1})
    with pytest.raises(ValueError, match="rows"):
        plan_route(-1, 4096, 64, H200)


CUDA_CFG = KernelConfig(topk=TopkConfig(algo="cuda_radix"))


def test_cuda_radix_route_where_the_device_can_run_it():
    from vllm_sparse_sync.kernels.route import CUDA_RADIX

    h200_nvrtc = DeviceInfo(num_sms=132, cuda_topk=True)
    want = Route(CUDA_RADIX, 64, score_splits=8, topk_chunks=1)
    assert plan_route(64, K64, 64, h200_nvrtc, CUDA_CFG) == want
    assert plan_route(1, 4096, 64, h200_nvrtc, CUDA_CFG, score=False) == Route(CUDA_RADIX, 1, topk_chunks=1)
    # small scored calls still fuse; the CUDA top-k serves the unfused and top-k-only calls
    assert plan_route(1, 4096, 64, h200_nvrtc, CUDA_CFG).kind == FUSED
    # without NVRTC (or on an old GPU) the Triton choice of "auto" runs
    assert plan_route(64, K64, 64, H200, CUDA_CFG) == plan_route(64, K64, 64, H200)
    assert plan_route(4, 4096, 64, H200, CUDA_CFG, score=False).kind == RADIX
    # "auto" takes it from topk.cuda_min_rows rows up (measured faster there on the H200)
    assert plan_route(64, K64, 64, h200_nvrtc).kind == CUDA_RADIX
    assert plan_route(32, K64, 64, h200_nvrtc).kind == CUDA_RADIX
    assert plan_route(31, K64, 64, h200_nvrtc, score=False).kind == RADIX
    assert plan_route(64, K64, 64, H200).kind == SAMPLE
    never = KernelConfig(topk=TopkConfig(cuda_min_rows=0))
    assert plan_route(128, K64, 64, h200_nvrtc, never).kind == SAMPLE


def test_cuda_radix_takes_the_cluster_route_on_sm90():
    from vllm_sparse_sync.kernels.route import CUDA_RADIX

    hopper = DeviceInfo(num_sms=132, cuda_topk=True, cluster_smem=232448 - 1024)
    # "auto": every call, whatever the row count, with the planner's cluster size and capacity
    assert plan_route(64, K64, 64, hopper, score=False) == Route(
        CUDA_RADIX, 64, topk_chunks=2, topk_cluster=2, topk_cap=32768)
    assert plan_route(1, K64, 64, hopper, score=False) == Route(
        CUDA_RADIX, 1, topk_chunks=8, topk_cluster=8, topk_cap=8192)
    assert plan_route(4, 4096, 64, hopper, score=False).kind == CUDA_RADIX
    # scored calls too: the scorer, then the cluster top-k, instead of the fused step (a bound of
    # at most SOLO_MAX keys: one CTA per row)
    assert plan_route(1, 4096, 64, hopper) == Route(
        CUDA_RADIX, 1, score_splits=132 * DEFAULT_CONFIG.scorer.ctas_per_sm, topk_chunks=1, topk_cluster=1,
        topk_cap=4096)
    assert plan_route(1, 32768, 64, hopper).topk_cluster == 8
    assert plan_route(1, 4096, 64, hopper, KernelConfig(topk=TopkConfig(cuda_cluster=False))).kind == FUSED
    assert plan_route(1, 4096, 64, hopper, KernelConfig(topk=TopkConfig(algo="radix"))).kind == FUSED
    # off: the one-CTA kernel from cuda_min_rows rows up, as before sm_90
    off = KernelConfig(topk=TopkConfig(cuda_cluster=False))
    assert plan_route(64, K64, 64, hopper, off, score=False) == Route(CUDA_RADIX, 64, topk_chunks=1)
    assert plan_route(4, 4096, 64, hopper, off, score=False).kind == RADIX
    with pytest.raises(ValueError, match="cuda_cluster"):
        TopkConfig(cuda_cluster=1)
    with pytest.raises(ValueError, match="cuda_lens_early"):
        TopkConfig(cuda_lens_early=1)


def test_cuda_radix_config_checks():
    with pytest.raises(ValueError, match="cuda_threads"):
        TopkConfig(cuda_threads=256)
    with pytest.raises(ValueError, match="cuda_cap"):
        TopkConfig(cuda_cap=10**6)
    assert KernelConfig().with_values(**{"topk.algo": "cuda_radix"}).topk.algo == "cuda_radix"
    with pytest.raises(ValueError, match="cuda_min_rows"):
        TopkConfig(cuda_min_rows=-1)
    assert TopkConfig().scorer_counts is False  # until the GPU measures it
    assert KernelConfig().with_values(**{"topk.scorer_counts": True}).topk.scorer_counts is True
    for bad in (1, "true", None):
        with pytest.raises(ValueError, match="topk.scorer_counts"):
            TopkConfig(scorer_counts=bad)


def test_a_cpu_workspace_says_why_it_has_no_cuda_topk():
    ws = IndexerTopkWorkspace(4, 2048, 0, "cpu", config=CUDA_CFG, num_sms=132)
    ok, why = ws.cuda_topk_status
    assert not ok and "not a CUDA device" in why
    assert ws.route(4, 4096, 1, score=False).kind == RADIX
    assert IndexerTopkWorkspace(4, 2048, 0, "cpu", num_sms=132).cuda_topk_status[0] is False
    info = ws.device_info()
    assert not info.cuda_topk and info.cluster_smem == 0  # no cluster route without the CUDA top-k
    if not torch.cuda.is_available():
        from vllm_sparse_sync.kernels.cuda.topk import cluster_smem_limit

        assert cluster_smem_limit(0) == 0


def test_refused_counts_are_read_cleared_and_make_the_step_unhealthy():
    """``topk.scorer_counts``: each row's refusals word (after its counts) adds up in
    ``counts_refused()``, ``clear_counts_refused()`` zeroes only those words, and a step whose
    workspace has refusals reports ``StepHealth.ok`` False."""
    from vllm_sparse_sync.kernels.cuda.topk import COUNTS_BINS, COUNTS_REFUSED, COUNTS_WORDS
    from vllm_sparse_sync.step import StepHealth

    cfg = KernelConfig().with_values(**{"topk.scorer_counts": True})
    ws = IndexerTopkWorkspace(3, 64, 256, "cpu", config=cfg, num_sms=8)
    assert ws.counts.shape == (3, COUNTS_WORDS) and COUNTS_REFUSED == COUNTS_BINS
    assert ws.counts_refused() == 0
    ws.counts[0, COUNTS_REFUSED] = 2
    ws.counts[2, COUNTS_REFUSED] = 1
    ws.counts[1, 7] = 5  # a count, not a refusal
    assert ws.counts_refused() == 3
    ws.clear_counts_refused()
    assert ws.counts_refused() == 0 and int(ws.counts[1, 7]) == 5
    assert IndexerTopkWorkspace(3, 64, 256, "cpu", num_sms=8).counts_refused() == 0  # no buffer
    assert StepHealth(0).ok and not StepHealth(0, refused_counts=1).ok and not StepHealth(1).ok
