"""A synthetic decode model: N layers, each the project's indexer step (scorer + top-k over the
live lengths) followed by a memory-bound stand-in for the rest of the layer, then a sampled
token per request that feeds the next step.

The stand-in is one bf16 GEMV/GEMM per layer, ``h @ W`` with ``W [hidden, ffn]`` sized from a
stated weight slice (``weight_mb`` per layer): at small batches it reads the whole slice from
HBM, as a decode step reads its weights. The sampled token depends on every layer's top-k set
(an order-free integer hash) and on the hidden state, so token ids match across variants only
if every indexer call selected the same positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..kernels import write_index_k_cache
from ..kernels.reference import FP8_DTYPE, page_bytes
from ..kernels.synth import random_k_cache
from ..layout import IndexerLayout

# (layer, q_fp8 [B, heads, head_dim], weights fp32 [B, heads]) -> int32 [B, k] positions
IndexerFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]

HASH_MOD = 251  # the top-k hash that enters the hidden state


@dataclass(frozen=True)
class ModelShape:
    """The synthetic model: layers, the stand-in's weight slice per layer, the vocabulary."""

    num_layers: int = 61
    """DeepSeek-V3.2 has 61 layers, GLM-5 78."""
    weight_mb: float = 512.0
    """bf16 weights the stand-in reads per layer (MiB), rounded to whole ``hidden`` columns."""
    vocab: int = 4096
    """Sampled from the first ``vocab`` hidden features (at most ``hidden``)."""

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers <= 0:
            raise ValueError(f"num_layers: must be a positive int, got {self.num_layers!r}")
        if not (isinstance(self.weight_mb, (int, float)) and self.weight_mb > 0):
            raise ValueError(f"weight_mb: must be a positive number, got {self.weight_mb!r}")
        if isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab <= 0:
            raise ValueError(f"vocab: must be a positive int, got {self.vocab!r}")


def ffn_width(hidden: int, weight_mb: float) -> int:
    """Columns of the stand-in's weight: ``weight_mb`` of bf16, a whole multiple of ``hidden``."""
    return max(1, round(weight_mb * 2**20 / (2 * hidden * hidden))) * hidden


class SyntheticModel:
    """Device state of the synthetic model for one batch: weights, per-layer K caches, the block
    table, the token buffer; ``forward(indexer, seq_lens)`` is one decode step (capturable).

    Request ``i`` starts with ``start_lens[i]`` cached tokens (random keys) and decodes up to
    ``max_steps`` more; each step writes its token's key into every layer's cache.
    """

    def __init__(
        self,
        layout: IndexerLayout,
        shape: ModelShape,
        *,
        start_lens: Sequence[int],
        max_steps: int,
        device: torch.device | str,
        seed: int = 0,
    ) -> None:
        if not isinstance(layout, IndexerLayout):
            raise TypeError(f"layout: must be an IndexerLayout, got {type(layout).__name__}")
        if layout.compress_ratio != 1 or layout.uses_dcp:
            raise ValueError("the synthetic model runs uncompressed, single-rank layouts")
        hidden = layout.num_heads * layout.head_dim
        if shape.vocab > hidden:
            raise ValueError(f"vocab: at most hidden={hidden} features, got {shape.vocab}")
        batch = len(start_lens)
        max_len = max(start_lens) + max_steps
        if min(start_lens) <= 0 or max_len > layout.max_model_len:
            raise ValueError(
                f"start_lens + max_steps: must lie in (0, max_model_len={layout.max_model_len}], "
                f"got up to {max_len}"
            )
        self.layout, self.shape, self.batch = layout, shape, batch
        self.device = torch.device(device)
        self.hidden = hidden
        self.ffn = ffn_width(hidden, shape.weight_mb)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.weight = (torch.randn(hidden, self.ffn, generator=gen, device=self.device) * hidden**-0.5).to(
            torch.bfloat16
        )
        self.embed = torch.randn(shape.vocab, hidden, generator=gen, device=self.device).to(torch.bfloat16)
        page = layout.page_size
        self.live_pages = math.ceil(max_len / page)
        self.table_pages = math.ceil(layout.max_model_len / page)
        # Every request owns a full table of distinct pages: its first start_lens[i] slots hold
        # random keys, the rest zero keys with zero scales until a step writes them. A kernel
        # that reads past the live length (the bound-sensitive baseline) reads real memory
        # there and scores exactly 0, which never beats a live key: live scores are >= 0
        # (non-negative weights) and ties go to the lower, live position.
        num_pages = batch * self.table_pages
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
        table = perm.view(batch, self.table_pages)
        self.block_table = table.to(torch.int32).to(self.device)
        live = table[:, : self.live_pages].reshape(-1).to(self.device)
        self.k_caches = []
        for _ in range(shape.num_layers):
            cache = torch.zeros(
                num_pages, page_bytes(page, layout.head_dim), dtype=torch.uint8, device=self.device
            )
            cache[live] = random_k_cache(
                live.numel(), page, layout.head_dim, device=self.device, generator=gen
            )  # the slots past each start: zeroed by reset() below
            self.k_caches.append(cache)
        end = self.live_pages * page
        pos = torch.cat([torch.arange(n, end) for n in start_lens])
        req = torch.cat([torch.full((end - n,), i) for i, n in enumerate(start_lens)])
        self._future_slots = (table[req, pos // page] * page + pos % page).to(self.device)
        """Every live-page slot past a request's start: zeroed by ``reset``, written by steps."""
        self._zero_keys = torch.zeros(pos.numel(), layout.head_dim, device=self.device).to(FP8_DTYPE)
        self._zero_scales = torch.zeros(pos.numel(), device=self.device)
        self._unit_scales = torch.ones(batch, device=self.device)
        self.first_tokens = (torch.arange(batch, dtype=torch.int64) * 7 % shape.vocab).to(self.device)
        self.tokens = self.first_tokens.clone()
        """The sampled token of each request: the next step's input, written by ``forward``."""
        self.reset()  # the slots past each start hold zero keys until a step writes them

    def reset(self) -> None:
        """Back to the first step: input tokens, and the keys the steps wrote zeroed (device
        work, no host read)."""
        self.tokens.copy_(self.first_tokens)
        for cache in self.k_caches:
            write_index_k_cache(cache, self._zero_keys, self._zero_scales, self._future_slots)

    def forward(self, indexer: IndexerFn, seq_lens: torch.Tensor) -> None:
        """One decode step: embed the tokens, run every layer (the token's key written to the
        layer's cache at position ``seq_lens - 1``, then the indexer, then the stand-in),
        sample into ``self.tokens``."""
        lay, B = self.layout, self.batch
        page = lay.page_size
        pos = seq_lens.long() - 1
        slots = self.block_table.gather(1, (pos // page).unsqueeze(1)).squeeze(1).long() * page + pos % page
        h = self.embed.index_select(0, self.tokens)
        acc = torch.zeros(B, dtype=torch.int64, device=self.device)
        for layer in range(self.shape.num_layers):
            write_index_k_cache(
                self.k_caches[layer], h[:, : lay.head_dim].to(FP8_DTYPE), self._unit_scales, slots
            )
            q = h.view(B, lay.num_heads, lay.head_dim).to(FP8_DTYPE)
            w = h[:, : lay.num_heads].float().abs()  # non-negative: live scores >= 0
            picked = indexer(layer, q, w)
            s = picked.clamp_min(0).sum(1, dtype=torch.int64)  # order-free: a set's hash
            acc = acc + s * (layer + 1)
            h = h + ((s % HASH_MOD).to(h.dtype) * 0.01).unsqueeze(1)
            h = torch.mm(h, self.weight).view(B, -1, self.hidden).sum(1)
            hf = h.float()
            h = (hf * torch.rsqrt(hf.pow(2).mean(1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        best = h[:, : self.shape.vocab].float().argmax(1)
        self.tokens.copy_((best + acc) % self.shape.vocab)
