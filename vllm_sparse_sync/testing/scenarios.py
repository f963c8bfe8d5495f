"""One decode scenario per audit path: a batch plus step functions (builder, then kernels).

Batches come from the audit's own generator (`vllm_sparse_sync.audit`), so the scenarios and
the audit table describe the same paths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..audit import AUDIT_PATHS, AuditPath, _make_case
from ..bounds import SeqLenShadow
from ..layout import IndexerBackend
from ..lengths import dcp_localize
from ..metadata import DecodeBatch, IndexerDecodeMetadata, IndexerMetadataBuilder

NAMES = tuple(p.name for p in AUDIT_PATHS)


def backend_of(name: str) -> str:
    """"b12x" or "deepgemm": the backend whose scenarios `--sync-backend` keeps."""
    path = {p.name: p for p in AUDIT_PATHS}[name]
    return "b12x" if path.layout.backend is IndexerBackend.B12X else "deepgemm"


def params():
    """`pytest.param`s of every scenario name, marked with their backend."""
    import pytest

    return [pytest.param(n, marks=pytest.mark.sync_backend(backend_of(n)), id=n) for n in NAMES]


@dataclass
class Scenario:
    """A decode batch for one audit path, its builder, and indexer inputs on `device`."""

    path: AuditPath
    builder: IndexerMetadataBuilder
    batch: DecodeBatch
    q_fp8: torch.Tensor
    weights: torch.Tensor
    k_cache: torch.Tensor
    base_lens: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def capture(self) -> bool:
        return self.path.capture

    @property
    def watch(self) -> list[torch.Tensor]:
        """The tensors that live on the device in a real runner (the sentinel's watch list)."""
        b = self.builder
        return [self.batch.query_start_loc, self.batch.seq_lens, self.batch.block_table,
                b.row_lens_buffer, b.block_table_buffer, b.active_width_buffer,
                self.q_fp8, self.weights, self.k_cache]

    def build(self) -> IndexerDecodeMetadata:
        """The builder's step: eager `build()` (capture path: `build_for_capture()` first)."""
        if self.capture:
            n = len(self.path.query_lens)
            self.builder.build_for_capture(n, int(self.batch.query_start_loc_cpu[-1]))
        return self.builder.build(self.batch)

    def capture_metadata(self) -> IndexerDecodeMetadata:
        """Metadata as a capture sees it: the builder's buffers with the CAPTURE_STABLE bound."""
        n = len(self.path.query_lens)
        return self.builder.build_for_capture(n, int(self.batch.query_start_loc_cpu[-1]))

    def kernels(self, meta: IndexerDecodeMetadata) -> torch.Tensor:
        """The indexer step on `meta` (Triton on CUDA, the torch reference elsewhere)."""
        lay = self.path.layout
        if lay.backend is IndexerBackend.B12X:
            return kernels.indexer_topk(self.q_fp8, self.weights, self.k_cache, meta.block_table,
                                        meta.row_lens, lay.topk, active_width=meta.active_width)
        return kernels.indexer_topk(self.q_fp8, self.weights, self.k_cache, meta.block_table,
                                    meta.row_lens, lay.topk, width=meta.bound.value)

    def step(self) -> torch.Tensor:
        """Builder, then kernels: one decode step."""
        return self.kernels(self.build())

    def reference(self, meta: IndexerDecodeMetadata | None = None) -> torch.Tensor:
        """The torch reference of the step on CPU copies, with the exact metadata."""
        meta = meta or self.builder.build(self.batch)
        lay = self.path.layout
        rows = meta.row_lens.cpu()
        bt = meta.block_table.cpu()
        from ..kernels import reference as ref

        return ref.indexer_topk(self.q_fp8.cpu(), self.weights.cpu(), self.k_cache.cpu(), bt, rows,
                                lay.topk, width=bt.shape[1] * lay.page_size)

    def set_lengths(self, shrink: int) -> None:
        """Write new request lengths in place (each `shrink` tokens shorter, never below its
        query length) into the device lengths and the CPU shadows; shapes stay the same."""
        q = self.path.query_lens
        new = [max(qi, length - shrink * (i + 1)) for i, (length, qi)
               in enumerate(zip(self.base_lens, q))]
        self.batch.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        shadow = self.batch.shadow
        if shadow is not None and shadow.authoritative:
            shadow.seq_lens_cpu.copy_(torch.tensor(new, dtype=torch.int32))
            if shadow.dcp_local_seq_lens_cpu is not None:
                lay = self.path.layout
                local = [dcp_localize(s, lay.dcp_world_size, lay.dcp_rank, lay.cp_interleave)
                         for s in new]
                shadow.dcp_local_seq_lens_cpu.copy_(torch.tensor(local, dtype=torch.int32))

    def with_legacy_sync(self) -> Scenario:
        """The same scenario with the builder's old `int(seq_lens.max().item())` line."""
        b = self.builder
        legacy = IndexerMetadataBuilder(b.layout, max_num_reqs=b.max_num_reqs,
                                        max_num_tokens=b.max_num_tokens,
                                        max_pages_per_req=b.max_pages_per_req, device=b.device,
                                        legacy_device_sync=True)
        return dataclasses.replace(self, builder=legacy)


def make_scenario(name: str, device: torch.device | str | None = None, *, seed: int = 0
                  ) -> Scenario:
    """Build scenario `name` (one of NAMES) on `device` (default: CUDA if present)."""
    paths = {p.name: p for p in AUDIT_PATHS}
    if name not in paths:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(NAMES)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    path = paths[name]
    lay = path.layout
    gen = torch.Generator().manual_seed(seed)
    case = _make_case(path, device, gen)
    batch = case.batch
    if device.type == "cpu":  # stand-ins for device tensors must not share the host twins
        batch = dataclasses.replace(batch, query_start_loc=batch.query_start_loc.clone(),
                                    seq_lens=batch.seq_lens.clone(),
                                    block_table=batch.block_table.clone())
    if batch.shadow is not None:  # private CPU shadows, so in-place updates stay ours
        s = batch.shadow
        local = s.dcp_local_seq_lens_cpu
        batch = dataclasses.replace(batch, shadow=SeqLenShadow(
            s.seq_lens_cpu.clone(), s.authoritative, None if local is None else local.clone()))
    n_rows = len(case.kernel_rows)
    builder = IndexerMetadataBuilder(lay, max_num_reqs=8, max_num_tokens=max(16, n_rows),
                                     max_pages_per_req=batch.block_table.shape[1], device=device)
    q = torch.randn(n_rows, lay.num_heads, lay.head_dim, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(n_rows, lay.num_heads, generator=gen)
    pages_total = batch.block_table.numel()
    k = torch.randn(pages_total * lay.page_size, lay.head_dim, generator=gen)
    k8, ks = kernels.quantize_index_k(k)
    cache = torch.zeros(pages_total, lay.page_size * (lay.head_dim + 4), dtype=torch.uint8)
    kernels.write_index_k_cache(cache, k8, ks, torch.arange(k.shape[0], dtype=torch.int64))
    return Scenario(path, builder, batch, q.to(device), w.to(device), cache.to(device),
                    base_lens=list(case.true_lens))
