"""Run a planned route (``planner.Route``) on the device: no decision here, only launches.

The scorer kernel is the route's; the top-k's launcher comes from ``TOPK_LAUNCHERS`` by the route's
kind. Every kernel reads the live lengths on the device and nothing is read back, so a run is
captured in a CUDA graph once its kernels are compiled (one eager call first).
"""

from __future__ import annotations

import importlib

import torch

from .planner import CUDA, CUDA_RADIX, RADIX, SAMPLE, Route

_MODULES: dict[str, object] = {}


def _function(path: str):
    """``"module:name"`` (relative to this package); the module is imported on first use and kept
    (the launch modules import Triton or cuda-bindings, which the CPU route never loads), the name
    looked up on it at each call."""
    module, _, name = path.partition(":")
    mod = _MODULES.get(module)
    if mod is None:
        mod = _MODULES[module] = importlib.import_module(module, __package__)
    return getattr(mod, name)


class CooperativeLaunchRefused(RuntimeError):
    """The device would not make every program of the fused step's grid resident: plan again with
    fewer programs per SM (the caller's warm-up call does, once)."""


def launch_scorer(route: Route, q_fp8, weights, k_cache, block_table, row_lens, active, logits, *,
                  page: int, width: int, precise: bool, pdl: bool) -> None:
    """Scores of the live columns into ``logits`` by the route's scorer kernel."""
    if route.scorer == CUDA:
        _function(".cuda.scorer:launch_cuda_score")(q_fp8, weights, k_cache, block_table, row_lens, active, logits, page_size=page,
                          sel_width=width, fill_width=0, splits=route.score_splits, precise=precise, pdl=pdl)
        return
    _function(".triton.scorer:launch_score")(
        q_fp8, weights, k_cache, block_table, row_lens, active, logits, page_size=page, sel_width=width,
        fill_width=0, splits=route.score_splits, precise=precise, launch_dependents=pdl)


def _cluster(route, logits, row_lens, active, ws, out, k, width, nan_low, after_scorer, pages, unmapped):
    plan = _function(".cuda.topk:ClusterPlan")(
        route.topk_cluster, route.topk_cap,
        _function(".cuda.topk:cluster_smem_bytes")(route.topk_cap, route.topk_cluster, route.topk_threads),
        route.topk_threads)
    _function(".cuda.topk:launch_cuda_topk_cluster")(logits, logits.stride(0), row_lens, active, out, k, width, nan_low=nan_low,
                             plan=plan, smem=route.topk_smem, pdl=ws.config.pdl, lens_early=after_scorer,
                             page_table=None if pages is None else pages[0],
                             page_bits=0 if pages is None else pages[1],
                             unmapped=None if pages is None else unmapped)
    return True  # slots written by the same launch


def _one_cta(route, logits, row_lens, active, ws, out, k, width, nan_low, after_scorer, pages, unmapped):
    _function(".cuda.topk:launch_cuda_topk")(logits, logits.stride(0), row_lens, active, out, k, width, nan_low=nan_low)
    return False


def _radix(route, logits, row_lens, active, ws, out, k, width, nan_low, after_scorer, pages, unmapped):
    _function(".triton.topk_radix:launch_radix_topk")(logits, logits.stride(0), row_lens, active, ws, out, k, width, route.topk_chunks, nan_low)
    return False


def _sample(route, logits, row_lens, active, ws, out, k, width, nan_low, after_scorer, pages, unmapped):
    _function(".triton.topk_sample:launch_sample_topk")(logits, logits.stride(0), row_lens, active, ws, out, k, width, route.topk_chunks, nan_low)
    return False


TOPK_LAUNCHERS = {
    (CUDA_RADIX, True): _cluster,
    (CUDA_RADIX, False): _one_cta,
    (RADIX, False): _radix,
    (SAMPLE, False): _sample,
}
"""the top-k launcher of each unfused route: (kind, cluster route?) -> launcher; a launcher
returns whether it wrote the slots itself"""


def launch_slots(out: torch.Tensor, pages: tuple | None, unmapped: torch.Tensor | None) -> None:
    """``out``'s positions rewritten as KV-cache slots by their own launch, where ``pages`` (table,
    log2 page size) is given; positions without a slot add to ``unmapped``."""
    if pages is not None:
        _function(".triton.slots:launch_page_slots")(out, *pages, unmapped)


def launch_topk(route: Route, logits, row_lens, active, ws, out, k: int, width: int, *, nan_low: bool,
                after_scorer: bool = False, pages: tuple | None = None,
                unmapped: torch.Tensor | None = None) -> None:
    """The route's top-k of ``logits`` into ``out`` (``nan_low=False`` for scores from the scorer:
    NaN already negative; ``after_scorer``: the stream's previous kernel is this step's scorer,
    which writes neither ``row_lens`` nor ``active``), then slots where ``pages`` asks for them."""
    launcher = TOPK_LAUNCHERS[route.kind, route.topk_cluster > 0]
    if not launcher(route, logits, row_lens, active, ws, out, k, width, nan_low, after_scorer, pages, unmapped):
        launch_slots(out, pages, unmapped)


def run_step(route: Route, ws, q_fp8, weights, k_cache, block_table, row_lens, active, out, *, k: int,
             page: int, width: int, pages: tuple | None = None, unmapped: torch.Tensor | None = None) -> None:
    """Score, then select, by ``route`` (fused: one launch) into ``out``; ``ws``: the workspace."""
    if route.fused:
        try:
            _function(".triton.fused:launch_fused_step")(q_fp8, weights, k_cache, block_table, row_lens, active, out, ws, k=k, page=page,
                              sel_width=width, route=route)
        except RuntimeError as exc:
            if "cooperative" in str(exc).lower() and ws.fused_ctas_per_sm > 1:
                raise CooperativeLaunchRefused(str(exc)) from exc
            raise
        launch_slots(out, pages, unmapped)
        return
    launch_scorer(route, q_fp8, weights, k_cache, block_table, row_lens, active, ws.logits, page=page,
                  width=width, precise=ws.config.precise, pdl=ws.config.pdl)
    launch_topk(route, ws.logits, row_lens, active, ws, out, k, width, nan_low=False, after_scorer=True,
                pages=pages, unmapped=unmapped)
