"""`vllm-sparse-sync audit --target vllm`: vLLM's own indexer builder on every path, under the harness.

Each row: the bound vLLM 0.33 passes to its top-k, this project's bound and source for the same
batch (and, with the plugin, the bound the plugin puts in vLLM's metadata), the exact maximum in
kernel coordinates, the widening of each, and every host read `build()` made with its file:line.
Reads listed in a baseline (known upstream syncs: site, why, link) are printed every run but do
not fail the row; any other read does.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..table import text_table
from ..testing.guard import SyncCheck
from ..testing.records import SyncRecord
from ..vllm_plugin import indexer_bound
from .bounds import exact_kernel_max, vllm_bound
from .cases import VLLM_PATHS, make_vllm_case
from .watch import vllm_watch

BASELINE_033 = [
    {"site": "vllm/v1/attention/backends/mla/indexer.py:1895",
     "why": "DCP prefill chunking reads the local cumulative length back: "
            "int(local_cu_seq_lens[-1].item()) in build_prefill_chunk_metadata",
     "link": "https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/attention/backends/mla/indexer.py#L1895"},
    {"site": "vllm/v1/attention/backends/mla/indexer.py:1896",
     "why": "DCP prefill chunking reads the longest local length back: "
            "int(local_seq_lens.sum(dim=0).max().item()) in build_prefill_chunk_metadata",
     "link": "https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/attention/backends/mla/indexer.py#L1896"},
]
"""The host reads of device data this audit found in vLLM 0.33's indexer builder itself."""


def site_of(record: SyncRecord) -> str:
    """A record's `file:line`, with a vLLM file's path from its `vllm/` package folder on."""
    loc = record.location.replace("\\", "/")
    i = loc.rfind("/vllm/")
    return loc[i + 1:] if i >= 0 else loc


def load_baseline(path: str | None) -> list[dict]:
    """Known upstream syncs: a JSON list of {site, why, link}; None: the one shipped for 0.33."""
    if path is None:
        return list(BASELINE_033)
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list) or not all(isinstance(d, dict) and "site" in d for d in data):
        raise ValueError(f"{path}: expected a JSON list of objects with a 'site' (file:line)")
    return data


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
    allowed_sites: list[str] = field(default_factory=list)
    plugin_bound: int | None = None
    batches: int = 1
    ok: bool = True
    detail: str = ""


def _widening(bound: int | None, exact: int | None) -> float | None:
    if bound is None or exact is None:
        return None
    return round(bound / exact, 3) if exact else math.inf


def audit_case(path: str, seed: int, known: set[str], with_plugin: bool) -> dict:
    """One batch of one path: bounds, and the host reads of a second `build()` (the first warms
    up the interpreted kernels)."""
    case = make_vllm_case(path, seed=seed)
    case.build()
    check = SyncCheck(watch=vllm_watch(case), raise_on_sync=False, where=f"vLLM build() [{path}]")
    with check:
        meta = case.build()
    counted = [r for r in check.records if not r.allowed]
    sites = sorted({site_of(r) for r in counted})
    has_decode = case.num_decodes > 0
    res = dict(
        sites=[s for s in sites if s not in known], known=[s for s in sites if s in known],
        allowed=sorted({site_of(r) for r in check.records if r.allowed}),
        reads=sum(1 for r in counted if site_of(r) not in known),
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


def audit_path(path: str, *, seed: int, batches: int, known: set[str], with_plugin: bool) -> VllmAuditRow:
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
        allowed_sites=sorted({s for r in results for s in r["allowed"]}),
        plugin_bound=worst["plugin"], batches=batches, ok=not problems, detail="; ".join(problems),
    )


def run_vllm_audit(paths: Sequence[str] = VLLM_PATHS, *, seed: int = 0, batches: int = 2,
                   with_plugin: bool = False, baseline: list[dict] | None = None) -> list[VllmAuditRow]:
    """Audit vLLM's builder on `paths`; with the plugin installed (forced, any platform) when asked."""
    from .. import vllm_plugin

    unknown = [p for p in paths if p not in VLLM_PATHS]
    if unknown:
        raise ValueError(f"unknown vLLM path(s) {', '.join(unknown)}; known: {', '.join(VLLM_PATHS)}")
    known = {d["site"] for d in (BASELINE_033 if baseline is None else baseline)}
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


def format_table(rows: Sequence[VllmAuditRow], baseline: list[dict] | None = None) -> str:
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
    why = {d["site"]: d for d in (BASELINE_033 if baseline is None else baseline)}
    for r in rows:
        for s in r.sites:
            lines.append(f"{r.path}: NEW host read at {s}")
        for s in r.known_sites:
            d = why.get(s, {})
            lines.append(f"{r.path}: known upstream host read at {s}: {d.get('why', '')} {d.get('link', '')}")
        for s in r.allowed_sites:
            lines.append(f"{r.path}: allowed sync (vLLM gpu_sync_allowed) at {s}")
        if not r.ok:
            lines.append(f"{r.path}: {r.detail}")
    return "\n".join(lines)


def rows_to_json(rows: Sequence[VllmAuditRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)
