"""vLLM's own tests (from the sdist of the installed vLLM) under ``pytest --sync-vllm``, unedited,
in subprocesses that start with nothing exported: they run, every build they make is checked (and
counted on the xdist controller), a host read planted in a builder they reach fails them naming
the planted line, a line inserted above vLLM's known reads leaves them known, and a run that
checks nothing fails.

The sdist is fetched once (sha256 checked) into the suite's cache; without network and cache the
tests skip, saying so.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from vllm_sparse_sync.testing import vllm_suite
from vllm_sparse_sync.testing.vllm_env import CPU_ENV, EXPORT, cuda_device_present, vllm_installed

if not vllm_installed():  # (a tests/vllm folder on sys.path is not vLLM)
    pytest.skip("needs vLLM: pip install \"vllm-sparse-sync[vllm-tests]\"", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KPOOL = "tests/v1/attention/test_kpool_tail_slot_mapping.py"
PCP = ("tests/v1/attention/test_indexer_deepseek_v4_slot_mapping.py::"
       "test_zero_token_pcp_rank_participates_in_compressed_mapping_gather")
MLA = "tests/v1/attention/test_mla_noncausal.py"
NO_BUILDS = "tests/v1/attention/test_sparse_mla_mask.py"  # tests that build no metadata
SUMMARY = re.compile(r"vLLM: (\d+) build\(\) call\(s\) checked in (\d+) test\(s\), layers (\S+): "
                     r"(\d+) host sync\(s\), (\d+) known upstream, (\d+) allowed")
pytestmark = pytest.mark.skipif(cuda_device_present(), reason="the CPU runs of vLLM's suite")


@pytest.fixture(scope="module")
def vllm_tests():
    """The extracted tests of the installed vLLM's sdist."""
    missing = vllm_suite.missing_test_deps()
    if missing:
        pytest.skip(f"vLLM's tests need {', '.join(missing)}: pip install \"vllm-sparse-sync[vllm-tests]\"")
    cache = os.environ.get("VLLM_SPARSE_SYNC_CACHE") or vllm_suite.default_cache()
    try:
        tarball = vllm_suite.fetch(vllm_suite.installed_vllm(), cache)
    except (OSError, SystemExit) as exc:
        pytest.skip(f"vLLM's sdist is not cached in {cache} and cannot be fetched: {exc}")
    return vllm_suite.extract_tests(tarball, cache)


def clean_env(**extra) -> dict:
    """This process's environment without what --sync-vllm sets: a user's shell."""
    env = {k: v for k, v in os.environ.items() if k not in CPU_ENV}
    env.update(vllm_suite.OFFLINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def run_pytest(root, *args, env=None, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=root,
                          env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def summary(proc) -> dict:
    m = SUMMARY.search(proc.stdout)
    assert m, proc.stdout[-3000:] + proc.stderr[-3000:]
    keys = ("calls", "tests", "layers", "syncs", "known", "allowed")
    return {k: (v if k == "layers" else int(v)) for k, v in zip(keys, m.groups())}


@pytest.fixture(scope="module")
def clean_run(vllm_tests, tmp_path_factory):
    """vLLM's builder tests under the flag, on two xdist workers: (process, report)."""
    report = tmp_path_factory.mktemp("clean") / "report.json"
    proc = run_pytest(vllm_tests, KPOOL, PCP, MLA, "--sync-vllm", "-n", "2", f"--sync-report={report}")
    return proc, json.loads(report.read_text()) if report.exists() else {}


def test_vllms_own_tests_run_unedited_with_nothing_exported_and_every_build_checked(clean_run):
    assert not any(k in clean_env() for k in CPU_ENV)
    proc, report = clean_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    got = summary(proc)
    assert got["calls"] > 0 and got["syncs"] == 0 and got["layers"] == "sentinel", got
    calls = report["vllm"]["calls"]  # the workers' calls, counted on the controller
    assert len([c for c in calls if not c.get("unchecked")]) == got["calls"]
    assert len({c["test"] for c in calls if not c.get("unchecked")}) == got["tests"]
    builders = {c["builder"].rsplit(".", 1)[1] for c in calls}
    assert {"KpoolTailMetadataBuilder", "DeepseekV32IndexerMetadataBuilder",
            "_NonCausalMLAMetadataBuilder"} <= builders
    for c in calls:
        assert c["test"].startswith("tests/v1/attention/")
        assert c["called_at"].startswith("tests/v1/attention/")
        assert set(c) >= {"builder", "called_at", "layers", "records", "unwatched"}
    twins = [c for c in calls if c["unwatched"]]  # vLLM's PCP test passes seq_lens as its own twin
    assert twins and all(c["layers"] == ["sentinel"] for c in twins)


def test_the_ini_option_and_dash_p_without_autoload_work_as_the_flag(vllm_tests):
    by_ini = run_pytest(vllm_tests, KPOOL, "-o", "sync_vllm=true")
    assert by_ini.returncode == 0, by_ini.stdout[-3000:]
    assert summary(by_ini)["calls"] > 0
    by_p = run_pytest(vllm_tests, KPOOL, "--sync-vllm", "-p", "vllm_sparse_sync.testing.plugin",
                      env=clean_env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))
    assert by_p.returncode == 0, by_p.stdout[-3000:] + by_p.stderr[-3000:]
    assert summary(by_p)["calls"] == summary(by_ini)["calls"]


def _source_of(module: str) -> str:
    import importlib

    return inspect.getsource(importlib.import_module(module))


PLANTS = {
    # module, the line to plant before, the tests that reach it
    "indexer builders": ("vllm.v1.attention.backends.mla.indexer",
                         "slot_mapping = common_attn_metadata.slot_mapping", (KPOOL, PCP)),
    "MLA builder": ("vllm.model_executor.layers.attention.mla_attention",
                    "block_table_tensor = common_attn_metadata.block_table_tensor", (MLA,)),
}
READ = "_planted = int(common_attn_metadata.slot_mapping.max())  # PLANTED host read"


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_read_planted_in_a_builder_fails_the_tests_that_reach_it_naming_its_line(vllm_tests, clean_run,
                                                                                   name):
    import planting

    module, before, targets = PLANTS[name]
    _, lines = planting.plant(_source_of(module), before, READ)
    path = module.replace(".", "/") + ".py"
    reaching = {c["test"] for c in clean_run[1]["vllm"]["calls"]
                if not c.get("unchecked") and c["test"].startswith(tuple(t.split("::")[0] for t in targets))}
    assert reaching
    proc = run_pytest(vllm_tests, *targets, "--sync-vllm",
                      env=clean_env(VSS_PLANT_MODULE=module, VSS_PLANT_BEFORE=before, VSS_PLANT_LINE=READ) | {
                          "PYTEST_ADDOPTS": "-p planting"})
    assert proc.returncode == 1, proc.stdout[-3000:]
    failed = set(re.findall(r"^FAILED (\S+)", proc.stdout, re.M))
    assert failed == reaching, (failed, reaching)
    named = {int(n) for n in re.findall(re.escape(path) + r":(\d+) in build: _planted = ", proc.stdout)}
    assert named and named <= set(lines), (named, lines)
    assert "HostSyncError" in proc.stdout and "# PLANTED host read" in proc.stdout


DCP_PREFILL = """
from vllm_sparse_sync.vllm import make_vllm_case


def test_dcp_prefill_build():
    make_vllm_case("dcp2-prefill").build()
"""
KNOWN_BEFORE = "local_total_seq_lens = int(local_cu_seq_lens[-1].item())"


@pytest.mark.parametrize("inserted, new_reads", [
    ("_shifted_by_a_patch_release = None", 0),
    ("_new = int(local_cu_seq_lens.sum().item())  # a new read in the same function", 1),
])
def test_a_line_inserted_above_the_known_reads_leaves_them_known(tmp_path, inserted, new_reads):
    import planting

    (tmp_path / "test_dcp_prefill.py").write_text(DCP_PREFILL)
    source = _source_of("vllm.v1.attention.backends.mla.indexer")
    planted, (line,) = planting.plant(source, KNOWN_BEFORE, inserted)
    proc = run_pytest(tmp_path, "--sync-vllm", env=clean_env(
        VSS_PLANT_MODULE="vllm.v1.attention.backends.mla.indexer", VSS_PLANT_BEFORE=KNOWN_BEFORE,
        VSS_PLANT_LINE=inserted, PYTEST_ADDOPTS="-p planting"))
    got = summary(proc)
    assert (got["known"], got["syncs"]) == (2, new_reads), proc.stdout[-3000:]
    shown = [int(n) for n in re.findall(r"known upstream read at \S+indexer\.py:(\d+) in "
                                        r"build_prefill_chunk_metadata", proc.stdout)]
    assert shown == [line + 1, line + 2]  # today's lines, one below the inserted one
    assert proc.returncode == (1 if new_reads else 0), proc.stdout[-3000:]
    if new_reads:
        assert f"indexer.py:{line} in build_prefill_chunk_metadata: _new = " in proc.stdout


def test_a_run_that_checks_no_build_fails_unless_it_opts_out(vllm_tests):
    proc = run_pytest(vllm_tests, NO_BUILDS, "--sync-vllm", "-n", "2")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "no vLLM attention-metadata build() was checked in this run (no test built one)" in proc.stdout
    assert re.search(r"\d+ passed", proc.stdout)  # vLLM's own tests passed: the run fails anyway
    skip = run_pytest(vllm_tests, NO_BUILDS, "--sync-vllm", "--sync-unavailable=skip")
    assert skip.returncode == 0 and "(accepted: --sync-unavailable=skip)" in skip.stdout


def test_a_plugin_loaded_after_a_conftest_imports_vllm_says_what_to_pass(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import vllm.platforms  # imported before the plugin can act
        vllm.platforms.current_platform  # and the platform resolved
        pytest_plugins = ["vllm_sparse_sync.testing.plugin"]
    """))
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    proc = run_pytest(tmp_path, "--sync-vllm", env=clean_env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "loaded after the conftests that import vLLM" in out
    assert "-p vllm_sparse_sync.testing.plugin" in out and EXPORT in out


def test_vllm_imported_before_the_first_conftest_is_refused_saying_what_to_export(tmp_path):
    (tmp_path / "imports_vllm_early.py").write_text("import vllm  # a plugin that imports vLLM\n")
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    proc = run_pytest(tmp_path, "-p", "imports_vllm_early", "--sync-vllm",
                      env=clean_env(PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)])))
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "vLLM was imported before pytest loaded its first conftest" in out
    assert f"Start pytest with {EXPORT} exported" in out
