"""What the plugin reports: each test's sync records (stored on the test report, so they cross
xdist), the terminal summary, and the JSON report of every sync."""

from __future__ import annotations

import json
import os

from .records import SyncRecord, count_by_kind

PROPERTY = "vllm_sparse_sync.host_syncs"


def store_checks(item, checks) -> None:
    """Attach the test's checked regions (records, layers that ran) to its report."""
    if not checks:
        return
    records = [r.to_dict() for c in checks for r in c.records]
    layers = sorted({n for c in checks for n in c.ran})
    item.user_properties.append((PROPERTY, {"records": records, "layers": layers,
                                            "regions": len(checks)}))


class SyncSession:
    """Per-run collector: records from every test, the terminal summary, the JSON report.

    Prints nothing in a run where no test used the harness.
    """

    def __init__(self, config):
        self.config = config
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        if report.when != "call":
            return
        for name, value in getattr(report, "user_properties", ()):
            if name == PROPERTY:
                self.results[report.nodeid] = value

    def summary_rows(self) -> list[str]:
        rows = []
        for nodeid in sorted(self.results):
            data = self.results[nodeid]
            counts = count_by_kind(SyncRecord.from_dict(d) for d in data["records"])
            detail = ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
            rows.append(f"{nodeid}: {len(data['records'])} sync record(s) [{detail}] "
                        f"layers={','.join(data['layers']) or '-'}")
        return rows

    def pytest_terminal_summary(self, terminalreporter):
        if not self.results:
            return
        tr = terminalreporter
        tr.write_sep("=", "host sync summary (vllm_sparse_sync)")
        rows = self.summary_rows()
        limit = 60
        for row in rows[:limit]:
            tr.write_line(row)
        if len(rows) > limit:
            tr.write_line(f"... {len(rows) - limit} more tests (see --sync-report)")
        total = sum(len(v["records"]) for v in self.results.values())
        tr.write_line(f"{len(rows)} test(s) checked, {total} sync record(s) in total")

    def pytest_sessionfinish(self, session):
        path = self.config.getoption("sync_report", None)
        if not path:
            return
        out = {}
        for nodeid, data in sorted(self.results.items()):
            recs = [SyncRecord.from_dict(d) for d in data["records"]]
            out[nodeid] = {"counts": count_by_kind(recs), "layers": data["layers"],
                           "regions": data["regions"], "records": data["records"]}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"tests": out}, f, indent=2, sort_keys=True)
