"""Decode scenarios for tests: one per bound path (``vllm_sparse_sync.scenarios``), each a batch,
its builder and its indexer step, with the step functions the harness checks.

The same paths and batch generator feed the audit, so the audit table and these scenarios
describe the same decode paths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..bounds import SeqLenShadow
from ..layout import IndexerBackend
from ..lengths import dcp_localize
from ..metadata import DecodeBatch, IndexerDecodeMetadata, IndexerMetadataBuilder
from ..scenarios import NAMES, DecodePath, make_case, make_step_inputs, path_named
from ..step import IndexerStep

__all__ = ["NAMES", "Scenario", "backend_of", "make_scenario", "params"]


def backend_of(name: str) -> str:
    """"b12x" or "deepgemm": the backend whose scenarios `--sync-backend` keeps."""
    return "b12x" if path_named(name).layout.backend is IndexerBackend.B12X else "deepgemm"


def params():
    """`pytest.param`s of every scenario name, marked with their backend."""
    import pytest

    return [pytest.param(n, marks=pytest.mark.sync_backend(backend_of(n)), id=n) for n in NAMES]


@dataclass
class Scenario:
    """A decode batch for one path, its builder and step, and indexer inputs on `device`."""

    path: DecodePath
    builder: IndexerMetadataBuilder
    step_: IndexerStep
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
        from .watch import device_tensors

        return device_tensors(self.batch, self.builder, self.step_.workspace,
                              [self.q_fp8, self.weights, self.k_cache], strict=True)

    def build(self) -> IndexerDecodeMetadata:
        """The builder's step: eager `build()` (capture path: `build_for_capture()` first)."""
        if self.capture:
            self.capture_metadata()
        return self.builder.build(self.batch)

    def capture_metadata(self) -> IndexerDecodeMetadata:
        """Metadata as a capture sees it: the builder's buffers with the CAPTURE_STABLE bound."""
        n = len(self.path.query_lens)
        return self.builder.build_for_capture(n, int(self.batch.query_start_loc_cpu[-1]))

    def kernels(self, meta: IndexerDecodeMetadata) -> torch.Tensor:
        """The indexer step on `meta` (Triton on CUDA, the torch reference elsewhere)."""
        return self.step_.run(meta, self.q_fp8, self.weights, self.k_cache)

    def step(self) -> torch.Tensor:
        """Builder, then kernels: one decode step."""
        return self.kernels(self.build())

    def reference(self, meta: IndexerDecodeMetadata | None = None) -> torch.Tensor:
        """The torch reference of the step on CPU copies, with the exact metadata."""
        from ..kernels import reference as ref

        meta = meta or self.builder.build(self.batch)
        lay = self.path.layout
        bt = meta.block_table.cpu()
        return ref.indexer_topk(self.q_fp8.cpu(), self.weights.cpu(), self.k_cache.cpu(), bt,
                                meta.row_lens.cpu(), lay.topk, width=bt.shape[1] * lay.page_size)

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
    path = path_named(name)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    case = make_case(path, device, gen)
    batch = case.batch
    if batch.shadow is not None:  # private CPU shadows, so in-place updates stay ours
        s = batch.shadow
        local = s.dcp_local_seq_lens_cpu
        batch = dataclasses.replace(batch, shadow=SeqLenShadow(
            s.seq_lens_cpu.clone(), s.authoritative, None if local is None else local.clone()))
    n_rows = len(case.kernel_rows)
    builder = IndexerMetadataBuilder(path.layout, max_num_reqs=8, max_num_tokens=max(16, n_rows),
                                     max_pages_per_req=batch.block_table.shape[1], device=device)
    inp = make_step_inputs(path, case, device, gen)
    return Scenario(path, builder, IndexerStep.for_builder(builder), batch, inp.q_fp8, inp.weights,
                    inp.k_cache, base_lens=list(case.true_lens))
