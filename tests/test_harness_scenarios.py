"""Every decode scenario passes the harness; the old regression line is caught and named."""

from __future__ import annotations

import pytest
import torch

from vllm_sparse_sync.testing import HostSyncError, check_step, decode_graph, no_host_sync
from vllm_sparse_sync.testing import scenarios as S

LEGACY_LINE = "int(seq_lens.max().item())"


@pytest.mark.parametrize("name", S.params())
def test_builder_never_reads_device_values_on_the_host(name, no_host_sync):
    sc = S.make_scenario(name, "cpu")
    sc.build()
    with no_host_sync(watch=sc.watch, layers="sentinel"):
        meta = sc.build()
    assert meta.bound.value >= int(meta.row_lens.max())


@pytest.mark.parametrize("name", S.params())
def test_step_matches_the_reference_on_cpu(name):
    sc = S.make_scenario(name, "cpu")
    out = sc.step()
    assert torch.equal(out, sc.reference())
    sc.set_lengths(9)
    assert torch.equal(sc.step(), sc.reference())


def test_legacy_builder_fails_under_the_sentinel_and_names_the_line():
    sc = S.make_scenario("b12x-uncompressed", "cpu").with_legacy_sync()
    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=sc.watch):
            sc.build()
    msg = str(err.value)
    assert LEGACY_LINE in msg and "metadata.py" in msg and "_legacy_bound" in msg
    assert [r.kind for r in err.value.records] == ["scalar_read"]


def test_scenario_names_follow_the_audit_paths():
    assert S.NAMES == (
        "b12x-compressed", "b12x-uncompressed", "b12x-uncompressed-dcp2",
        "b12x-uncompressed-async-spec", "deepgemm-compressed", "deepgemm-uncompressed",
        "deepgemm-uncompressed-async-spec", "deepgemm-uncompressed-no-shadow", "mtp-ragged", "capture")
    assert S.backend_of("mtp-ragged") == "b12x" and S.backend_of("capture") == "deepgemm"
    with pytest.raises(ValueError, match="unknown scenario"):
        S.make_scenario("nope", "cpu")


# ---------------------------------------------------------------------------- GPU


def _topk_close(out, ref):
    """Same top-k sets per row, up to a boundary flip or two (fp32 order differences)."""
    got = out.cpu()
    for r in range(got.shape[0]):
        a = set(got[r][got[r] >= 0].tolist())
        b = set(ref[r][ref[r] >= 0].tolist())
        assert len(a) == len(b), f"row {r}: {len(a)} vs {len(b)} valid entries"
        assert len(a - b) <= 2, f"row {r}: {len(a - b)} indices differ from the reference"


@pytest.mark.gpu
@pytest.mark.parametrize("name", S.params())
def test_scenario_step_passes_every_layer_on_gpu(name):
    sc = S.make_scenario(name, "cuda")
    check = check_step(sc.step, watch=sc.watch, warmup=2)
    assert {"sentinel", "debug_mode", "runtime_api", "capture"} <= set(check.layer_names)
    assert check.records == []


@pytest.mark.gpu
@pytest.mark.parametrize("name", S.params())
def test_scenario_decode_graph_replays_like_eager(name):
    sc = S.make_scenario(name, "cuda")
    sc.build()
    meta = sc.capture_metadata()
    graph = decode_graph(lambda: sc.kernels(meta), inputs=sc.watch)
    assert graph.captured
    far = sc.path.layout.max_model_len

    def mutate(i):
        sc.set_lengths(37 * i)
        sc.builder.build(sc.batch)
        if i == 2:  # a live-window bound far above the live lengths
            sc.builder.active_width_buffer.fill_(far)

    results = graph.check_against_eager(mutate, cases=3, reference=sc.reference,
                                        compare=_topk_close)
    assert len(results) == 3


@pytest.mark.gpu
def test_legacy_builder_fails_debug_mode_and_capture_probe_naming_the_line():
    sc = S.make_scenario("b12x-uncompressed", "cuda").with_legacy_sync()
    with pytest.raises(HostSyncError) as err:
        check_step(sc.build, layers="debug_mode,capture")
    layers = {r.layer for r in err.value.records}
    assert layers == {"debug_mode", "capture"}
    for r in err.value.records:
        assert LEGACY_LINE in r.code and r.location.split(":")[0].endswith("metadata.py")
    assert LEGACY_LINE in str(err.value)
    torch.randn(4, device="cuda")  # the failed capture left the process usable
