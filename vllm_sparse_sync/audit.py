"""`vllm-sparse-sync audit`: every bound path through the builder and the indexer kernels.

For each path it builds several random decode batches, runs ``IndexerMetadataBuilder.build``
and the indexer step with the path's bound, and checks on each: bound >= the true maximum row
length (exact sources equal it), top-k with the bound equals top-k with the exact bound, and
``build()`` read no device data on the host. A path's row reports its worst batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from .bounds import DecodeTopkBound
from .metadata import DecodeBatch, IndexerMetadataBuilder
from .scenarios import PATHS, DecodePath, make_case, make_step_inputs
from .step import IndexerStep
from .table import text_table

AuditPath = DecodePath  # the audit's name for a scenario
AUDIT_PATHS = PATHS


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


HostReadCounter = Callable[[IndexerMetadataBuilder, DecodeBatch], tuple[int, str]]


def harness_host_reads(builder: IndexerMetadataBuilder, batch: DecodeBatch) -> tuple[int, str]:
    """Host reads of one ``build()`` seen by the sync harness (all layers that run here)."""
    from .testing.audit_reads import host_reads

    return host_reads(builder, batch)


def _exact_meta(meta, exact: int):
    """``meta`` with its bound (host width and device clamp) replaced by the exact maximum."""
    active = torch.full_like(meta.active_width, exact)
    return dataclasses.replace(meta, bound=DecodeTopkBound(exact, meta.bound.source), active_width=active)


def audit_batch(path: DecodePath, device: torch.device, *, seed: int = 0,
                host_reads: HostReadCounter = harness_host_reads) -> AuditRow:
    """Run one random batch of one path and check its invariants."""
    gen = torch.Generator().manual_seed(seed)
    case = make_case(path, device, gen)
    lay = path.layout
    n_rows = len(case.kernel_rows)
    builder = IndexerMetadataBuilder(lay, max_num_reqs=8, max_num_tokens=max(16, n_rows),
                                     max_pages_per_req=case.batch.block_table.shape[1], device=device)
    step = IndexerStep.for_builder(builder)
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
    inp = make_step_inputs(path, case, device, gen)
    bound_meta = dataclasses.replace(meta, bound=bound, active_width=torch.full_like(meta.active_width,
                                                                                      bound.value))
    with_bound = step.run(bound_meta, inp.q_fp8, inp.weights, inp.k_cache).clone()
    with_exact = step.run(_exact_meta(meta, exact), inp.q_fp8, inp.weights, inp.k_cache)
    # the same positions per row (the contract is a set per row)
    match = torch.equal(with_bound.cpu().sort(dim=1).values, with_exact.cpu().sort(dim=1).values)
    if not match:
        problems.append("top-k with the bound differs from top-k with the exact bound")
    health = step.health()
    if health.stalled_rows:
        problems.append(f"{health.stalled_rows} stalled rows in the fused step")
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
        print(f"[{i + 1}/{len(paths)}] {path.name} ({_count(batches, 'batch', 'batches')}) ...", file=sys.stderr,
              flush=True)
        rows.append(audit_path(path, device, seed=seed + i * batches, batches=batches,
                               host_reads=host_reads))
    return rows


HEADERS = ("path", "bound source", "bound", "exact max", "widening", "top-k match", "host reads", "seed",
           "result")


def format_table(rows: Sequence[AuditRow]) -> str:
    """A plain-text table of audit rows."""
    lines = text_table(HEADERS, [
        (r.path, r.bound_source, str(r.bound), str(r.exact_max), f"{r.widening:.3f}x",
         "yes" if r.topk_match else "NO", str(r.host_reads), str(r.seed), "ok" if r.ok else "FAIL")
        for r in rows
    ])
    failures = [f"{r.path} (seed {r.seed}): {r.detail}" for r in rows if not r.ok]
    return "\n".join(lines + failures)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def device_name(device: torch.device) -> str:
    """The device in words: ``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    device = torch.device(device)
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def verdict(rows: Sequence[AuditRow], device: torch.device) -> str:
    """One line: ok or FAIL, the paths and batches, and the device they ran on."""
    where = f"on {device_name(device)}, torch {torch.__version__}"
    batches = max((r.batches for r in rows), default=0)
    failed = [r.path for r in rows if not r.ok]
    if not rows:
        return f"audit: FAIL: no path ran ({where})"
    if failed:
        return f"audit: FAIL: {len(failed)} of {len(rows)} paths ({', '.join(failed)}) ({where})"
    return (f"audit: ok: {_count(len(rows), 'path', 'paths')} x {_count(batches, 'batch', 'batches')}, every "
            f"bound covers its rows, same top-k, no host reads ({where})")


def format_report(rows: Sequence[AuditRow], device: torch.device) -> str:
    """The audit's printout: the device, the table (and its failures), then the one-line verdict."""
    return "\n".join([f"device: {device_name(device)}", format_table(rows), verdict(rows, device)])


def rows_to_json(rows: Sequence[AuditRow]) -> str:
    """The rows as a JSON list."""
    return json.dumps([asdict(r) for r in rows], indent=2)
