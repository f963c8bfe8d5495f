"""Sync-free decode metadata for the indexer: persistent buffers written by ``build()``.

Host decisions (row count, the top-k bound, validation) come from CPU shadows only; device
work writes into buffers allocated once, so every tensor a captured kernel reads keeps its
address from step to step. ``build()`` never reads device data on the host, except in the
explicit ``legacy_device_sync`` mode that reproduces the old regression for baselines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bounds import (
    BoundSource,
    DecodeTopkBound,
    SeqLenShadow,
    decode_topk_bound,
    query_lens_from_start_loc,
)
from .layout import IndexerLayout
from .lengths import expand_per_token, kernel_lengths, token_request_index


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step's inputs, as a runner holds them.

    ``seq_lens`` (device, per request, tokens, counting this step's query tokens),
    ``query_start_loc`` (device) and ``query_start_loc_cpu`` (host twin, ``n + 1`` entries),
    ``block_table`` (device int32 ``[n, pages]``, pages in kernel rows: compressed and
    DCP-local where the layout says so), ``max_seq_len`` (host upper bound of request lengths).
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    shadow: SeqLenShadow | None
    block_table: torch.Tensor
    max_seq_len: int


@dataclass(frozen=True)
class IndexerDecodeMetadata:
    """What the indexer kernels read; tensors are views of the builder's persistent buffers.

    ``row_lens`` device int32 ``[num_rows]`` (kernel coordinates), ``block_table`` device int32
    ``[num_rows, max_pages_per_req]`` (one row per decode token), ``active_width`` device int32
    ``[1]``, ``bound`` the host bound, ``num_rows`` the host row count (decode tokens).
    """

    row_lens: torch.Tensor
    block_table: torch.Tensor
    active_width: torch.Tensor
    bound: DecodeTopkBound
    num_rows: int


class IndexerMetadataBuilder:
    """Builds indexer decode metadata into persistent device buffers, without host syncs."""

    def __init__(
        self,
        layout: IndexerLayout,
        *,
        max_num_reqs: int,
        max_num_tokens: int,
        max_pages_per_req: int,
        device: torch.device | str,
        legacy_device_sync: bool = False,
    ) -> None:
        for name, value in (("max_num_reqs", max_num_reqs), ("max_num_tokens", max_num_tokens),
                            ("max_pages_per_req", max_pages_per_req)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        self.layout = layout
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.max_pages_per_req = max_pages_per_req
        self.device = torch.device(device)
        self.legacy_device_sync = legacy_device_sync
        kw = dict(dtype=torch.int32, device=self.device)
        self.row_lens_buffer = torch.zeros(max_num_tokens, **kw)
        self.block_table_buffer = torch.full((max_num_tokens, max_pages_per_req), -1, **kw)
        self.active_width_buffer = torch.zeros(1, **kw)

    # ------------------------------------------------------------------ host side
    @property
    def row_capacity(self) -> int:
        """Most kernel rows one request can hold: the pages of a row times the page size."""
        return self.max_pages_per_req * self.layout.page_size

    def _check_device_tensor(self, name: str, t: object, dims: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device and not (t.device.type == self.device.type and
                                            self.device.index is None):
            raise ValueError(f"{name}: must live on the builder's device {self.device}, got {t.device}")
        if t.dtype != torch.int32 or t.dim() != dims:
            raise ValueError(f"{name}: must be a {dims}-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
        return t

    def _validate(self, batch: DecodeBatch, bound: DecodeTopkBound) -> tuple[list[int], int]:
        """Host checks from CPU data and tensor metadata only; returns (query_lens, num_rows)."""
        query_lens = query_lens_from_start_loc(batch.query_start_loc_cpu)
        n = len(query_lens)
        num_rows = sum(query_lens)
        if n > self.max_num_reqs:
            raise ValueError(f"query_start_loc_cpu: {n} requests exceed max_num_reqs={self.max_num_reqs}")
        if num_rows > self.max_num_tokens:
            raise ValueError(
                f"query_start_loc_cpu: {num_rows} decode tokens exceed max_num_tokens={self.max_num_tokens}"
            )
        qsl = self._check_device_tensor("query_start_loc", batch.query_start_loc, 1)
        if qsl.shape[0] != n + 1:
            raise ValueError(f"query_start_loc: must have n + 1 = {n + 1} entries, got {qsl.shape[0]}")
        seq_lens = self._check_device_tensor("seq_lens", batch.seq_lens, 1)
        if seq_lens.shape[0] < n:
            raise ValueError(f"seq_lens: needs one entry per request ({n}), got {seq_lens.shape[0]}")
        bt = self._check_device_tensor("block_table", batch.block_table, 2)
        if bt.shape[0] < n or bt.shape[1] > self.max_pages_per_req:
            raise ValueError(
                f"block_table: must be [>= {n} requests, <= max_pages_per_req={self.max_pages_per_req}], "
                f"got {tuple(bt.shape)}"
            )
        if bound.value > bt.shape[1] * self.layout.page_size:
            raise ValueError(
                f"block_table: {bt.shape[1]} pages of {self.layout.page_size} rows hold fewer than the "
                f"{bound.value} kernel rows that max_seq_len={batch.max_seq_len} allows"
            )
        return query_lens, num_rows

    # ---------------------------------------------------------------- device side
    def _write_rows(self, batch: DecodeBatch, num_reqs: int) -> None:
        """Per-token kernel lengths and block-table rows for every buffer row (padding -> 0)."""
        lay = self.layout
        cap = self.max_num_tokens
        per_token = expand_per_token(batch.seq_lens[:num_reqs], batch.query_start_loc, cap)
        rows = kernel_lengths(per_token, lay.compress_ratio, lay.dcp_world_size, lay.dcp_rank,
                              lay.cp_interleave)
        self.row_lens_buffer.copy_(rows)
        pages = batch.block_table.shape[1]
        if num_reqs == 0:
            self.block_table_buffer.fill_(-1)
            return
        req = token_request_index(batch.query_start_loc.long(), cap).clamp_max(num_reqs - 1)
        self.block_table_buffer[:, :pages].copy_(batch.block_table.index_select(0, req))
        if pages < self.max_pages_per_req:
            self.block_table_buffer[:, pages:].fill_(-1)

    def _views(self, num_rows: int, bound: DecodeTopkBound) -> IndexerDecodeMetadata:
        return IndexerDecodeMetadata(
            row_lens=self.row_lens_buffer[:num_rows],
            block_table=self.block_table_buffer[:num_rows],
            active_width=self.active_width_buffer,
            bound=bound,
            num_rows=num_rows,
        )

    def _legacy_bound(self, num_rows: int) -> DecodeTopkBound:
        seq_lens = self.row_lens_buffer[:num_rows]
        decode_topk_max_seq_len = int(seq_lens.max().item()) if num_rows else 0  # the old host sync
        return DecodeTopkBound(decode_topk_max_seq_len, BoundSource.LEGACY_DEVICE_SYNC)

    # -------------------------------------------------------------------- public
    def build(self, batch: DecodeBatch) -> IndexerDecodeMetadata:
        """Write one decode step's metadata into the persistent buffers and return views of them."""
        bound = decode_topk_bound(
            self.layout,
            max_seq_len=batch.max_seq_len,
            query_start_loc_cpu=batch.query_start_loc_cpu,
            shadow=batch.shadow,
        )
        query_lens, num_rows = self._validate(batch, bound)
        num_reqs = len(query_lens)
        self._write_rows(batch, num_reqs)
        if self.legacy_device_sync:
            bound = self._legacy_bound(num_rows)
        self.active_width_buffer.fill_(bound.value)
        return self._views(num_rows, bound)

    def build_for_capture(self, num_reqs: int, num_tokens: int) -> IndexerDecodeMetadata:
        """Metadata for CUDA-graph capture: static shapes and the CAPTURE_STABLE bound, no shadows."""
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs: must lie in [0, max_num_reqs={self.max_num_reqs}], got {num_reqs}")
        if not num_reqs <= num_tokens <= self.max_num_tokens:
            raise ValueError(
                f"num_tokens: must lie in [num_reqs={num_reqs}, max_num_tokens={self.max_num_tokens}], "
                f"got {num_tokens}"
            )
        bound = decode_topk_bound(self.layout, max_seq_len=0, query_start_loc_cpu=None,  # type: ignore[arg-type]
                                  capturing=True)
        self.row_lens_buffer.zero_()
        self.active_width_buffer.fill_(bound.value)
        return self._views(num_tokens, bound)

