import json
import subprocess
import sys

import pytest
import torch

from vllm_sparse_sync.audit import AUDIT_PATHS, AuditRow, format_table, run_audit
from vllm_sparse_sync.cli import main

REQUIRED = {
    "b12x-compressed", "b12x-uncompressed", "b12x-uncompressed-dcp2", "b12x-uncompressed-async-spec",
    "deepgemm-compressed", "deepgemm-uncompressed", "deepgemm-uncompressed-async-spec",
    "deepgemm-uncompressed-no-shadow", "mtp-ragged", "capture",
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


def test_cpu_stand_ins_never_share_storage_with_their_host_twins():
    import torch

    from vllm_sparse_sync.scenarios import make_case

    for path in AUDIT_PATHS:
        b = make_case(path, torch.device("cpu"), torch.Generator().manual_seed(0)).batch
        host = b.query_start_loc_cpu.untyped_storage().data_ptr()
        assert b.query_start_loc.untyped_storage().data_ptr() != host


PLANTED_READS = {
    "query_start_loc": lambda batch: batch.query_start_loc.tolist(),
    "seq_lens": lambda batch: batch.seq_lens.max().item(),
    "block_table": lambda batch: int(batch.block_table.sum()),
}


@pytest.mark.parametrize("field", sorted(PLANTED_READS))
def test_audit_flags_an_unconditional_read_planted_in_build(monkeypatch, field):
    from vllm_sparse_sync.metadata import IndexerMetadataBuilder

    build = IndexerMetadataBuilder.build

    def planted(self, batch):
        PLANTED_READS[field](batch)
        return build(self, batch)

    monkeypatch.setattr(IndexerMetadataBuilder, "build", planted)
    rows = run_audit(AUDIT_PATHS, device=torch.device("cpu"), batches=1)
    assert all(not r.ok and r.host_reads >= 1 for r in rows), format_table(rows)
    assert all("test_audit.py" in r.detail and field in r.detail for r in rows), format_table(rows)


def test_audit_reports_the_worst_of_several_batches():
    rows = run_audit(AUDIT_PATHS[:2], device=torch.device("cpu"), seed=7, batches=3)
    for r in rows:
        assert r.batches == 3 and r.ok and r.seed in range(7, 7 + 2 * 3)


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
    assert ("p (seed 0): why" in table) is (not row_ok)
