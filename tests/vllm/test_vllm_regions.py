"""Every vLLM attention-metadata build as a checked region (what `--sync-vllm` installs), in
process: builders defined before and after, one region per call, the watch taken from the call's
own batch, host twins left out and named, vLLM's allowed syncs and known reads accepted, nothing
passed as checked that was not, and the sparse indexer's forward where it runs.

Code under check lives in a module written to a temporary folder (not a test module): a sync in
a test's own code that a build runs is shown as the test's, not counted.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import textwrap
import types

import pytest
import torch

V = pytest.importorskip("vllm_sparse_sync.vllm", reason="needs vLLM: pip install \"vllm-sparse-sync[vllm]\"")

from vllm.v1.attention.backend import AttentionMetadataBuilder  # noqa: E402
from vllm.v1.attention.backends.mla.indexer import KpoolTailMetadataBuilder  # noqa: E402

from vllm_sparse_sync.testing import HostSyncError, no_host_sync  # noqa: E402
from vllm_sparse_sync.testing.guard import add_listener, remove_listener  # noqa: E402
from vllm_sparse_sync.testing.known import accept_known_reads, forget_known_reads, known_reads  # noqa: E402
from vllm_sparse_sync.vllm import regions  # noqa: E402
from vllm_sparse_sync.vllm.audit import BASELINE_033  # noqa: E402

_names = itertools.count()


@pytest.fixture
def checked():
    """Builder regions installed; yields the list of regions the test's calls made."""
    seen: list = []
    regions.install()
    add_listener(seen.append)
    try:
        yield seen
    finally:
        remove_listener(seen.append)
        regions.uninstall()


@pytest.fixture
def vendor(tmp_path):
    """Import `source` as a module of its own (a backend's code, not a test's)."""

    def load(source: str):
        name = f"vendor_backend_{next(_names)}"
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, path

    return load


PLANTED_BUILDER = """
    from vllm.v1.attention.backends.mla.indexer import KpoolTailMetadataBuilder


    class PlantedBuilder(KpoolTailMetadataBuilder):
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            bound = int(common_attn_metadata.seq_lens.max())  # PLANTED
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
"""


def _kpool(cls=KpoolTailMetadataBuilder):
    case = V.make_vllm_case("decode")
    builder = object.__new__(cls)  # as vLLM's tests build it: only what build() reads
    builder.kv_cache_spec = types.SimpleNamespace(block_size=64)
    builder.slot_mapping_buffer = torch.zeros(64, dtype=torch.int64)
    return builder, case.common


def _line(path, marker: str) -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text)


def test_each_build_is_one_region_watching_its_own_batch(checked):
    case = V.make_vllm_case("mtp-native-uniform")
    case.build()
    (region,) = checked
    assert region.info["kind"] == regions.BUILD and region.ran == ["sentinel"]
    assert region.info["builder"].endswith("DeepseekV32IndexerMetadataBuilder")
    assert re.search(r"vllm_sparse_sync/vllm/cases\.py:\d+$", region.info["called_at"])
    watched = {id(t) for t in region.watch}
    assert id(case.common.seq_lens) in watched and id(case.common.query_start_loc) in watched
    assert id(case.common.query_start_loc_cpu) not in watched
    assert id(case.builder.expanded_block_table_buffer) in watched  # the builder's buffers too
    assert region.records == [] and region.touched > 0


def test_a_builder_defined_after_install_is_checked_once_per_call(checked, vendor):
    mod, path = vendor(PLANTED_BUILDER)
    builder, common = _kpool(mod.PlantedBuilder)
    with pytest.raises(HostSyncError) as err:
        builder.build(0, common)
    assert len(checked) == 1  # super().build() is the same call
    (rec,) = err.value.records
    assert rec.location.endswith(f"{path.name}:{_line(path, '# PLANTED')}") and not rec.allowed
    assert "PlantedBuilder.build() from " in str(err.value)


def test_a_read_in_the_tests_own_stand_in_is_shown_not_counted(checked):
    class TestsOwn(KpoolTailMetadataBuilder):  # defined in this test module
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            int(common_attn_metadata.seq_lens.max())  # a test double's read
            return super().build(common_prefix_len, common_attn_metadata, fast_build)

    builder, common = _kpool(TestsOwn)
    builder.build(0, common)
    (rec,) = checked[0].records
    assert rec.allowed == regions.TEST_CODE and not rec.known


def test_a_field_passed_as_its_host_twin_is_left_out_named_and_the_rest_checked(checked, vendor):
    mod, path = vendor(PLANTED_BUILDER)
    builder, common = _kpool(mod.PlantedBuilder)
    common = common.replace(query_start_loc=common.query_start_loc_cpu)  # as vLLM's tests do
    with pytest.raises(HostSyncError, match="# PLANTED"):
        builder.build(0, common)
    (region,) = checked
    assert region.unwatched == ("query_start_loc (storage of query_start_loc_cpu)",)
    assert id(common.query_start_loc) not in {id(t) for t in region.watch}


def test_a_build_nothing_can_check_is_reported_not_passed(checked, vendor):
    mod, _ = vendor("""
        from vllm.v1.attention.backend import AttentionMetadataBuilder


        class HostOnly(AttentionMetadataBuilder):
            def __init__(self):
                pass

            def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
                return int(common_attn_metadata.seq_lens_cpu_upper_bound.max())
    """)
    twin = torch.tensor([3, 5])
    batch = types.SimpleNamespace(seq_lens=twin, seq_lens_cpu_upper_bound=twin)
    assert mod.HostOnly().build(0, batch) == 5
    (region,) = checked
    assert region.ran == [] and "nothing to watch" in region.info["unchecked"]


def test_vllms_allowed_syncs_are_allowed(checked, vendor):
    from vllm_sparse_sync.vllm.allowed import install_allowed_regions

    install_allowed_regions()
    mod, _ = vendor("""
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
        from vllm.v1.attention.backends.mla.indexer import KpoolTailMetadataBuilder


        class Deliberate(KpoolTailMetadataBuilder):
            def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
                with gpu_sync_allowed():
                    int(common_attn_metadata.seq_lens.max())  # deliberate
                return super().build(common_prefix_len, common_attn_metadata, fast_build)
    """)
    builder, common = _kpool(mod.Deliberate)
    builder.build(0, common)
    (rec,) = checked[0].records
    assert "gpu_sync_allowed" in rec.allowed and not rec.known


def test_the_known_reads_are_accepted_and_nothing_else(checked):
    case = V.make_vllm_case("dcp2-prefill")
    with pytest.raises(HostSyncError, match="indexer.py:.*int\\(local_cu_seq_lens"):
        case.build()  # no baseline: vLLM's DCP prefill reads fail the build
    before = known_reads()
    accept_known_reads(BASELINE_033)
    try:
        case.build()
    finally:
        forget_known_reads()
        accept_known_reads(before)
    assert [r.known for r in checked[-1].records] == [True, True]
    assert {r.function for r in checked[-1].records} == {"build_prefill_chunk_metadata"}


def test_a_no_host_sync_around_a_build_nests_and_the_build_raises_once(checked, vendor):
    mod, _ = vendor(PLANTED_BUILDER)
    builder, common = _kpool(mod.PlantedBuilder)
    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=[common.seq_lens]) as outer:
            builder.build(0, common)
    assert "PlantedBuilder.build()" in err.value.where
    assert len(err.value.records) == 1 and outer.records == []


def test_uninstall_puts_every_method_back():
    original = KpoolTailMetadataBuilder.__dict__["build"]
    hook = AttentionMetadataBuilder.__dict__.get("__init_subclass__")
    regions.install()
    assert KpoolTailMetadataBuilder.__dict__["build"] is not original
    regions.uninstall()
    assert KpoolTailMetadataBuilder.__dict__["build"] is original
    assert AttentionMetadataBuilder.__dict__.get("__init_subclass__") is hook

    class After(KpoolTailMetadataBuilder):
        def build(self, *args, **kwargs):
            return None

    assert not hasattr(After.__dict__["build"], "_vllm_sparse_sync_region")


def test_the_sparse_indexer_forward_is_a_region_where_it_runs(checked, vendor, monkeypatch):
    """forward_cuda (CUDA and XPU) runs vLLM's host-side setup, then its kernels: one region,
    watching the layer's metadata and inputs. Here with the op replaced by backend code that
    reads the decode lengths back."""
    import vllm.forward_context as fc
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    mod, path = vendor("""
        def sparse_attn_indexer(hidden_states, *args, **kwargs):
            from vllm.forward_context import get_forward_context

            meta = get_forward_context().attn_metadata["layer.indexer"]
            return int(meta.seq_lens.max().item())  # host-side setup reads device data
    """)
    meta = types.SimpleNamespace(seq_lens=torch.tensor([7, 9]), slot_mapping=torch.arange(2))
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context",
                        lambda: types.SimpleNamespace(attn_metadata={"layer.indexer": meta}))
    monkeypatch.setattr(torch.ops.vllm, "sparse_attn_indexer", mod.sparse_attn_indexer, raising=False)
    layer = types.SimpleNamespace(
        k_cache=types.SimpleNamespace(prefix="layer.indexer", kv_cache=torch.zeros(1)),
        quant_block_size=128, scale_fmt=None, topk_tokens=2048, head_dim=128, max_model_len=64,
        max_total_seq_len=64, topk_indices_buffer=torch.zeros(2, 4, dtype=torch.int32),
        skip_k_cache_insert=False, use_pcp=False, pcp_shard_decode_requests=False,
        dense_mha_metadata_layer_name="layer.attn", use_fp4_cache=False, dcp_rank=0, dcp_world_size=1,
        _parallel_config=types.SimpleNamespace(cp_kv_cache_interleave_size=1), candidate_blocks=None,
        candidate_block_size=0, candidate_write=False, topk_backend="auto")
    with pytest.raises(HostSyncError) as err:
        SparseAttnIndexer.forward_cuda(layer, torch.zeros(2, 8), torch.zeros(2, 8), None, torch.zeros(2, 1))
    (region,) = checked
    assert region.info["kind"] == regions.FORWARD
    (rec,) = err.value.records
    assert rec.location.endswith(f"{path.name}:{_line(path, 'host-side setup')}")
