"""The pytest plugin, exercised through pytester: fixtures, markers, options, report, summary."""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True, scope="module")
def _torch_lazy_imports_outside_inprocess_runs():
    """pytester drops the modules an in-process run imported, and torch imports torch._dynamo
    (and with it torch.distributed's op libraries) lazily on first use: imported again later,
    those libraries fail to register. Import it here, outside every in-process run."""
    import torch._dynamo  # noqa: F401

HEADER = """
import pytest
import torch
"""


def _run(pytester, body, *args):
    pytester.makepyfile(test_user=HEADER + body)
    return pytester.runpytest_inprocess(*args)


def test_fixture_raises_with_the_user_line(pytester):
    result = _run(pytester, """
def test_regression(no_host_sync):
    seq_lens = torch.tensor([3, 7], dtype=torch.int32)
    with no_host_sync(watch=[seq_lens]):
        bound = int(seq_lens.max().item())  # injected
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*HostSyncError*1 host sync record(s)*",
        "*[[]sentinel[]] scalar_read Tensor.item at test_user.py:7 in test_regression*injected*",
    ])


def test_clean_fixture_passes_and_summary_lists_counts(pytester):
    result = _run(pytester, """
def test_clean(no_host_sync):
    x = torch.arange(4)
    with no_host_sync(watch=[x]):
        torch.cumsum(x, 0)

def test_recorded(sync_recorder):
    x = torch.arange(4)
    with sync_recorder(watch=[x]) as rec:
        x.tolist()
        x.nonzero()
    assert rec.counts == {"d2h_copy": 1, "data_dependent_shape": 1}

def test_untouched():
    pass
""", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([
        "*host sync summary*",
        "test_user.py::test_clean: 0 sync record(s) [[]none[]] layers=*sentinel",
        "test_user.py::test_recorded: 2 sync record(s) [[]d2h_copy=1, data_dependent_shape=1[]]*",
        "2 test(s) checked, 2 sync record(s) in total",
    ])
    assert "test_untouched:" not in result.stdout.str()
    quiet = pytester.runpytest_inprocess()  # a green run: the totals only
    quiet.assert_outcomes(passed=3)
    quiet.stdout.fnmatch_lines(["*host sync summary*", "2 test(s) checked, 2 sync record(s) in total"])
    assert "test_recorded:" not in quiet.stdout.str()


def test_marker_budget_applies_to_fixture_and_recorder(pytester):
    result = _run(pytester, """
@pytest.mark.host_sync_budget(1)
def test_within(no_host_sync):
    x = torch.arange(4)
    with no_host_sync(watch=[x]):
        x.tolist()

@pytest.mark.host_sync_budget(1)
def test_over(no_host_sync):
    x = torch.arange(4)
    with no_host_sync(watch=[x]):
        x.tolist()
        int(x[0])

@pytest.mark.host_sync_budget(2)
def test_recorder_total_over(sync_recorder):
    x = torch.arange(4)
    for _ in range(3):
        with sync_recorder(watch=[x]):
            x.tolist()

@pytest.mark.host_sync_budget(n=3, kinds=["d2h_copy"])
def test_kinds_other_kind_fails(sync_recorder):
    x = torch.arange(4)
    with sync_recorder(watch=[x]):
        x.tolist()
        x.nonzero()

@pytest.mark.host_sync_budget(n=3, kinds=["d2h_copy"])
def test_kinds_within(sync_recorder):
    x = torch.arange(4)
    with sync_recorder(watch=[x]):
        x.tolist()
        x.cpu()
""")
    result.assert_outcomes(passed=2, failed=3)
    out = result.stdout.str()
    assert "test_over - " in out or "FAILED test_user.py::test_over" in out
    result.stdout.fnmatch_lines([
        "*FAILED test_user.py::test_over*",
        "*FAILED test_user.py::test_recorder_total_over*",
        "*FAILED test_user.py::test_kinds_other_kind_fails*",
    ])
    assert "sentinel: 3 syncs > budget 2" in out
    assert "data_dependent_shape > budget 0 (kind not allowed)" in out


def test_sync_report_file(pytester):
    report = pytester.path / "out" / "syncs.json"
    result = _run(pytester, """
def test_one(sync_recorder):
    x = torch.arange(4)
    with sync_recorder(watch=[x]):
        x.tolist()
        bool(x[0])

def test_two(no_host_sync):
    x = torch.arange(4)
    with no_host_sync(watch=[x]):
        x + 1
""", f"--sync-report={report}")
    result.assert_outcomes(passed=2)
    data = json.loads(report.read_text())["tests"]
    assert set(data) == {"test_user.py::test_one", "test_user.py::test_two"}
    one = data["test_user.py::test_one"]
    assert one["counts"] == {"d2h_copy": 1, "scalar_read": 1}
    assert [r["op"] for r in one["records"]] == ["Tensor.tolist", "Tensor.__bool__"]
    assert one["records"][0]["location"].endswith("test_user.py:7")
    assert one["records"][0]["layer"] == "sentinel"
    assert data["test_user.py::test_two"]["records"] == []


def test_report_and_summary_under_xdist(pytester):
    report = pytester.path / "syncs.json"
    pytester.makepyfile(test_user=HEADER + """
@pytest.mark.parametrize("i", range(4))
def test_many(sync_recorder, i):
    x = torch.arange(4)
    with sync_recorder(watch=[x]):
        for _ in range(i):
            x.tolist()
""")
    result = pytester.runpytest_subprocess("-n", "2",
                                           f"--sync-report={report}")
    result.assert_outcomes(passed=4)
    data = json.loads(report.read_text())["tests"]
    assert {k: len(v["records"]) for k, v in data.items()} == {
        f"test_user.py::test_many[{i}]": i for i in range(4)}
    result.stdout.fnmatch_lines(["4 test(s) checked, 6 sync record(s) in total"])


def test_sync_layers_option_selects_layers(pytester):
    result = _run(pytester, """
def test_layers(no_host_sync):
    x = torch.arange(4)
    with no_host_sync(watch=[x]) as check:
        x.tolist()
""", "--sync-layers=sentinel")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_layers: 1 sync record(s)*layers=sentinel*"])


def _cpu_only():
    from vllm_sparse_sync.testing.cuda_env import no_cuda_reason

    if no_cuda_reason() is None:
        pytest.skip("this host has CUDA: debug_mode runs")


VACUOUS = """
def test_layers(no_host_sync):
    x = torch.arange(4)
    with no_host_sync(watch=[x]) as check:
        x.tolist()
"""


def test_sync_layers_that_cannot_run_here_fail_the_test_not_pass_it(pytester):
    _cpu_only()
    result = _run(pytester, VACUOUS, "--sync-layers=debug_mode")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "vllm-sparse-sync: layers none (not here: debug_mode: torch*without CUDA*",
        "*SyncCheckUnavailable: no sync detection layer can run here*",
        "*debug_mode: torch * is built without CUDA*",
    ])
    assert "HostSyncError" not in result.stdout.str()


def test_sync_unavailable_skip_turns_it_into_a_skip_with_the_reason(pytester):
    _cpu_only()
    result = _run(pytester, VACUOUS, "--sync-layers=debug_mode", "--sync-unavailable=skip", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*no sync detection layer can run here*"])
    pytester.makeini("[pytest]\nsync_unavailable = skip\n")
    result = pytester.runpytest_inprocess("--sync-layers=debug_mode")
    result.assert_outcomes(skipped=1)
    result = pytester.runpytest_inprocess("--sync-layers=debug_mode", "--sync-unavailable=error")
    result.assert_outcomes(failed=1)


def test_nothing_watched_on_a_cpu_host_fails(pytester):
    _cpu_only()
    result = _run(pytester, """
def test_nothing(no_host_sync, sync_recorder):
    with no_host_sync():
        pass
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*sentinel: nothing watched*"])


def test_bad_sync_layers_value_is_a_usage_error(pytester):
    pytester.makepyfile(test_user="def test_x():\n    pass\n")
    result = pytester.runpytest_inprocess("--sync-layers=bogus")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out = result.stdout.str() + result.stderr.str()
    assert "--sync-layers: unknown sync layer 'bogus'; known: runtime_api, debug_mode" in out
    assert "INTERNALERROR" not in out
    result = pytester.runpytest_inprocess("--sync-unavailable=maybe")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


GPU_AND_ENV = """
import os

@pytest.mark.gpu
def test_marked_gpu():
    with open(os.path.join(os.environ["VSS_OUT"], "gpu_ran"), "w") as f:
        f.write("yes")

def test_reads_visible_devices():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(os.environ["VSS_OUT"], worker), "w") as f:
        f.write(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
"""


def _seen(path):
    return {p.name: p.read_text() for p in path.iterdir()}


def test_installing_the_package_changes_nothing_until_asked(pytester, monkeypatch):
    """A scratch project: a `gpu`-marked test and a test that reads CUDA_VISIBLE_DEVICES run as
    they would without the package (no skip, no pinning, no header, no warning filters)."""
    out = pytester.mkdir("out")
    monkeypatch.setenv("VSS_OUT", str(out))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pytester.makeini("[pytest]\nmarkers =\n    gpu: the project's own marker\n")
    pytester.makepyfile(test_user=HEADER + GPU_AND_ENV + """
import warnings

def test_prototype_warning_is_not_filtered():
    warnings.warn("Synchronization debug mode is a prototype feature", UserWarning)
""")
    result = pytester.runpytest_subprocess("-n", "2", "-W", "error::UserWarning", "-p", "no:benchmark")
    result.assert_outcomes(passed=2, failed=1)
    assert "vllm-sparse-sync:" not in result.stdout.str()
    seen = _seen(out)
    assert seen.pop("gpu_ran") == "yes"
    assert list(seen.values()) == ["0,1"]  # the worker's environment, untouched


def test_opting_in_pins_workers_and_skips_gpu_tests_without_cuda(pytester, monkeypatch):
    from vllm_sparse_sync.testing.cuda_env import no_cuda_reason

    out = pytester.mkdir("out")
    monkeypatch.setenv("VSS_OUT", str(out))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pytester.makeini("[pytest]\nsync_gpu_marker = true\n")
    pytester.makepyfile(test_user=HEADER + GPU_AND_ENV)
    result = pytester.runpytest_subprocess("-n", "2", "-rs", "--sync-pin-gpus", "-p", "no:benchmark")
    seen = _seen(out)
    if no_cuda_reason() is not None:
        result.assert_outcomes(passed=1, skipped=1)
        result.stdout.fnmatch_lines(["*SKIPPED*gpu test: *CUDA*"])
        assert "gpu_ran" not in seen
    seen.pop("gpu_ran", None)
    assert list(seen.values())[0] in ("0", "1")  # pinned to one of the two


def test_sync_backend_option_deselects_other_backends(pytester):
    result = _run(pytester, """
@pytest.mark.parametrize("name", [
    pytest.param("b12x-compressed", marks=pytest.mark.sync_backend("b12x")),
    pytest.param("deepgemm-compressed", marks=pytest.mark.sync_backend("deepgemm")),
    "capture",
])
def test_scenario(name):
    assert name != "deepgemm-compressed"
""", "--sync-backend=b12x")
    result.assert_outcomes(passed=2, deselected=1)


def test_prototype_and_profiler_warnings_filtered_under_W_error_when_asked(pytester):
    pytester.makeini("[pytest]\nsync_filter_warnings = true\n")
    result = _run(pytester, """
import warnings

def test_prototype():
    warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                  "detect all synchronizing operations", UserWarning)

def test_other_warnings_still_error():
    warnings.warn("something else", UserWarning)
""", "-W", "error", "-p", "no:benchmark")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAILED*test_other_warnings_still_error*"])


def test_plugin_registered_through_entry_point(pytester):
    pytester.makepyfile(test_user="def test_x(no_host_sync, sync_recorder):\n    pass\n")
    result = pytester.runpytest_subprocess("--sync-layers=sentinel")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["vllm-sparse-sync: layers sentinel*"])


def test_plugin_loadable_with_dash_p(pytester, monkeypatch):
    """`-p vllm_sparse_sync.testing.plugin` works beside the entry point and without it."""
    pytester.makepyfile(test_user="def test_x(no_host_sync):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "vllm_sparse_sync.testing.plugin")
    result.assert_outcomes(passed=1)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_subprocess("-p", "vllm_sparse_sync.testing.plugin", "-p", "xdist")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)  # no plugin, no fixture


def test_a_budget_marker_on_a_test_without_fixtures_is_not_a_vacuous_pass(pytester):
    _cpu_only()
    result = _run(pytester, """
@pytest.mark.host_sync_budget(1)
def test_budget_only():
    torch.arange(3).tolist()
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*SyncCheckUnavailable*"])


def test_an_in_process_run_leaves_the_process_wide_settings_as_it_found_them(pytester):
    from vllm_sparse_sync.testing.guard import default_layer_spec
    from vllm_sparse_sync.testing.known import known_reads

    before = (default_layer_spec(), known_reads())
    pytester.makeconftest(
        "from vllm_sparse_sync.testing.known import KnownRead, accept_known_reads\n"
        "def pytest_configure(config):\n"
        "    accept_known_reads([KnownRead('inner.py', 'f', code='x.item()', why='the inner run only')])\n")
    pytester.makepyfile(test_user="def test_x():\n    pass\n")
    result = pytester.runpytest_inprocess("--sync-layers=sentinel")
    result.assert_outcomes(passed=1)
    assert (default_layer_spec(), known_reads()) == before
