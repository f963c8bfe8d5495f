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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels.reference import FP8_DTYPE
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
    table, the token buffer; ``forward(indexer)`` is one decode step (capturable)."""

    def __init__(self, layout: IndexerLayout, shape: ModelShape, *, batch: int, max_len: int,
                 device: torch.device | str, seed: int = 0) -> None:
        if not isinstance(layout, IndexerLayout):
            raise TypeError(f"layout: must be an IndexerLayout, got {type(layout).__name__}")
        if layout.compress_ratio != 1 or layout.uses_dcp:
            raise ValueError("the synthetic model runs uncompressed, single-rank layouts")
        hidden = layout.num_heads * layout.head_dim
        if shape.vocab > hidden:
            raise ValueError(f"vocab: at most hidden={hidden} features, got {shape.vocab}")
        if not 0 < max_len <= layout.max_model_len:
            raise ValueError(f"max_len: must lie in (0, max_model_len={layout.max_model_len}], got {max_len}")
        self.layout, self.shape, self.batch = layout, shape, batch
        self.device = torch.device(device)
        self.hidden = hidden
        self.ffn = ffn_width(hidden, shape.weight_mb)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.weight = (torch.randn(hidden, self.ffn, generator=gen, device=self.device)
                       * hidden ** -0.5).to(torch.bfloat16)
        self.embed = torch.randn(shape.vocab, hidden, generator=gen, device=self.device).to(torch.bfloat16)
        page = layout.page_size
        live_pages = math.ceil(max_len / page)
        self.table_pages = math.ceil(layout.max_model_len / page)
        num_pages = batch * live_pages
        # Pages past a request's live ones wrap onto other real pages: a kernel that reads past
        # the live length (a bound-sensitive one) reads real memory, as a broad scorer would.
        p = torch.arange(self.table_pages, dtype=torch.int64)
        table = torch.stack([(i * live_pages + p) % num_pages for i in range(batch)])
        self.block_table = table.to(torch.int32).to(self.device)
        self.k_caches = [random_k_cache(num_pages, page, layout.head_dim, device=self.device, generator=gen)
                         for _ in range(shape.num_layers)]
        self.first_tokens = (torch.arange(batch, dtype=torch.int64) * 7 % shape.vocab).to(self.device)
        self.tokens = self.first_tokens.clone()
        """The sampled token of each request: the next step's input, written by ``forward``."""

    def reset(self) -> None:
        """Back to the first step's input tokens (device copy, no host read)."""
        self.tokens.copy_(self.first_tokens)

    def forward(self, indexer: IndexerFn) -> None:
        """One decode step: embed the tokens, run every layer, sample into ``self.tokens``."""
        lay, B = self.layout, self.batch
        h = self.embed.index_select(0, self.tokens)
        acc = torch.zeros(B, dtype=torch.int64, device=self.device)
        for layer in range(self.shape.num_layers):
            q = h.view(B, lay.num_heads, lay.head_dim).to(FP8_DTYPE)
            w = h[:, : lay.num_heads].float()
            picked = indexer(layer, q, w)
            s = picked.clamp_min(0).sum(1, dtype=torch.int64)  # order-free: a set's hash
            acc = acc + s * (layer + 1)
            h = h + ((s % HASH_MOD).to(h.dtype) * 0.01).unsqueeze(1)
            h = torch.mm(h, self.weight).view(B, -1, self.hidden).sum(1)
            hf = h.float()
            h = (hf * torch.rsqrt(hf.pow(2).mean(1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        best = h[:, : self.shape.vocab].float().argmax(1)
        self.tokens.copy_((best + acc) % self.shape.vocab)
