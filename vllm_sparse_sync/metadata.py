"""Sync-free decode metadata for the indexer: persistent buffers written by ``build()``.

Host decisions (row count, the top-k bound, validation) come from CPU shadows only, as numpy
views of them; device work writes into buffers allocated once, so every tensor a captured
kernel reads keeps its address from step to step. On CUDA the device work is one Triton
launch; elsewhere a few torch ops. ``build()`` never reads device data on the host, except in
the explicit ``legacy_device_sync`` mode that reproduces the old regression for baselines.

Host-hint contract: ``max_seq_len`` and an authoritative shadow must bound the device lengths
(``seq_lens[i] <= max_seq_len``; an authoritative shadow equals them). A hint below a device
length makes the bound drop tokens silently; ``check_bound=True`` (or
``VLLM_SPARSE_SYNC_DEVICE_CHECKS=1``) adds a device-side assertion, no host sync, that the
bound covers every row, that no device length is negative, and that the device
``query_start_loc`` agrees with its host twin.

Device data the host does not read has a defined meaning: a negative ``seq_lens`` entry gives
rows of length 0 (on every route), and a row never reaches past its width in the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import checks
from .bounds import BoundSource, DecodePlan, DecodeTopkBound, SeqLenShadow, decode_topk_bound, plan_decode
from .kernels.reference import device_checks_enabled
from .layout import IndexerLayout
from .lengths import layout_kernel_lengths


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
        check_bound: bool | None = None,
    ) -> None:
        if not isinstance(layout, IndexerLayout):
            raise TypeError(f"layout: must be an IndexerLayout, got {type(layout).__name__}")
        self.layout = layout
        self.max_num_reqs = checks.host_int("max_num_reqs", max_num_reqs, low=1, high=checks.MAX_ROWS)
        self.max_num_tokens = checks.host_int("max_num_tokens", max_num_tokens, low=1, high=checks.MAX_ROWS)
        self.max_pages_per_req = checks.host_int("max_pages_per_req", max_pages_per_req, low=1)
        if self.max_pages_per_req * layout.page_size > checks.MAX_KERNEL_ROWS:
            raise ValueError(
                f"max_pages_per_req: {self.max_pages_per_req} pages of {layout.page_size} rows exceed the "
                f"kernels' limit of {checks.MAX_KERNEL_ROWS} positions a row")
        self.device = checks.device("device", device, allow_meta=True)  # meta: proves no host reads
        self.legacy_device_sync = checks.flag("legacy_device_sync", legacy_device_sync)
        self.check_bound = (device_checks_enabled() if check_bound is None
                            else checks.flag("check_bound", check_bound))
        kw = dict(dtype=torch.int32, device=self.device)
        self.row_lens_buffer = torch.zeros(max_num_tokens, **kw)
        self.block_table_buffer = torch.full((max_num_tokens, max_pages_per_req), -1, **kw)
        self.active_width_buffer = torch.zeros(1, **kw)
        self._dirty_rows = 0  # rows of row_lens_buffer that may hold a nonzero length
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._token_maps: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self._launch = self._triton_launcher() if self.device.type == "cuda" else None

    @staticmethod
    def _triton_launcher():
        try:
            from .kernels.triton.metadata import launch_decode_rows
        except ImportError:  # no Triton: the torch path, a few more launches
            return None
        return launch_decode_rows

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

    def _validate(self, batch: DecodeBatch, plan: DecodePlan) -> None:
        """Host checks of shapes, dtypes and devices (tensor metadata, never data)."""
        n, num_rows = plan.num_reqs, plan.num_rows
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
        if plan.bound.value > bt.shape[1] * self.layout.page_size:
            raise ValueError(
                f"block_table: {bt.shape[1]} pages of {self.layout.page_size} rows hold fewer than the "
                f"{plan.bound.value} kernel rows that max_seq_len={batch.max_seq_len} allows"
            )

    def _token_map(self, query_lens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Host-built (request, query tokens after it) per decode token, cached per query layout."""
        key = query_lens.tobytes()
        hit = self._token_maps.get(key)
        if hit is None:
            req = np.repeat(np.arange(query_lens.size), query_lens)
            starts = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
            after = (query_lens[req] - 1 - (np.arange(req.size) - starts[req])).astype(np.int32)
            hit = (torch.from_numpy(req), torch.from_numpy(after))
            if len(self._token_maps) > 256:
                self._token_maps.clear()
            self._token_maps[key] = hit
        return hit

    # ---------------------------------------------------------------- device side
    def _write_rows(self, batch: DecodeBatch, plan: DecodePlan, bound: int) -> None:
        """Kernel lengths and block-table rows of every decode token, stale rows zeroed, the
        active width set."""
        lay = self.layout
        n, num_rows = plan.num_reqs, plan.num_rows
        clear_to = self._dirty_rows if self._dirty_rows > num_rows else num_rows
        if self._launch is not None:
            self._launch(batch.seq_lens, batch.query_start_loc, batch.block_table, self.row_lens_buffer,
                         self.block_table_buffer, self.active_width_buffer, num_reqs=n, num_rows=num_rows,
                         clear_to=clear_to, bound=bound, uniform_q=plan.uniform_query_len,
                         ratio=lay.compress_ratio, world=lay.dcp_world_size, rank=lay.dcp_rank,
                         interleave=lay.cp_interleave, max_reqs=self.max_num_reqs)
        else:
            self._write_rows_torch(batch, plan)
            self.active_width_buffer.fill_(bound)
        self._dirty_rows = num_rows

    def _write_rows_torch(self, batch: DecodeBatch, plan: DecodePlan) -> None:
        lay = self.layout
        n, num_rows = plan.num_reqs, plan.num_rows
        if num_rows:
            seq = batch.seq_lens if batch.seq_lens.shape[0] == n else batch.seq_lens[:n]
            if plan.uniform_query_len == 1:  # plain decode: a token per request, its full length
                bt = batch.block_table
                per_token, src = seq.clamp_min(0), bt if bt.shape[0] == n else bt[:n]
            elif self.device.type == "cpu":
                req, after = self._token_map(plan.query_lens)
                per_token = seq.index_select(0, req).clamp_min_(0).sub_(after).clamp_min_(0)
                src = batch.block_table.index_select(0, req)
            else:  # a device without Triton: the token map on the device from query_start_loc
                from .lengths import expand_per_token, token_request_index

                per_token = expand_per_token(seq, batch.query_start_loc, num_rows)
                req = token_request_index(batch.query_start_loc.long(), num_rows).clamp_max(n - 1)
                src = batch.block_table.index_select(0, req)
            rows = layout_kernel_lengths(lay, per_token)
            row_view, table_view = self._row_views(num_rows)
            row_view.copy_(rows)
            pages = batch.block_table.shape[1]
            table_view[:, :pages].copy_(src)
            if pages < self.max_pages_per_req:
                table_view[:, pages:].fill_(-1)
        if self._dirty_rows > num_rows:
            self.row_lens_buffer[num_rows:self._dirty_rows].zero_()

    def _row_views(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = self._views.get(num_rows)
        if views is None:
            views = (self.row_lens_buffer[:num_rows], self.block_table_buffer[:num_rows])
            self._views[num_rows] = views
        return views

    def _meta(self, num_rows: int, bound: DecodeTopkBound) -> IndexerDecodeMetadata:
        row_view, table_view = self._row_views(num_rows)
        return IndexerDecodeMetadata(row_lens=row_view, block_table=table_view,
                                     active_width=self.active_width_buffer, bound=bound, num_rows=num_rows)

    def _legacy_bound(self, num_rows: int) -> DecodeTopkBound:
        seq_lens = self.row_lens_buffer[:num_rows]
        decode_topk_max_seq_len = int(seq_lens.max().item()) if num_rows else 0  # the old host sync
        return DecodeTopkBound(decode_topk_max_seq_len, BoundSource.LEGACY_DEVICE_SYNC)

    def _assert_bound(self, num_rows: int, bound: int) -> None:
        """Device-side assertion (no host sync) that no row exceeds the bound."""
        if num_rows:
            rows = self._row_views(num_rows)[0]
            torch._assert_async(rows.le(bound).all(),
                                f"indexer bound {bound} is below a device row length: a host hint "
                                "(max_seq_len or an authoritative shadow) does not bound seq_lens")

    def _assert_inputs(self, batch: DecodeBatch, plan: DecodePlan) -> None:
        """Device-side assertions (no host sync) that no device ``seq_lens`` entry is negative and
        that the device ``query_start_loc`` agrees with its host twin: entry by entry when every
        request has the same query length, else through its ends and three weighted sums."""
        n = plan.num_reqs
        if n:
            torch._assert_async(batch.seq_lens[:n].ge(0).all(),
                                "seq_lens: a negative device length (its rows are read as length 0)")
        qsl = batch.query_start_loc
        why = "query_start_loc: the device tensor disagrees with its host twin query_start_loc_cpu"
        idx = torch.arange(n + 1, device=qsl.device, dtype=torch.int64)
        if plan.uniform_query_len is not None:
            torch._assert_async(qsl.eq(idx * plan.uniform_query_len).all(), why)
            return
        host = batch.query_start_loc_cpu.numpy().astype(np.int64)
        with np.errstate(over="ignore"):  # int64 wrap-around, as on the device
            sums = [int(host.sum()), int((host * (np.arange(n + 1) + 1)).sum()), int((host * host).sum())]
        d = qsl.long()
        ok = (d[0].eq(0) & d[n].eq(plan.num_rows) & d.sum().eq(sums[0]) & (d * (idx + 1)).sum().eq(sums[1])
              & (d * d).sum().eq(sums[2]))
        torch._assert_async(ok, why)

    # -------------------------------------------------------------------- public
    def build(self, batch: DecodeBatch) -> IndexerDecodeMetadata:
        """Write one decode step's metadata into the persistent buffers and return views of them."""
        if not isinstance(batch, DecodeBatch):
            raise TypeError(f"batch: must be a DecodeBatch, got {type(batch).__name__}")
        plan = plan_decode(self.layout, max_seq_len=batch.max_seq_len,
                           query_start_loc_cpu=batch.query_start_loc_cpu, shadow=batch.shadow)
        self._validate(batch, plan)
        bound = plan.bound
        self._write_rows(batch, plan, bound.value)
        if self.legacy_device_sync:
            bound = self._legacy_bound(plan.num_rows)
            self.active_width_buffer.fill_(bound.value)
        if self.check_bound:
            self._assert_inputs(batch, plan)
            self._assert_bound(plan.num_rows, bound.value)
        return self._meta(plan.num_rows, bound)

    def build_for_capture(self, num_reqs: int, num_tokens: int) -> IndexerDecodeMetadata:
        """Metadata for CUDA-graph capture: static shapes and the CAPTURE_STABLE bound, no shadows."""
        num_reqs = checks.host_int("num_reqs", num_reqs)
        num_tokens = checks.host_int("num_tokens", num_tokens)
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
        self._dirty_rows = 0
        self.active_width_buffer.fill_(bound.value)
        return self._meta(num_tokens, bound)
