"""The command line never says ok for nothing and never answers a bad option with a traceback:
seeds out of range, duplicate paths, a selftest that could measure nothing, ``--version``, plain
help text; the audit names its device and ends with a one-line verdict, and its path without a
CPU shadow catches a sync that fires only when there is none."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import vllm_sparse_sync
from vllm_sparse_sync.audit import AUDIT_PATHS, format_report, run_audit
from vllm_sparse_sync.cli import build_parser, main
from vllm_sparse_sync.scenarios import path_named

NO_SHADOW = "deepgemm-uncompressed-no-shadow"


def _one_line_error(capsys, words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert words in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv", [
    ["audit", "--seed", "99999999999999999999999"],
    ["audit", "--seed", "-1"],
    ["audit", "--seed", str(2**63 - 1)],  # the last path's batches would pass 2**63 - 1
    ["audit", "--batches", str(10**30)],
])
def test_a_seed_out_of_range_is_a_usage_error(argv, capsys):
    assert main(argv) == 2
    _one_line_error(capsys, "--seed")


def test_the_largest_seed_that_fits_is_taken(capsys):
    seed = 2**63 - 2  # its two batches: seeds 2**63 - 2 and 2**63 - 1
    assert main(["audit", "--path", "capture", "--batches", "2", "--seed", str(seed)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("audit: ok")
    assert main(["audit", "--path", "capture", "--batches", "2", "--seed", str(seed + 1)]) == 2


def test_a_huge_seed_prints_no_traceback_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "vllm_sparse_sync.cli", "audit", "--seed",
                           "99999999999999999999999"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--seed" in proc.stderr


def test_a_path_named_twice_is_refused(capsys):
    assert main(["audit", "--path", "capture", "--path", "capture"]) == 2
    _one_line_error(capsys, "capture named more than once")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host measures debug_mode")
def test_selftest_that_can_measure_nothing_does_not_say_ok(capsys):
    assert main(["selftest", "--layers", "debug_mode"]) == 1
    out, err = capsys.readouterr()
    assert "selftest: ok" not in out and "nothing could run here" in err and "debug_mode" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host measures debug_mode")
def test_selftest_names_the_layers_it_could_not_measure(capsys):
    assert main(["selftest", "--layers", "sentinel,debug_mode"]) == 0
    out, err = capsys.readouterr()
    assert "debug_mode is not measured here" in err and "selftest: ok" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"vllm-sparse-sync {vllm_sparse_sync.__version__}"


def test_help_is_plain_text():
    parser = build_parser()
    texts = [parser.format_help()]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    texts += [p.format_help() for p in sub.choices.values()]
    for text in texts:
        assert "``" not in text and ":func:" not in text and ".. " not in text, text


def test_the_audit_names_its_device_and_ends_with_a_verdict(capsys):
    assert main(["audit", "--path", "capture", "--path", "mtp-ragged", "--batches", "1", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "device: cpu"
    assert lines[-1].startswith("audit: ok: 2 paths x 1 batch,") and "on cpu" in lines[-1]


def test_a_failing_audit_says_so_in_its_last_line():
    rows = run_audit(AUDIT_PATHS[:2], device=torch.device("cpu"), batches=1,
                     host_reads=lambda builder, batch: (1, "planted"))
    last = format_report(rows, torch.device("cpu")).splitlines()[-1]
    assert last.startswith("audit: FAIL: 2 of 2 paths") and AUDIT_PATHS[0].name in last


def test_the_audit_has_a_path_without_a_shadow():
    path = path_named(NO_SHADOW)
    assert not path.shadow
    from vllm_sparse_sync.scenarios import make_case

    assert make_case(path, "cpu", torch.Generator().manual_seed(0)).batch.shadow is None


def test_a_sync_only_without_a_shadow_fails_the_new_path_and_only_it(monkeypatch):
    """The old ``int(seq_lens.max())`` fallback: it fires only when the batch has no shadow, so
    every other path passes; the path without a shadow catches it."""
    from vllm_sparse_sync.metadata import IndexerMetadataBuilder

    build = IndexerMetadataBuilder.build

    def fallback(self, batch):
        if batch.shadow is None:
            int(batch.seq_lens.max())
        return build(self, batch)

    monkeypatch.setattr(IndexerMetadataBuilder, "build", fallback)
    rows = run_audit(AUDIT_PATHS, device=torch.device("cpu"), batches=1)
    failed = {r.path for r in rows if not r.ok}
    assert failed == {NO_SHADOW}, format_report(rows, torch.device("cpu"))
    row = next(r for r in rows if r.path == NO_SHADOW)
    assert row.host_reads >= 1 and "test_cli.py" in row.detail


def test_plan_prints_the_kernels_of_every_row_count_for_a_described_gpu(capsys):
    assert main(["plan", "--sm90", "132", "--max-rows", "128"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("StepPlan: 132 SMs, page 64")
    rows = [line.split()[1] for line in out[3:]]
    assert rows == ["1-4", "5-8", "9-16", "17-66", "67-128"]  # every row count, once, in order
    assert "topk_cluster_c16_t1024" in out[3] and "cuda scorer" in out[3]


def test_plan_on_this_host_and_bad_options(capsys):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert main(["plan", "--max-rows", "8", "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"IndexerStep(b12x, max_rows=8, max_pages_per_req=64, device={device}")
    if device == "cpu":
        assert "the torch reference" in out
    for argv, why in ((["--config", "bogus=1"], "unknown field 'bogus'"), (["--max-rows", "0"], "--max-rows"),
                      (["--sm90", "0"], "--sm90"), (["--page-size", "48"], "page_size")):
        assert main(["plan", *argv]) == 2
        assert why in capsys.readouterr().err
