"""The vLLM audit, the bound plugin and vLLM's allowed syncs, on vLLM 0.33's own builder.

Skipped where vLLM is not installed (the project's main CI); the `vllm` tox env runs them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

V = pytest.importorskip("vllm_sparse_sync.vllm", reason="needs vLLM: pip install \"vllm-sparse-sync[vllm]\"")

from vllm.v1.attention.backends.mla import indexer  # noqa: E402

from vllm_sparse_sync import vllm_plugin  # noqa: E402
from vllm_sparse_sync.bounds import BoundSource  # noqa: E402
from vllm_sparse_sync.cli import main  # noqa: E402
from vllm_sparse_sync.testing import HostSyncError, no_host_sync  # noqa: E402
from vllm_sparse_sync.vllm import audit as va  # noqa: E402

DECODE_PATHS = [p for p in V.VLLM_PATHS if p not in ("prefill", "dcp2-prefill")]
pytest_plugins = ["pytester"]


@pytest.fixture
def plugin():
    vllm_plugin.install(force=True)
    yield
    vllm_plugin.uninstall()


def test_the_audit_checks_every_path_and_accepts_only_the_known_upstream_reads():
    rows = va.run_vllm_audit(with_plugin=True, batches=1)
    by = {r.path: r for r in rows}
    assert set(by) == set(V.VLLM_PATHS)
    assert all(r.ok for r in rows), va.format_table(rows)
    assert by["dcp2-prefill"].known_sites == KNOWN_TODAY  # where the known reads are today
    assert all(not r.known_sites for p, r in by.items() if p != "dcp2-prefill")
    for p in DECODE_PATHS:
        r = by[p]
        assert r.exact_max <= r.bound <= r.vllm_bound and r.plugin_bound == r.bound, va.format_table(rows)
    assert by["compressed-c4"].plugin_bound * 3 < by["compressed-c4"].vllm_bound  # compressed rows
    assert by["dcp2-rank1"].bound_source == BoundSource.CPU_DCP_LOCAL.value
    table = va.format_table(rows)
    assert ("known upstream host read at vllm/v1/attention/backends/mla/indexer.py:1895 in "
            "build_prefill_chunk_metadata") in table


def _line_of(code: str) -> int:
    return inspect.getsource(indexer).splitlines().index(code) + 1


KNOWN_TODAY = [f"vllm/v1/attention/backends/mla/indexer.py:{_line_of(' ' * 8 + k.code)}"
               for k in va.BASELINE_033]


def test_without_the_baseline_the_upstream_reads_fail_the_row():
    (row,) = va.run_vllm_audit(["dcp2-prefill"], batches=1, baseline=[])
    assert not row.ok and "vllm/v1/attention/backends/mla/indexer.py:1895" in row.sites


# where a host read is planted in a copy of vLLM's indexer module: (anchor, read, a path that
# reaches it); the read goes right after the anchor
PLANTS = {
    "build-top": ("        dcp_local_seq_lens = common_attn_metadata.dcp_local_seq_lens\n",
                  "        _ = int(seq_lens.max().item())  # PLANTED\n", "decode"),
    "decode-branch": ("        if num_decodes > 0:\n",
                      "            _ = int(common_attn_metadata.seq_lens.max().item())  # PLANTED\n",
                      "mtp-native-uniform"),
    "prepare-decode-tensors": ('        """Prepare native or per-token flattened decode tensors."""\n',
                               "        _ = seq_lens.tolist()  # PLANTED\n", "mtp-flattened-ragged"),
    "compressed-slots": ("        compressed_slot_mapping = slot_mapping\n",
                         "        _ = bool(slot_mapping.sum() > 0)  # PLANTED\n", "compressed-c4"),
    "prefill-chunks": (") -> DeepseekV32IndexerPrefillChunkMetadata | None:\n",
                       "    _ = int(uncompressed_seq_lens.max())  # PLANTED\n", "prefill"),
}


def _plant(tmp_path, monkeypatch, name):
    """vLLM's indexer module copied with one host read planted; the real builder's methods
    replaced by the copy's (restored by monkeypatch). Returns the planted file:line."""
    anchor, read, _ = PLANTS[name]
    source = inspect.getsource(indexer)
    assert anchor in source, name
    planted = source.replace(anchor, anchor + read, 1)
    path = tmp_path / "indexer_planted.py"
    path.write_text(planted)
    spec = importlib.util.spec_from_file_location("vllm.v1.attention.backends.mla._indexer_planted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    copy = module.DeepseekV32IndexerMetadataBuilder
    for attr, value in vars(copy).items():  # methods without zero-argument super() (bound to the copy)
        if inspect.isfunction(value) and "__class__" not in value.__code__.co_freevars:
            monkeypatch.setattr(indexer.DeepseekV32IndexerMetadataBuilder, attr, value)
    line = planted.splitlines().index(read.rstrip("\n")) + 1
    return f"indexer_planted.py:{line}"


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_read_planted_anywhere_in_vllms_builder_fails_the_audit_and_the_harness(tmp_path, monkeypatch,
                                                                                    name):
    site = _plant(tmp_path, monkeypatch, name)
    path = PLANTS[name][2]
    (row,) = va.run_vllm_audit([path], batches=1)
    assert not row.ok and any(s.endswith(site) for s in row.sites), (site, row)
    assert main(["audit", "--target", "vllm", "--path", path, "--batches", "1"]) == 1
    case = V.make_vllm_case(path)
    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=case.watch()):
            case.build()
    assert site in str(err.value) and "# PLANTED" in str(err.value)


@settings(max_examples=25, deadline=None)
@given(path=st.sampled_from(DECODE_PATHS), batch=st.integers(2, 24), seed=st.integers(0, 10_000))
def test_the_plugin_bound_is_never_below_the_truth_and_never_above_vllms(path, batch, seed):
    case = V.make_vllm_case(path, batch=batch, seed=seed)
    vllm_plugin.install(force=True)
    try:
        meta = case.build()
    finally:
        vllm_plugin.uninstall()
    exact = V.exact_kernel_max(case)
    assert exact <= meta.max_seq_len <= V.vllm_bound(case)
    if case.compress_ratio > 1 or case.dcp_world_size > 1:
        assert meta.max_seq_len < V.vllm_bound(case) or exact == 0


def test_capture_and_async_spec_bounds_cover_every_row(plugin):
    case = V.make_vllm_case("compressed-c4", seed=3)
    case.common.max_seq_len = case.max_model_len  # what the runner passes while capturing
    meta = case.build()
    assert meta.max_seq_len == -(-case.max_model_len // 4)  # capture-stable, compressed rows
    mtp = V.make_vllm_case("mtp-native-uniform", seed=4)
    mtp.builder.vllm_config.scheduler_config.async_scheduling = True
    mtp.common.seq_lens_cpu_upper_bound += 1  # optimistic: every draft accepted
    mtp.common.max_seq_len += 1
    assert vllm_plugin.indexer_bound(mtp.builder, mtp.common, mtp.num_decodes).source is \
        BoundSource.METADATA_UPPER_BOUND
    assert mtp.build().max_seq_len >= V.exact_kernel_max(mtp)


def test_the_plugin_is_sync_free(plugin):
    for path in DECODE_PATHS:
        case = V.make_vllm_case(path, seed=5)
        case.build()
        with no_host_sync(watch=case.watch(), where=path):
            case.build()


def test_the_plugin_is_off_unless_asked_and_refuses_an_untested_vllm(monkeypatch, caplog):
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    vllm_plugin.register()
    assert not hasattr(indexer.DeepseekV32IndexerMetadataBuilder.build, "_vllm_sparse_sync_original")
    with pytest.raises(vllm_plugin.UnsupportedVllm, match="tested with vLLM 0.33.x, found 0.34.0"):
        vllm_plugin.check_vllm_version("0.34.0")
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setenv(vllm_plugin.ENV, "1")
    with vllm_log(caplog):
        vllm_plugin.register()
    assert "found 0.34.0: not loaded" in caplog.text
    assert not hasattr(indexer.DeepseekV32IndexerMetadataBuilder.build, "_vllm_sparse_sync_original")


def test_vllms_deliberate_syncs_are_allowed_not_failures():
    from vllm.v1.attention.backends.utils import make_local_attention_virtual_batches

    from vllm_sparse_sync.vllm.allowed import install_allowed_regions

    case = V.make_vllm_case("decode", seed=6)
    install_allowed_regions()
    with no_host_sync(watch=case.watch()) as check:
        make_local_attention_virtual_batches(128, case.common, block_size=64)
    allowed = [r for r in check.records if r.allowed]
    assert allowed and all("gpu_sync_allowed" in r.allowed for r in allowed)
    assert all("backends/utils.py" in r.location for r in allowed)


@pytest.mark.parametrize("argv, words", [
    (["audit", "--target", "vllm", "--path", "nope"], "--path: unknown path(s) nope; known: decode,"),
    (["audit", "--target", "vllm", "--device", "cpu"], "--device"),
    (["audit", "--target", "vllm", "--baseline", "/nonexistent.json"], "--baseline"),
    (["audit", "--with-plugin"], "--target vllm"),
])
def test_vllm_audit_usage_errors_are_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_vllm_missing_or_untested_is_one_line(monkeypatch, capsys):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert main(["audit", "--target", "vllm"]) == 2
    assert "vLLM is not installed" in capsys.readouterr().err
    monkeypatch.setattr(metadata, "version", lambda name: "0.35.1")
    assert main(["audit", "--target", "vllm"]) == 2
    assert "tested with vLLM 0.33.x, found 0.35.1" in capsys.readouterr().err


def test_a_vllm_developer_writes_one_test_and_nothing_else(pytester):
    pytester.makepyfile(test_vllm_user=textwrap.dedent("""
        def test_build(vllm_indexer_case, no_host_sync):
            vllm_indexer_case.build()
            with no_host_sync(watch=vllm_indexer_case.watch()):
                vllm_indexer_case.build()
    """))
    result = pytester.runpytest_subprocess("--sync-vllm", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=len(V.VLLM_PATHS))
    # every build is checked; vLLM's known upstream reads on the DCP prefill path are shown at
    # today's lines, accepted by the baseline
    result.stdout.fnmatch_lines([
        f"vLLM: {2 * len(V.VLLM_PATHS)} build() call(s) checked in {len(V.VLLM_PATHS)} test(s), "
        "layers sentinel: 0 host sync(s), 4 known upstream, 0 allowed",
        f"  known upstream read at *{KNOWN_TODAY[0]} in build_prefill_chunk_metadata (x2)",
        f"  known upstream read at *{KNOWN_TODAY[1]} in build_prefill_chunk_metadata (x2)",
    ])


def test_vllm_discovers_and_runs_the_plugin_through_its_entry_point(monkeypatch, caplog):
    from importlib.metadata import entry_points

    from vllm.plugins import load_plugins_by_group

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("vllm_sparse_sync_bounds") == "vllm_sparse_sync.vllm_plugin:register"
    monkeypatch.setenv(vllm_plugin.ENV, "1")
    hooks = load_plugins_by_group("vllm.general_plugins")
    with vllm_log(caplog):
        hooks["vllm_sparse_sync_bounds"]()
    # on this CPU platform the plugin declines, saying why (vLLM's CPU indexer reads max_seq_len
    # its own way), through vLLM's logger; on CUDA it wraps the builder
    assert "not loaded on platform CpuPlatform (device type 'cpu')" in caplog.text
    assert {r.name for r in caplog.records} == {vllm_plugin.LOGGER}
    assert not hasattr(indexer.DeepseekV32IndexerMetadataBuilder.build, "_vllm_sparse_sync_original")


@contextlib.contextmanager
def vllm_log(caplog):
    """caplog on vLLM's logger tree (vLLM's logging config does not propagate it to the root)."""
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=vllm_plugin.LOGGER):
            yield
    finally:
        vllm_logger.removeHandler(caplog.handler)


def test_the_refusal_names_a_platform_with_an_empty_device_type(monkeypatch, caplog):
    """A CUDA wheel on a host vLLM cannot place (no VLLM_TARGET_DEVICE) resolves a platform whose
    device type is empty: the line still names it."""
    import vllm.platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    monkeypatch.setattr(vllm.platforms, "_current_platform", UnspecifiedPlatform())
    monkeypatch.setenv(vllm_plugin.ENV, "1")
    with vllm_log(caplog):
        vllm_plugin.register()
    assert "not loaded on platform UnspecifiedPlatform (device type '')" in caplog.text
    assert not hasattr(indexer.DeepseekV32IndexerMetadataBuilder.build, "_vllm_sparse_sync_original")
