"""Static description of one indexer KV-cache group: backend, compression, DCP, capacities."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from . import checks


class IndexerBackend(str, enum.Enum):
    """Which scorer contract the indexer kernels follow."""

    B12X = "b12x"
    """Live-window scorer: a device ``active_width`` clamp bounds every row."""
    DEEPGEMM = "deepgemm"
    """Host-width scorer (DeepGEMM, FlashInfer CUTLASS): a host width sets the logits width."""


MAX_PAGE_SIZE = 2**20
"""Largest page (kernel rows a page): a slot's page offset takes at most 20 bits."""


@dataclass(frozen=True, kw_only=True)
class IndexerLayout:
    """Indexer layout; lengths it talks about are uncompressed tokens unless named otherwise.

    ``page_size`` counts kernel rows per K-cache page (compressed rows when ``compress_ratio > 1``).
    Sizes are host ints (``numpy.integer`` too, stored as ``int``). Limits: ``max_model_len`` fits
    the int32 device lengths (``2**31 - 1``), and the widest kernel row it allows,
    ``local(ceil(max_model_len / compress_ratio))``, as well as ``topk``, is at most
    ``checks.MAX_KERNEL_ROWS`` (``2**30``); ``head_dim`` is a multiple of 8 (so a K-cache row's
    bytes name one page size); ``page_size`` a power of two up to ``2**20``.
    """

    backend: IndexerBackend
    compress_ratio: int = 1
    dcp_world_size: int = 1
    dcp_rank: int = 0
    cp_interleave: int = 1
    page_size: int = 64
    topk: int = 2048
    num_heads: int = 64
    head_dim: int = 128
    max_model_len: int

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "backend", IndexerBackend(self.backend))
        except ValueError:
            names = ", ".join(b.value for b in IndexerBackend)
            raise ValueError(f"backend: must be one of {names}, got {self.backend!r}") from None
        for name in ("compress_ratio", "dcp_world_size", "cp_interleave", "page_size", "topk",
                     "num_heads", "head_dim", "max_model_len"):
            object.__setattr__(self, name, checks.host_int(name, getattr(self, name), low=1))
        object.__setattr__(self, "dcp_rank", checks.host_int("dcp_rank", self.dcp_rank))
        if not 0 <= self.dcp_rank < self.dcp_world_size:
            raise ValueError(
                f"dcp_rank: must lie in [0, dcp_world_size={self.dcp_world_size}), got {self.dcp_rank}"
            )
        if self.page_size & (self.page_size - 1) or self.page_size > MAX_PAGE_SIZE:
            raise ValueError(f"page_size: must be a power of two (the kernels' tiles) up to "
                             f"{MAX_PAGE_SIZE}, got {self.page_size}")
        if self.head_dim % 8:
            raise ValueError(f"head_dim: must be a multiple of 8, got {self.head_dim}")
        if self.page_size % self.cp_interleave:
            raise ValueError(
                f"cp_interleave: must divide page_size={self.page_size} (a page never splits an "
                f"interleave group), got {self.cp_interleave}"
            )
        if self.compress_ratio > 1 and self.page_size % self.compress_ratio:
            raise ValueError(
                f"page_size: compress_ratio={self.compress_ratio} does not divide page_size={self.page_size}"
            )
        self._check_limits()

    def _check_limits(self) -> None:
        if self.max_model_len > checks.INT32_MAX:
            raise ValueError(f"max_model_len: must fit the int32 device lengths (<= {checks.INT32_MAX}), "
                             f"got {self.max_model_len}")
        if self.topk > checks.MAX_KERNEL_ROWS:
            raise ValueError(f"topk: must be <= {checks.MAX_KERNEL_ROWS} (the kernels' int32 positions), "
                             f"got {self.topk}")
        from .bounds import capture_stable_bound

        widest = capture_stable_bound(self)
        if widest > checks.MAX_KERNEL_ROWS:
            raise ValueError(
                f"max_model_len: {self.max_model_len} tokens give kernel rows of up to {widest} "
                f"(compress_ratio={self.compress_ratio}, dcp_world_size={self.dcp_world_size}), past the "
                f"kernels' limit of {checks.MAX_KERNEL_ROWS} positions a row")

    @property
    def is_compressed(self) -> bool:
        """True when one K row stands for ``compress_ratio`` > 1 tokens."""
        return self.compress_ratio > 1

    @property
    def uses_dcp(self) -> bool:
        """True when decode context parallelism shards the K cache over ranks."""
        return self.dcp_world_size > 1
