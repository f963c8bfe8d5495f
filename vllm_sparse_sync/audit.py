"""`vllm-sparse-sync audit`: every bound path through the builder and the indexer kernels.

For each path it builds several random decode batches, runs ``IndexerMetadataBuilder.build``
and the indexer step with the path's bound, and checks on each: bound >= the true maximum row
length (exact sources equal it), top-k with the bound equals top-k with the exact bound, and
``build()`` read no device data on the host. A path's row reports its worst batch.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from . import kernels
from .bounds import BoundSource, SeqLenShadow
from .layout import IndexerBackend, IndexerLayout
from .lengths import dcp_localize, kernel_lengths, per_token_lengths_host
from .metadata import DecodeBatch, IndexerMetadataBuilder


@dataclass(frozen=True)
class AuditPath:
    """One decode path: a layout plus how the batch's host shadow looks."""

    name: str
    layout: IndexerLayout
    query_lens: tuple[int, ...]
    authoritative: bool = True
    dcp_local_shadow: bool = False
    capture: bool = False
    expected_source: BoundSource = BoundSource.CPU_EXACT


@dataclass(frozen=True)
class AuditRow:
    """One printed row of the audit."""

    path: str
    bound_source: str
    bound: int
    exact_max: int
    widening: float
    topk_match: bool
    host_reads: int
    ok: bool
    detail: str = ""
    batches: int = 1
    seed: int = 0
    """The seed of the batch this row reports (the first failing one, else the widest)."""


def _layout(backend: IndexerBackend, *, ratio: int = 1, world: int = 1, rank: int = 0,
            topk: int = 256) -> IndexerLayout:
    return IndexerLayout(backend=backend, compress_ratio=ratio, dcp_world_size=world, dcp_rank=rank,
                         page_size=64, topk=topk, num_heads=64, head_dim=128, max_model_len=8192)


B12X, DG = IndexerBackend.B12X, IndexerBackend.DEEPGEMM
S = BoundSource

AUDIT_PATHS: tuple[AuditPath, ...] = (
    AuditPath("b12x-compressed", _layout(B12X, ratio=4, topk=128), (1, 1, 1, 1),
              expected_source=S.ACTIVE_WIDTH),
    AuditPath("b12x-uncompressed", _layout(B12X), (1, 1, 1, 1), expected_source=S.CPU_EXACT),
    AuditPath("b12x-uncompressed-dcp2", _layout(B12X, world=2, rank=1), (1, 1, 1),
              dcp_local_shadow=True, expected_source=S.CPU_DCP_LOCAL),
    AuditPath("b12x-uncompressed-async-spec", _layout(B12X), (3, 3, 3), authoritative=False,
              expected_source=S.ACTIVE_WIDTH),
    AuditPath("deepgemm-compressed", _layout(DG, ratio=4, topk=128), (1, 1, 1, 1),
              expected_source=S.METADATA_UPPER_BOUND),
    AuditPath("deepgemm-uncompressed", _layout(DG), (1, 1, 1, 1), expected_source=S.CPU_EXACT),
    AuditPath("deepgemm-uncompressed-async-spec", _layout(DG), (2, 2, 2), authoritative=False,
              expected_source=S.METADATA_UPPER_BOUND),
    AuditPath("mtp-ragged", _layout(B12X), (1, 4, 2, 3), expected_source=S.CPU_EXACT),
    AuditPath("capture", _layout(DG), (1, 1, 1, 1), capture=True,
              expected_source=S.CAPTURE_STABLE),
)

HostReadCounter = Callable[[IndexerMetadataBuilder, DecodeBatch], tuple[int, str]]


@dataclass
class _Case:
    batch: DecodeBatch
    true_lens: list[int]
    kernel_rows: list[int]


def _make_case(path: AuditPath, device: torch.device, gen: torch.Generator) -> _Case:
    """A random decode batch for ``path``; device lengths exact, the shadow per the path."""
    lay = path.layout
    n = len(path.query_lens)
    max_seq_len = int(torch.randint(lay.max_model_len // 4, lay.max_model_len // 2, (1,), generator=gen))
    true_lens = [int(torch.randint(max(q, max_seq_len // 8), max_seq_len + 1, (1,), generator=gen))
                 for q in path.query_lens]
    if path.authoritative:
        true_lens[0] = max_seq_len  # the scheduler's bound is the exact max when exact
    shadow_lens = list(true_lens)
    if not path.authoritative:  # optimistic: every draft accepted
        shadow_lens = [min(t + q - 1, max_seq_len) for t, q in zip(true_lens, path.query_lens)]
        true_lens = [max(s - (q - 1) * (i % 2), q) for i, (s, q)
                     in enumerate(zip(shadow_lens, path.query_lens))]
    starts = [0]
    for q in path.query_lens:
        starts.append(starts[-1] + q)
    qsl_cpu = torch.tensor(starts, dtype=torch.int32)
    per_token = per_token_lengths_host(true_lens, list(path.query_lens))
    rows = [kernel_lengths(t, lay.compress_ratio, lay.dcp_world_size, lay.dcp_rank, lay.cp_interleave)
            for t in per_token]
    bound_rows = kernel_lengths(max_seq_len, lay.compress_ratio, lay.dcp_world_size, lay.dcp_rank,
                                lay.cp_interleave) + 1
    pages = math.ceil(bound_rows / lay.page_size) + 1
    block_table = torch.full((n, pages), -1, dtype=torch.int32)
    perm = torch.randperm(n * pages, generator=gen).to(torch.int32)
    for i, length in enumerate(true_lens):
        live = math.ceil(kernel_lengths(length, lay.compress_ratio, lay.dcp_world_size, lay.dcp_rank,
                                        lay.cp_interleave) / lay.page_size)
        block_table[i, :live] = perm[i * pages: i * pages + live]
    local = None
    if path.dcp_local_shadow:
        local = torch.tensor([dcp_localize(s, lay.dcp_world_size, lay.dcp_rank, lay.cp_interleave)
                              for s in shadow_lens], dtype=torch.int32)
    shadow = SeqLenShadow(torch.tensor(shadow_lens, dtype=torch.int32), path.authoritative, local)
    # copy=True: a CPU stand-in for a device tensor is never its host twin itself
    batch = DecodeBatch(
        query_start_loc=qsl_cpu.to(device, copy=True),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=torch.tensor(true_lens, dtype=torch.int32).to(device, copy=True),
        shadow=shadow,
        block_table=block_table.to(device, copy=True),
        max_seq_len=max_seq_len,
    )
    return _Case(batch, true_lens, rows)


def harness_host_reads(builder: IndexerMetadataBuilder, batch: DecodeBatch) -> tuple[int, str]:
    """Host reads of one ``build()`` seen by the sync harness (all layers that run here)."""
    from .testing.audit_reads import host_reads

    return host_reads(builder, batch)


def _topk(path: AuditPath, inputs: tuple, meta_rows, width: int) -> torch.Tensor:
    q, w, cache, bt = inputs
    lay = path.layout
    if lay.backend is IndexerBackend.B12X:  # live-window clamp on the device
        active = torch.full((1,), width, dtype=torch.int32, device=q.device)
        return kernels.indexer_topk(q, w, cache, bt, meta_rows, lay.topk, active_width=active)
    return kernels.indexer_topk(q, w, cache, bt, meta_rows, lay.topk, width=width)


def audit_batch(path: AuditPath, device: torch.device, *, seed: int = 0,
                host_reads: HostReadCounter = harness_host_reads) -> AuditRow:
    """Run one random batch of one path and check its invariants."""
    gen = torch.Generator().manual_seed(seed)
    case = _make_case(path, device, gen)
    lay = path.layout
    n_rows = len(case.kernel_rows)
    builder = IndexerMetadataBuilder(lay, max_num_reqs=8, max_num_tokens=max(16, n_rows),
                                     max_pages_per_req=case.batch.block_table.shape[1], device=device)
    if path.capture:
        captured = builder.build_for_capture(len(path.query_lens), n_rows)
        bound = captured.bound
    meta = builder.build(case.batch)
    if not path.capture:
        bound = meta.bound
    reads, why = host_reads(builder, case.batch)
    exact = max(case.kernel_rows, default=0)
    problems = []
    if meta.row_lens.cpu().tolist() != case.kernel_rows:
        problems.append("row lengths differ from the independent computation")
    if bound.source is not path.expected_source:
        problems.append(f"source {bound.source.value}, expected {path.expected_source.value}")
    if bound.value < exact:
        problems.append(f"bound {bound.value} below the exact maximum {exact}")
    if bound.source.is_exact and bound.value != exact:
        problems.append("exact source differs from the exact maximum")
    if reads:
        problems.append(f"host read during build(): {why}")
    q = (torch.randn(n_rows, lay.num_heads, lay.head_dim, generator=gen)).to(torch.float8_e4m3fn)
    w = torch.randn(n_rows, lay.num_heads, generator=gen)
    pages_total = case.batch.block_table.numel()
    k = torch.randn(pages_total * lay.page_size, lay.head_dim, generator=gen)
    k8, ks = kernels.quantize_index_k(k)
    cache = torch.zeros(pages_total, lay.page_size * (lay.head_dim + 4), dtype=torch.uint8)
    kernels.write_index_k_cache(cache, k8, ks, torch.arange(k.shape[0], dtype=torch.int64))
    inputs = (q.to(device), w.to(device), cache.to(device), meta.block_table)
    with_bound = _topk(path, inputs, meta.row_lens, bound.value)
    with_exact = _topk(path, inputs, meta.row_lens, exact)
    # the same positions per row; their order follows the kernel's work split, which may follow
    # the width (the fused step's plan), so rows compare as sorted sets
    match = torch.equal(with_bound.cpu().sort(dim=1).values, with_exact.cpu().sort(dim=1).values)
    if not match:
        problems.append("top-k with the bound differs from top-k with the exact bound")
    return AuditRow(path=path.name, bound_source=bound.source.value, bound=bound.value, exact_max=exact,
                    widening=round(bound.value / exact, 3) if exact else math.inf, topk_match=match,
                    host_reads=reads, ok=not problems, detail="; ".join(problems), seed=seed)


def audit_path(path: AuditPath, device: torch.device, *, seed: int = 0, batches: int = 1,
               host_reads: HostReadCounter = harness_host_reads) -> AuditRow:
    """Run `batches` random batches (seeds ``seed, seed + 1, ...``) of one path; the row of the
    first failing batch, else of the widest bound, with the most host reads any batch had."""
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches: must be a positive int, got {batches!r}")
    rows = [audit_batch(path, device, seed=seed + j, host_reads=host_reads) for j in range(batches)]
    failing = [r for r in rows if not r.ok]
    worst = failing[0] if failing else max(rows, key=lambda r: r.widening)
    return replace(worst, batches=batches, host_reads=max(r.host_reads for r in rows))


def default_device() -> torch.device:
    """CUDA when present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_audit(paths: Sequence[AuditPath] = AUDIT_PATHS, device: torch.device | None = None,
              seed: int = 0, host_reads: HostReadCounter = harness_host_reads,
              batches: int = 4) -> list[AuditRow]:
    """Audit every path over `batches` random batches each; returns one row per path."""
    device = device or default_device()
    rows = []
    for i, path in enumerate(paths):
        print(f"[{i + 1}/{len(paths)}] {path.name} ({batches} batches) ...", file=sys.stderr, flush=True)
        rows.append(audit_path(path, device, seed=seed + i * batches, batches=batches,
                               host_reads=host_reads))
    return rows


HEADERS = ("path", "bound source", "bound", "exact max", "widening", "top-k match", "host reads", "seed",
           "result")


def format_table(rows: Sequence[AuditRow]) -> str:
    """A plain-text table of audit rows."""
    cells = [HEADERS] + [
        (r.path, r.bound_source, str(r.bound), str(r.exact_max), f"{r.widening:.3f}x",
         "yes" if r.topk_match else "NO", str(r.host_reads), str(r.seed), "ok" if r.ok else "FAIL")
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(HEADERS))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    failures = [f"{r.path} (seed {r.seed}): {r.detail}" for r in rows if not r.ok]
    return "\n".join(lines + failures)


def rows_to_json(rows: Sequence[AuditRow]) -> str:
    """The rows as a JSON list."""
    return json.dumps([asdict(r) for r in rows], indent=2)
