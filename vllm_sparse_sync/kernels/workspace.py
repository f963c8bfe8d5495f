"""Preallocated scratch for the Triton indexer kernels, made outside graph capture.

Sized from capacities (most rows per call, top-k, logits width capacity) so that every route
the planner can choose for any call up to those capacities finds its buffers; which route a
call takes is ``route.plan_route``'s decision, from the call's own rows.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from .config import DEFAULT_CONFIG, KernelConfig
from .cuda_topk import COUNTS_REFUSED, COUNTS_WORDS
from .route import CUDA_RADIX, SAMPLE, DeviceInfo, Route, plan_route, topk_algo_for


@cache
def device_sm_count(device: str) -> int:
    """Streaming multiprocessors of a CUDA device (host query, cached); 4 elsewhere (interpreter)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 4


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (programs one after another)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@cache
def cooperative_launch_supported() -> bool:
    """Whether this Triton can launch a grid cooperatively (all programs resident, or an error)."""
    if interpreting():
        return True  # the fused step then runs as phase launches, with no barriers to wait on
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - not an NVIDIA build of Triton
        return False
    return "launch_cooperative_grid" in CUDAOptions.__dataclass_fields__


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
        self.fused_ctas_per_sm = config.fused.ctas_per_sm  # lowered if a cooperative launch is refused
        tc = config.topk
        max_pairs = max(self.num_sms * tc.ctas_per_sm, rows)
        i32 = dict(dtype=torch.int32, device=self.device)
        # radix top-k: per pass and row a histogram, tickets, row state; per chunk pass-3 stats
        self.hist = torch.zeros(4 * rows * 256, **i32)
        self.ticks = torch.zeros(5 * rows, **i32)
        self.state = torch.zeros(2 * rows, **i32)
        self.chunk_sfx = torch.zeros(max_pairs * 256, **i32)
        self.chunk_gt = torch.zeros(max_pairs, **i32)
        # sampled top-k: when some call of at most `rows` rows routes there
        sample = tc.algo == SAMPLE or topk_algo_for(rows, config) == SAMPLE
        self.thresh = torch.zeros(rows if sample else 0, **i32)
        self.chunk_cnt = torch.zeros(max_pairs if sample else 0, **i32)
        self.cand_key = torch.zeros(rows * tc.cap if sample else 0, **i32)
        self.cand_pos = torch.zeros(rows * tc.cap if sample else 0, **i32)
        # the unfused step's scores, live columns only
        self.logits = torch.empty(rows if width else 0, width, dtype=torch.float32, device=self.device)
        # topk.scorer_counts: each row's pass-A counts, written by the CUDA scorer, zeroed by the
        # top-k; then the row's refusals (cuda_topk.COUNTS_REFUSED)
        self.counts = torch.zeros(rows if (tc.scorer_counts and width) else 0, COUNTS_WORDS, **i32)
        # fused step, for calls of up to fused.max_rows rows (whatever the capacity): per row two
        # 256-bin histograms, barrier counters, candidates, a stall flag; per program two counts
        fc = config.fused
        fr = min(rows, fc.max_rows) if (fc.enabled and width) else 0
        slots = self.num_sms * fc.ctas_per_sm
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
        self._cuda_topk: tuple[bool, str] | None = None

    @property
    def fused_rows(self) -> int:
        """Most rows a fused call can have on this workspace (0: no fused buffers)."""
        return self.fused_sync.numel() // 8

    @property
    def cuda_topk_status(self) -> tuple[bool, str]:
        """Whether this workspace's calls may take the CUDA top-k, and why not (asked only when
        the configuration opts in: it imports cuda-bindings)."""
        if self._cuda_topk is None:
            tc = self.config.topk
            auto_cuda = tc.algo == "auto" and (tc.cuda_min_rows > 0 or tc.cuda_cluster)
            if tc.algo != CUDA_RADIX and not auto_cuda:
                self._cuda_topk = (False, f"topk.algo={tc.algo!r} does not use it")
            elif self.device.type != "cuda" or interpreting():
                self._cuda_topk = (False, f"device {self.device} is not a CUDA device")
            else:
                from .cuda_topk import status

                self._cuda_topk = status(self.device)
        return self._cuda_topk

    def device_info(self) -> DeviceInfo:
        cooperative = interpreting() or (self.device.type == "cuda" and cooperative_launch_supported())
        cuda_ok = self.cuda_topk_status[0]
        cluster_smem = 0
        if cuda_ok and self.config.topk.cuda_cluster:
            from .cuda_topk import cluster_smem_limit

            cluster_smem = cluster_smem_limit(self.device.index if self.device.index is not None
                                              else torch.cuda.current_device())
        from .scorer import cuda_scorer_ok

        return DeviceInfo(self.num_sms, cooperative, self.fused_ctas_per_sm, cuda_ok, cluster_smem,
                          cuda_scorer=self.config.scorer.cuda and cuda_scorer_ok(self.device))

    def route(self, rows: int, width: int, page: int, *, score: bool = True) -> Route:
        """The planner's route for a call of ``rows`` rows and width bound ``width`` here
        (memoized: the planner is pure)."""
        key = (rows, width, page, score, self.fused_ctas_per_sm)
        route = self._routes.get(key)
        if route is None:
            route = plan_route(rows, width, page, self.device_info(), self.config, score=score)
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

    def counts_refused(self) -> int:
        """Times a row's top-k refused the scorer's counts since the last ``clear_counts_refused()``:
        counts that summed to the row's live length but disagreed with its keys, a fault of the
        scorer's counts build (the row was counted again: its answer is exact). A host read."""
        return int(self.counts[:, COUNTS_REFUSED].sum().item()) if self.counts.numel() else 0

    def unmapped_slots(self) -> int:
        """Selected positions written as ``-1`` for want of a KV-cache slot since the last
        ``clear_unmapped()`` (a host read)."""
        return int(self.unmapped.item())

    def clear_unmapped(self) -> None:
        self.unmapped.zero_()

    def clear_counts_refused(self) -> None:
        if self.counts.numel():
            self.counts[:, COUNTS_REFUSED].zero_()
