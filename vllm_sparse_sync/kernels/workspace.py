"""Static plan and preallocated scratch for the Triton indexer kernels (made outside graph capture).

Every launch shape here comes from host capacities (row count, SM count, top-k, logits width
capacity), never from live lengths, so a captured graph replays the same schedule for any
lengths or bounds written in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@cache
def device_sm_count(device: str) -> int:
    """Streaming multiprocessors of a CUDA device (host query, cached); 4 elsewhere (interpreter)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 4


@dataclass(frozen=True)
class KernelConfig:
    """Fixed launch configuration (no autotuning) of the scorer and the top-k passes."""

    score_tile: int = 64  # tokens per scorer iteration
    score_warps: int = 4
    score_stages: int = 6  # H200 run 6: 4 -> 6 stages, scorer +13% at B=64, L=64K
    score_ctas_per_sm: int = 4  # scorer programs per SM, split over rows
    precise: int = 1  # fp16 dot of e4m3 values (exact products); 0: fp8 tensor-core accumulation
    score_prefetch: int = 0  # 1: next tile's K in registers instead of Triton's pipeliner
    score_scalar_page: int = 1  # 1: when a tile is one page, load it from one scalar page id
    score_page_pairs: int = 0  # 1: with scalar page ids, two pages per loop iteration
    topk_block: int = 1024  # scores per top-k iteration
    topk_warps: int = 4
    topk_ctas_per_sm: int = 4
    topk_max_chunks: int = 512
    # "radix": 4 histogram passes + emit; "sample": sample, count, compact, resolve; "auto": sample
    # from topk_sample_min_rows rows up (static row count; H200 run 5: radix wins below 32 rows)
    topk_algo: str = "auto"
    topk_sample_min_rows: int = 32
    topk_cap: int = 8192  # "sample": most candidates per row
    topk_sample_above: int = 4096  # "sample": rows longer are sampled, others read whole (H200 run 9)
    topk_samples: int = 2048  # "sample": strided samples per row that set the candidate threshold
    topk_resolve_block: int = 2048  # "sample": elements per iteration of the one-program-per-row resolve
    topk_resolve_warps: int = 8
    # fused step (score and select in one launch) for calls of at most fused_max_rows rows (0: never)
    fused_max_rows: int = 8
    fused_ctas_per_sm: int = 2  # programs per SM; all resident at once (cooperative launch)
    fused_max_parts: int = 128  # programs per row (H200 run 13: more make each row barrier slower)
    # most keys a program holds in registers, else the unfused route (H200 run 14: 8 rows of a 128K
    # capacity, 4096 keys per program, take 95 us fused against 64 us unfused; 2048 keys: 59 us)
    fused_max_keys: int = 2048
    fused_stages: int = 6
    fused_warps: int = 4
    fused_resolve_block: int = 1024  # candidates per iteration of the row's one-program resolve

    def __post_init__(self) -> None:
        if self.topk_algo not in ("radix", "sample", "auto"):
            raise ValueError(f"topk_algo: 'radix', 'sample' or 'auto', got {self.topk_algo!r}")
        if self.topk_cap <= 0 or self.topk_sample_above < 0:
            raise ValueError(f"topk_cap > 0, topk_sample_above >= 0: got {self.topk_cap}, "
                             f"{self.topk_sample_above}")
        if self.fused_max_rows < 0 or self.fused_ctas_per_sm <= 0 or self.fused_max_parts <= 0:
            raise ValueError(f"fused_max_rows >= 0, fused_ctas_per_sm > 0: got {self.fused_max_rows}, "
                             f"{self.fused_ctas_per_sm}")
        for name in ("score_tile", "topk_block", "topk_samples", "topk_resolve_block", "fused_max_keys",
                     "fused_resolve_block"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"{name}: must be a power of two, got {v}")

    def topk_algo_for(self, rows: int) -> str:
        """The top-k algorithm for a call of ``rows`` rows (a static shape, never a live length)."""
        if self.topk_algo != "auto":
            return self.topk_algo
        return "sample" if rows >= self.topk_sample_min_rows else "radix"


DEFAULT_CONFIG = KernelConfig()


class IndexerTopkWorkspace:
    """Scratch for ``topk_indices`` / ``indexer_topk`` on one device, sized from capacities.

    ``rows``: most rows per call; ``k``: top-k; ``width``: logits capacity of the internal scores
    buffer used by ``indexer_topk`` (0 for a top-k-only workspace). Histograms start at zero and
    every call leaves them at zero.
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
        if rows <= 0 or k <= 0 or width < 0:
            raise ValueError(
                f"IndexerTopkWorkspace: need rows > 0, k > 0, width >= 0; got {rows}, {k}, {width}"
            )
        self.device = torch.device(device)
        self.rows, self.k, self.width = int(rows), int(k), int(width)
        self.config = config
        self.num_sms = int(num_sms) if num_sms is not None else device_sm_count(str(self.device))
        max_pairs = max(self.num_sms * config.topk_ctas_per_sm, self.rows)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.hist = torch.zeros(4 * self.rows * 256, **i32)
        self.ticks = torch.zeros(5 * self.rows, **i32)  # per pass and row, self-resetting
        self.state = torch.zeros(2 * self.rows, **i32)  # per row: key prefix, ties still needed
        self.chunk_sfx = torch.zeros(max_pairs * 256, **i32)
        self.chunk_gt = torch.zeros(max_pairs, **i32)
        sample = config.topk_algo_for(self.rows) == "sample"
        self.thresh = torch.zeros(self.rows if sample else 0, **i32)  # per row: candidate key threshold
        self.chunk_cnt = torch.zeros(max_pairs if sample else 0, **i32)  # per chunk: candidates
        cand = self.rows * config.topk_cap if sample else 0
        self.cand_key = torch.zeros(cand, **i32)  # per row: candidate keys and positions, in position order
        self.cand_pos = torch.zeros(cand, **i32)
        self.logits = torch.empty(
            self.rows if width else 0, self.width, dtype=torch.float32, device=self.device
        )
        # fused step: per row two 256-bin histograms, barrier counters, candidates; per program two
        # counts
        fused = bool(width) and self.rows <= config.fused_max_rows
        fr = self.rows if fused else 0
        self.fused_hist = torch.zeros(fr * 512, **i32)
        self.fused_cand_key = torch.zeros(fr, self.width if fused else 0, **i32)
        self.fused_cand_pos = torch.zeros(fr, self.width if fused else 0, **i32)
        self.fused_sync = torch.zeros(fr * 8, **i32)
        self.fused_cnt = torch.zeros(fr * self.num_sms * config.fused_ctas_per_sm * 2, **i32)
        self.fused_stall = torch.zeros(1, **i32)
        self.fused_ctas_per_sm = config.fused_ctas_per_sm  # lowered if a cooperative launch is refused
        self._fused_stash: torch.Tensor | None = None

    @property
    def topk_block(self) -> int:
        return self.config.topk_block

    @property
    def topk_warps(self) -> int:
        return self.config.topk_warps

    def topk_chunks(self, rows: int) -> int:
        """Programs per row of the top-k passes, from the static row count."""
        c = self.num_sms * self.config.topk_ctas_per_sm // max(rows, 1)
        return max(1, min(self.config.topk_max_chunks, c))

    def score_splits(self, rows: int) -> int:
        """Programs per row of the scorer, from the static row count."""
        return max(1, self.num_sms * self.config.score_ctas_per_sm // max(rows, 1))

    def fused_plan(self, rows: int, page: int) -> tuple[int, int] | None:
        """``(parts per row, tiles per part)`` of the fused step for ``rows`` rows, or ``None``."""
        from .triton_fused import fused_plan

        if not self.fused_hist.numel() or rows > self.config.fused_max_rows:
            return None
        return fused_plan(rows, self.width, page, self.num_sms, self.fused_ctas_per_sm,
                          self.config.fused_max_keys, self.config.fused_max_parts)

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
