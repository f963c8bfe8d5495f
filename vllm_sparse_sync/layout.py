"""Static description of one indexer KV-cache group: backend, compression, DCP, capacities."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class IndexerBackend(str, enum.Enum):
    """Which scorer contract the indexer kernels follow."""

    B12X = "b12x"
    """Live-window scorer: a device ``active_width`` clamp bounds every row."""
    DEEPGEMM = "deepgemm"
    """Host-width scorer (DeepGEMM, FlashInfer CUTLASS): a host width sets the logits width."""


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}: must be positive, got {value}")


@dataclass(frozen=True, kw_only=True)
class IndexerLayout:
    """Indexer layout; lengths it talks about are uncompressed tokens unless named otherwise.

    ``page_size`` counts kernel rows per K-cache page (compressed rows when ``compress_ratio > 1``).
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
            _positive_int(name, getattr(self, name))
        if isinstance(self.dcp_rank, bool) or not isinstance(self.dcp_rank, int):
            raise TypeError(f"dcp_rank: must be an int, got {type(self.dcp_rank).__name__}")
        if not 0 <= self.dcp_rank < self.dcp_world_size:
            raise ValueError(
                f"dcp_rank: must lie in [0, dcp_world_size={self.dcp_world_size}), got {self.dcp_rank}"
            )
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size: must be a power of two (the kernels' tiles), got {self.page_size}")
        if self.page_size % self.cp_interleave:
            raise ValueError(
                f"cp_interleave: must divide page_size={self.page_size} (a page never splits an "
                f"interleave group), got {self.cp_interleave}"
            )
        if self.compress_ratio > 1 and self.page_size % self.compress_ratio:
            raise ValueError(
                f"page_size: compress_ratio={self.compress_ratio} does not divide page_size={self.page_size}"
            )

    @property
    def is_compressed(self) -> bool:
        """True when one K row stands for ``compress_ratio`` > 1 tokens."""
        return self.compress_ratio > 1

    @property
    def uses_dcp(self) -> bool:
        """True when decode context parallelism shards the K cache over ranks."""
        return self.dcp_world_size > 1
