"""Preallocated scratch for the Triton indexer kernels, made outside graph capture.

Sized from capacities (most rows a call, top-k, logits width capacity) so that every route the
planner can choose for a call up to those capacities finds its buffers. A call without a step
plans its own route here (``plan_call``: ``planner.plan_route``, memoized per shape); a step
looks its routes up in its ``StepPlan``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .config import DEFAULT_CONFIG, KernelConfig
from .device import device_info as query_device
from .device import device_sm_count
from . import planner
from .planner import SAMPLE, DeviceInfo, Route, plan_route, topk_algo_for


class IndexerTopkWorkspace:
    """Scratch for ``topk_indices`` / ``indexer_topk`` on one device, sized from capacities.

    ``rows``: most rows per call; ``k``: top-k; ``width``: logits width capacity (0 for a
    top-k-only workspace). Histograms and counters start at zero and every call leaves them at
    zero; the fused step's stall flags stay set until ``clear_stalls()``.
    """

    def __init__(
        self,
        rows: int,
        k: int,
        width: int = 0,
        device: torch.device | str = "cuda",
        *,
        config: KernelConfig = DEFAULT_CONFIG,
        num_sms: int | None = None,
        device_info: DeviceInfo | None = None,
    ) -> None:
        from .. import checks

        try:
            rows, k, width = (checks.host_int(name, v, low=low) for name, v, low in
                              (("rows", rows, 1), ("k", k, 1), ("width", width, 0)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"IndexerTopkWorkspace: {exc}") from None
        if not isinstance(config, KernelConfig):
            raise TypeError(f"config: must be a KernelConfig, got {type(config).__name__}")
        self.device = torch.device(device)
        self.rows, self.k, self.width = rows, k, width
        self.config = config
        self.num_sms = int(num_sms) if num_sms is not None else device_sm_count(str(self.device))
        self.fused_ctas_per_sm = planner.FUSED_CTAS_PER_SM  # lowered if a cooperative launch is refused
        max_pairs = max(self.num_sms * planner.TOPK_CTAS_PER_SM, rows)
        i32 = dict(dtype=torch.int32, device=self.device)
        # radix top-k: per pass and row a histogram, tickets, row state; per chunk pass-3 stats
        self.hist = torch.zeros(4 * rows * 256, **i32)
        self.ticks = torch.zeros(5 * rows, **i32)
        self.state = torch.zeros(2 * rows, **i32)
        self.chunk_sfx = torch.zeros(max_pairs * 256, **i32)
        self.chunk_gt = torch.zeros(max_pairs, **i32)
        # sampled top-k: when some call of at most `rows` rows routes there
        sample = topk_algo_for(rows, config) == SAMPLE
        cap = _sample_cap() if sample else 0
        self.thresh = torch.zeros(rows if sample else 0, **i32)
        self.chunk_cnt = torch.zeros(max_pairs if sample else 0, **i32)
        self.cand_key = torch.zeros(rows * cap, **i32)
        self.cand_pos = torch.zeros(rows * cap, **i32)
        # the unfused step's scores, live columns only
        self.logits = torch.empty(rows if width else 0, width, dtype=torch.float32, device=self.device)
        # fused step, for calls of up to FUSED_MAX_ROWS rows (whatever the capacity): per row two
        # 256-bin histograms, barrier counters, candidates, a stall flag; per program two counts
        fr = min(rows, planner.FUSED_MAX_ROWS) if (config.fused and width) else 0
        slots = self.num_sms * planner.FUSED_CTAS_PER_SM
        self.fused_hist = torch.zeros(fr * 512, **i32)
        self.fused_cand_key = torch.zeros(fr, width if fr else 0, **i32)
        self.fused_cand_pos = torch.zeros(fr, width if fr else 0, **i32)
        self.fused_sync = torch.zeros(fr * 8, **i32)
        self.fused_cnt = torch.zeros(slots * 2 if fr else 0, **i32)
        self.fused_stall = torch.zeros(max(fr, 1), **i32)
        # selected positions written as -1 for want of a KV-cache slot (kernels' slots routes)
        self.unmapped = torch.zeros(1, **i32)
        self._fused_stash: torch.Tensor | None = None
        self._routes: dict[tuple, Route] = {}
        if device_info is not None and not isinstance(device_info, DeviceInfo):
            raise TypeError(f"device_info: must be a DeviceInfo, got {type(device_info).__name__}")
        self._given = device_info
        self._device: DeviceInfo | None = None

    @property
    def fused_rows(self) -> int:
        """Most rows a fused call can have on this workspace (0: no fused buffers)."""
        return self.fused_sync.numel() // 8

    def device_info(self) -> DeviceInfo:
        """What the planner knows of this workspace's device: queried once, or the ``device_info``
        it was made with (to plan as another device would: tests, a benchmark's comparisons); the
        fused programs per SM as the device last accepted them."""
        if self._device is None or self._device.fused_ctas_per_sm != self.fused_ctas_per_sm:
            if self._given is not None:
                self._device = replace(self._given, fused_ctas_per_sm=self.fused_ctas_per_sm)
            else:
                self._device = query_device(self.device, self.config, self.fused_ctas_per_sm, self.num_sms)
            self._routes.clear()
        return self._device

    def plan_call(self, rows: int, width: int, page: int, *, score: bool = True,
                  scorer_fits: bool = True) -> Route:
        """The route of a call made without a step (``planner.plan_route``, memoized per shape)."""
        info = self.device_info()
        key = (rows, width, page, score, scorer_fits)
        route = self._routes.get(key)
        if route is None:
            route = plan_route(rows, width, page, info, self.config, score=score, scorer_fits=scorer_fits)
            if len(self._routes) > 4096:
                self._routes.clear()
            self._routes[key] = route
        return route

    def fused_stash(self, numel: int) -> torch.Tensor:
        """Keys between the interpreter's fused phases (never used on the GPU route)."""
        if self._fused_stash is None or self._fused_stash.numel() < numel:
            self._fused_stash = torch.zeros(numel, dtype=torch.int32, device=self.device)
        return self._fused_stash

    def check(self, rows: int, k: int, width: int = 0) -> None:
        if rows > self.rows:
            raise ValueError(f"workspace: {rows} rows exceed its capacity of {self.rows}")
        if k != self.k:
            raise ValueError(f"workspace: planned for k={self.k}, called with k={k}")
        if width > self.width:
            raise ValueError(f"workspace: logits width {width} exceeds its capacity of {self.width}")

    def stalled_rows(self) -> int:
        """Rows whose fused barriers gave up since the last ``clear_stalls()`` (a host read:
        call it outside the decode loop)."""
        return int(self.fused_stall.sum().item())

    def clear_stalls(self) -> None:
        self.fused_stall.zero_()

    def unmapped_slots(self) -> int:
        """Selected positions written as ``-1`` for want of a KV-cache slot since the last
        ``clear_unmapped()`` (a host read)."""
        return int(self.unmapped.item())

    def clear_unmapped(self) -> None:
        self.unmapped.zero_()


def _sample_cap() -> int:
    from .triton.topk_sample import CAP

    return CAP
