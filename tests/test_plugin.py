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
""")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([
        "*host sync summary*",
        "test_user.py::test_clean: 0 sync record(s) [[]none[]] layers=*sentinel",
        "test_user.py::test_recorded: 2 sync record(s) [[]d2h_copy=1, data_dependent_shape=1[]]*",
        "2 test(s) checked, 2 sync record(s) in total",
    ])
    assert "test_untouched:" not in result.stdout.str()


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
        "vllm-sparse-sync: layers=debug_mode (cannot run here: debug_mode: torch*without CUDA*",
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


def test_gpu_marker_skips_with_a_reason_without_cuda(pytester):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    result = _run(pytester, """
@pytest.mark.gpu
def test_needs_gpu():
    raise AssertionError("must not run")
""", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*gpu test: *CUDA*"])


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


def test_prototype_and_profiler_warnings_filtered_under_W_error(pytester):
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
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["vllm-sparse-sync: layers=auto*"])


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
