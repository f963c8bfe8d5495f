"""`vllm-sparse-sync audit --target vllm`: vLLM's own indexer builder on every path, under the harness.

Each row: the bound vLLM 0.33 passes to its top-k, this project's bound and source for the same
batch (and, with the plugin, the bound the plugin puts in vLLM's metadata), the exact maximum in
kernel coordinates, the widening of each, and every host read `build()` made with its file:line.
Reads listed in a baseline (known upstream syncs, keyed by file, function and source line) are
printed every run, at the line where they are today, but do not fail the row; any other read does.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..table import text_table
from ..testing.guard import SyncCheck
from ..testing.known import KnownRead, find_known
from ..testing.records import SyncRecord
from ..vllm_plugin import indexer_bound
from .bounds import exact_kernel_max, vllm_bound
from .cases import VLLM_PATHS, make_vllm_case
from .watch import vllm_watch

_INDEXER = "vllm/v1/attention/backends/mla/indexer.py"
_LINK = "https://github.com/vllm-project/vllm/blob/v0.33.0/" + _INDEXER
BASELINE_033 = [
    KnownRead(file=_INDEXER, function="build_prefill_chunk_metadata",
              code="local_total_seq_lens = int(local_cu_seq_lens[-1].item())",
              why="DCP prefill chunking reads the local cumulative length back",
              link=_LINK + "#L1895"),
    KnownRead(file=_INDEXER, function="build_prefill_chunk_metadata",
              code="max_local_total_seq_lens = int(local_seq_lens.sum(dim=0).max().item())",
              why="DCP prefill chunking reads the longest local length back",
              link=_LINK + "#L1896"),
]
"""The host reads of device data this audit found in vLLM 0.33's indexer builder itself."""


def site_of(record: SyncRecord) -> str:
    """A record's `file:line`, with a vLLM file's path from its `vllm/` package folder on."""
    loc = record.location.replace("\\", "/")
    i = loc.rfind("/vllm/")
    return loc[i + 1:] if i >= 0 else loc


def known_read_of(record: SyncRecord, baseline: Sequence[KnownRead]) -> KnownRead | None:
    """The baseline entry `record` is (by file, function and source line), if any."""
    filename = record.location.rsplit(":", 1)[0]
    return find_known(filename, record.function, record.code, record.op, reads=baseline)


def load_baseline(path: str | None) -> list[KnownRead]:
    """Known upstream syncs: a JSON list of {file, function, code (or op), why, link}; None: the
    ones shipped for 0.33."""
    if path is None:
        return list(BASELINE_033)
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects with file, function and code")
    return [KnownRead.from_dict(d, where=f"{path}[{i}]") for i, d in enumerate(data)]


@dataclass
class VllmAuditRow:
    path: str
    vllm_bound: int | None
    bound: int | None
    bound_source: str
    exact_max: int | None
    vllm_widening: float | None
    widening: float | None
    host_reads: int
    sites: list[str] = field(default_factory=list)
    known_sites: list[str] = field(default_factory=list)
    known_reads: list[dict] = field(default_factory=list)
    allowed_sites: list[str] = field(default_factory=list)
    plugin_bound: int | None = None
    batches: int = 1
    ok: bool = True
    detail: str = ""


def _widening(bound: int | None, exact: int | None) -> float | None:
    if bound is None or exact is None:
        return None
    return round(bound / exact, 3) if exact else math.inf


def audit_case(path: str, seed: int, known: Sequence[KnownRead], with_plugin: bool) -> dict:
    """One batch of one path: bounds, and the host reads of a second `build()` (the first warms
    up the interpreted kernels)."""
    case = make_vllm_case(path, seed=seed)
    case.build()
    check = SyncCheck(watch=vllm_watch(case), raise_on_sync=False, where=f"vLLM build() [{path}]")
    with check:
        meta = case.build()
    counted = [r for r in check.records if not r.allowed or r.known]
    new = [r for r in counted if known_read_of(r, known) is None]
    found = {site_of(r): known_read_of(r, known) for r in counted if known_read_of(r, known)}
    has_decode = case.num_decodes > 0
    res = dict(
        sites=sorted({site_of(r) for r in new}),
        known={s: {"site": s, "function": k.function, "why": k.why, "link": k.link}
               for s, k in found.items()},
        allowed=sorted({site_of(r) for r in check.records if r.allowed and not r.known}),
        reads=len(new),
        vllm=vllm_bound(case) if has_decode else None,
        exact=exact_kernel_max(case) if has_decode else None,
        ours=None, source="-", plugin=None,
    )
    if has_decode:
        b = indexer_bound(case.builder, case.common, case.num_decodes)
        res["ours"], res["source"] = b.value, b.source.value
        if with_plugin:
            res["plugin"] = int(meta.max_seq_len)
    return res


def audit_path(path: str, *, seed: int, batches: int, known: Sequence[KnownRead],
               with_plugin: bool) -> VllmAuditRow:
    results = [audit_case(path, seed + j, known, with_plugin) for j in range(batches)]
    worst = max(results, key=lambda r: (r["reads"], (r["ours"] or 0) / max(r["exact"] or 1, 1)))
    problems = []
    sites = sorted({s for r in results for s in r["sites"]})
    if sites:
        problems.append("host read of device data in vLLM's build(): " + ", ".join(sites))
    for r in results:
        if r["exact"] is not None and r["ours"] is not None and r["ours"] < r["exact"]:
            problems.append(f"project bound {r['ours']} below the exact maximum {r['exact']}")
        if r["plugin"] is not None and r["plugin"] < r["exact"]:
            problems.append(f"plugin bound {r['plugin']} below the exact maximum {r['exact']}")
    return VllmAuditRow(
        path=path, vllm_bound=worst["vllm"], bound=worst["ours"], bound_source=worst["source"],
        exact_max=worst["exact"], vllm_widening=_widening(worst["vllm"], worst["exact"]),
        widening=_widening(worst["ours"], worst["exact"]),
        host_reads=max(r["reads"] for r in results), sites=sites,
        known_sites=sorted({s for r in results for s in r["known"]}),
        known_reads=sorted({s: d for r in results for s, d in r["known"].items()}.values(),
                           key=lambda d: d["site"]),
        allowed_sites=sorted({s for r in results for s in r["allowed"]}),
        plugin_bound=worst["plugin"], batches=batches, ok=not problems, detail="; ".join(problems),
    )


def run_vllm_audit(paths: Sequence[str] = VLLM_PATHS, *, seed: int = 0, batches: int = 2,
                   with_plugin: bool = False,
                   baseline: Sequence[KnownRead] | None = None) -> list[VllmAuditRow]:
    """Audit vLLM's builder on `paths`; with the plugin installed (forced, any platform) when asked."""
    from .. import vllm_plugin

    unknown = [p for p in paths if p not in VLLM_PATHS]
    if unknown:
        raise ValueError(f"unknown vLLM path(s) {', '.join(unknown)}; known: {', '.join(VLLM_PATHS)}")
    known = list(BASELINE_033 if baseline is None else baseline)
    if with_plugin:
        vllm_plugin.install(force=True)
    rows = []
    try:
        for i, path in enumerate(paths):
            print(f"[{i + 1}/{len(paths)}] vLLM {path} ({batches} batches) ...", file=sys.stderr, flush=True)
            rows.append(audit_path(path, seed=seed + i * batches, batches=batches, known=known,
                                   with_plugin=with_plugin))
    finally:
        if with_plugin:
            vllm_plugin.uninstall()
    return rows


def format_table(rows: Sequence[VllmAuditRow], baseline: Sequence[KnownRead] | None = None) -> str:
    """The rows as a table, then each read: new ones, known ones (at today's file:line, with why),
    vLLM's allowed ones. (`baseline` is accepted for callers that pass it; rows carry what they
    matched.)"""
    plugin = any(r.plugin_bound is not None for r in rows)
    head = ["path", "vLLM bound", "bound", "source", *(["plugin bound"] if plugin else []), "exact max",
            "vLLM widening", "widening", "host reads", "result"]

    def num(v):
        return "-" if v is None else (f"{v:.3f}x" if isinstance(v, float) else str(v))

    lines = text_table(head, [
        [r.path, num(r.vllm_bound), num(r.bound), r.bound_source,
         *([num(r.plugin_bound)] if plugin else []), num(r.exact_max), num(r.vllm_widening),
         num(r.widening), str(r.host_reads) + (f" (+{len(r.known_sites)} known)" if r.known_sites else ""),
         "ok" if r.ok else "FAIL"]
        for r in rows
    ])
    for r in rows:
        for s in r.sites:
            lines.append(f"{r.path}: NEW host read at {s}")
        for d in r.known_reads:
            lines.append(f"{r.path}: known upstream host read at {d['site']} in {d['function']}: "
                         f"{d['why']} {d['link']}".rstrip())
        for s in r.allowed_sites:
            lines.append(f"{r.path}: allowed sync (vLLM gpu_sync_allowed) at {s}")
        if not r.ok:
            lines.append(f"{r.path}: {r.detail}")
    return "\n".join(lines)


def rows_to_json(rows: Sequence[VllmAuditRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)
