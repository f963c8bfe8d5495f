import json
import subprocess
import sys

import pytest

from vllm_sparse_sync.audit import AUDIT_PATHS, AuditRow, format_table, run_audit
from vllm_sparse_sync.cli import main

REQUIRED = {
    "b12x-compressed", "b12x-uncompressed", "b12x-uncompressed-dcp2", "b12x-uncompressed-async-spec",
    "deepgemm-compressed", "deepgemm-uncompressed", "deepgemm-uncompressed-async-spec", "mtp-ragged",
    "capture",
}


def test_audit_exits_zero_and_its_json_has_every_path(tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert main(["audit", "--json", str(out), "--device", "cpu"]) == 0
    rows = json.loads(out.read_text())
    assert {r["path"] for r in rows} >= REQUIRED
    for r in rows:
        assert {"path", "bound_source", "bound", "exact_max", "topk_match", "host_reads"} <= r.keys()
        assert r["bound"] >= r["exact_max"] and r["topk_match"] and r["host_reads"] == 0
    table = capsys.readouterr().out
    assert all(name in table for name in REQUIRED) and "FAIL" not in table


def test_audit_fails_when_a_path_reads_device_data():
    rows = run_audit(AUDIT_PATHS[:1], host_reads=lambda builder, batch: (1, "injected .item()"))
    assert not rows[0].ok and "injected .item()" in rows[0].detail
    assert "FAIL" in format_table(rows)


def test_unknown_path_is_a_usage_error(capsys):
    assert main(["audit", "--path", "nope"]) == 2
    assert "unknown path" in capsys.readouterr().err


def test_console_script_module_runs():
    res = subprocess.run([sys.executable, "-m", "vllm_sparse_sync.cli", "audit", "--path", "capture",
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "capture_stable" in res.stdout


@pytest.mark.parametrize("row_ok", [True, False])
def test_table_marks_results(row_ok):
    row = AuditRow("p", "cpu_exact", 5, 5, 1.0, row_ok, 0, row_ok, "" if row_ok else "why")
    table = format_table([row])
    assert ("FAIL" in table) is (not row_ok)
    assert ("p: why" in table) is (not row_ok)
