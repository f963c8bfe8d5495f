"""What the plugin reports: each test's checked regions (stored on its reports, so they cross
xdist to the controller), the terminal summary, the JSON report, and the failure of a vLLM-mode
run that checked no build.

A green run is quiet: a line of totals (and a few for vLLM mode); each test's syncs are listed
for failed tests, with -v, and in the JSON report (`--sync-report`).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from .records import SyncRecord, count_by_kind

PROPERTY = "vllm_sparse_sync.host_syncs"
VLLM_KINDS = ("vllm_build", "vllm_indexer_forward")
NOTHING_CHECKED = ("no vLLM attention-metadata build() was checked in this run ({seen}): a green run "
                   "here would prove nothing, so it fails; --sync-unavailable=skip accepts it")


def _call_entry(check) -> dict:
    return {**check.info, "layers": list(check.ran), "unwatched": list(check.unwatched),
            "records": [r.to_dict() for r in check.records]}


def store_checks(item, checks, phase: str) -> None:
    """Attach the regions of one phase of a test (records, layers that ran, vLLM calls) to it."""
    if not checks:
        return
    records = [r.to_dict() for c in checks for r in c.records]
    layers = sorted({n for c in checks for n in c.ran})
    calls = [_call_entry(c) for c in checks if c.info.get("kind") in VLLM_KINDS]
    item.user_properties.append((PROPERTY, {"phase": phase, "records": records, "layers": layers,
                                            "regions": len(checks), "vllm": calls}))


def _merge(into: dict, data: dict) -> None:
    into["records"] += data["records"]
    into["layers"] = sorted(set(into["layers"]) | set(data["layers"]))
    into["regions"] += data["regions"]
    into["vllm"] += data.get("vllm", [])


def _counted(records) -> list[dict]:
    return [r for r in records if not r.get("allowed")]


class SyncSession:
    """Per-run collector (on the controller): regions of every test, the summary, the report."""

    def __init__(self, config):
        self.config = config
        self.results: dict[str, dict] = {}
        self.failed: set[str] = set()
        self.vllm = getattr(config, "_vss_vllm", None) is not None

    # -- collecting ----------------------------------------------------------------------
    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.add(report.nodeid)
        for name, value in getattr(report, "user_properties", ()):
            if name == PROPERTY and value.get("phase", "call") == report.when:
                entry = self.results.setdefault(report.nodeid, {"records": [], "layers": [], "regions": 0,
                                                                "vllm": []})
                _merge(entry, value)

    def vllm_calls(self) -> list[dict]:
        return [{"test": nodeid, **call} for nodeid, data in sorted(self.results.items())
                for call in data["vllm"]]

    # -- the summary ---------------------------------------------------------------------
    def summary_rows(self, nodeids=None) -> list[str]:
        rows = []
        for nodeid in sorted(self.results if nodeids is None else nodeids):
            data = self.results[nodeid]
            counts = count_by_kind(SyncRecord.from_dict(d) for d in data["records"])
            detail = ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
            rows.append(f"{nodeid}: {len(data['records'])} sync record(s) [{detail}] "
                        f"layers={','.join(data['layers']) or '-'}")
            if nodeids is not None:
                rows += [f"    {SyncRecord.from_dict(d).format()}" for d in data["records"]]
        return rows

    def vllm_lines(self, verbose: bool) -> list[str]:
        calls = self.vllm_calls()
        checked = [c for c in calls if not c.get("unchecked")]
        records = [r for c in checked for r in c["records"]]
        new = _counted(records)
        known = Counter(f"{r['location']} in {r['function']}" for r in records if r.get("known"))
        allowed = [r for r in records if r.get("allowed") and not r.get("known")]
        layers = sorted({n for c in checked for n in c["layers"]})
        tests = len({c["test"] for c in checked})
        builds = sum(1 for c in checked if c.get("kind") == "vllm_build")
        forwards = len(checked) - builds
        head = (f"vLLM: {builds} build() call(s)"
                + (f" and {forwards} indexer forward(s)" if forwards else "")
                + f" checked in {tests} test(s), layers {','.join(layers) or '-'}: "
                  f"{len(new)} host sync(s), {sum(known.values())} known upstream, {len(allowed)} allowed")
        lines = [head]
        for where, n in sorted(known.items()):
            lines.append(f"  known upstream read at {where} (x{n})")
        unchecked = Counter(c["unchecked"] for c in calls if c.get("unchecked"))
        for why, n in sorted(unchecked.items()):
            lines.append(f"  {n} call(s) not checked: {why}")
        unwatched = Counter(u for c in checked for u in c["unwatched"])
        if unwatched:
            shown = sorted(unwatched.items(), key=lambda kv: (-kv[1], kv[0]))
            more = f", and {len(shown) - 4} more" if len(shown) > 4 else ""
            lines.append("  not watched, passed as their host twin: "
                         + ", ".join(f"{u} x{n}" for u, n in shown[:4]) + more)
        if verbose:
            by_builder = Counter(c["builder"] for c in checked)
            lines += [f"  {b}: {n} call(s)" for b, n in sorted(by_builder.items())]
        return lines

    def nothing_checked(self) -> bool:
        return self.vllm and not any(not c.get("unchecked") for c in self.vllm_calls())

    def pytest_terminal_summary(self, terminalreporter):
        if not self.results and not self.vllm:
            return
        tr = terminalreporter
        verbose = self.config.getoption("verbose", 0) > 0
        tr.write_sep("=", "host sync summary (vllm_sparse_sync)")
        if verbose:
            rows = self.summary_rows()
        else:
            rows = self.summary_rows([n for n in self.failed if n in self.results
                                      and self.results[n]["records"]])
        for row in rows[:200]:
            tr.write_line(row)
        if len(rows) > 200:
            tr.write_line(f"... {len(rows) - 200} more lines (see --sync-report)")
        total = sum(len(v["records"]) for v in self.results.values())
        counted = sum(len(_counted(v["records"])) for v in self.results.values())
        tr.write_line(f"{len(self.results)} test(s) checked, {total} sync record(s) in total"
                      + (f" ({total - counted} allowed or known)" if total != counted else ""))
        if self.vllm:
            for line in self.vllm_lines(verbose):
                tr.write_line(line)
            if self.nothing_checked():
                seen = len(self.vllm_calls())
                why = f"{seen} call(s) seen, none checkable here" if seen else "no test built one"
                accepted = self.config._vss_unavailable == "skip"
                tr.write_line(NOTHING_CHECKED.format(seen=why)
                              + (" (accepted: --sync-unavailable=skip)" if accepted else ""),
                              red=not accepted, yellow=accepted)

    # -- the end -------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        if (self.nothing_checked() and self.config._vss_unavailable != "skip"
                and not self.config.option.collectonly and session.exitstatus == pytest.ExitCode.OK):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        path = self.config.getoption("sync_report", None)
        if not path:
            return
        out = {}
        for nodeid, data in sorted(self.results.items()):
            recs = [SyncRecord.from_dict(d) for d in data["records"]]
            out[nodeid] = {"counts": count_by_kind(recs), "layers": data["layers"],
                           "regions": data["regions"], "records": data["records"]}
        report: dict = {"tests": out}
        if self.vllm:
            report["vllm"] = {"calls": self.vllm_calls(), "summary": self.vllm_lines(True)}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)
