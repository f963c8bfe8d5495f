"""vLLM 0.33's own `DeepseekV32IndexerMetadataBuilder` under the harness, on every path it has.

Skipped where vLLM is not installed (the project's main CI). Run in a vLLM environment with
``python -m pytest tests/vllm -p vllm_sparse_sync.testing.plugin``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import types

import pytest
import torch

V = pytest.importorskip("vllm_sparse_sync.vllm", reason="needs vLLM: pip install \"vllm-sparse-sync[vllm]\"")

from vllm.v1.attention.backends.mla import indexer  # noqa: E402
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402

from vllm_sparse_sync.testing import HostSyncError, no_host_sync  # noqa: E402

DEVICE = "cuda" if V.cuda_device_present() else "cpu"
PREFILL_ONLY = {"prefill", "dcp2-prefill"}
DECODE_PATHS = [p for p in V.VLLM_PATHS if p not in PREFILL_ONLY]
# Real host reads of device data in vLLM 0.33's build(), found by the sentinel.
VLLM_HOST_READS = {
    "dcp2-prefill": (
        "vLLM 0.33 reads device data on the host in the DCP prefill branch: "
        "indexer.py:1895 int(local_cu_seq_lens[-1].item()) and indexer.py:1896 "
        "int(local_seq_lens.sum(dim=0).max().item()) in build_prefill_chunk_metadata "
        "(called from build(), indexer.py:1558); both derive from the device seq_lens"
    ),
}


def case_of(path: str, batch: int = 4, seed: int = 0):
    return V.make_vllm_case(path, batch=batch, seed=seed, device=DEVICE)


def sync_free_param(path: str):
    reason = VLLM_HOST_READS.get(path)
    marks = [pytest.mark.xfail(raises=HostSyncError, strict=True, reason=reason)] if reason else []
    return pytest.param(path, marks=marks)


@pytest.mark.parametrize("path", V.VLLM_PATHS)
def test_case_builds(path):
    case = case_of(path)
    meta = case.builder.build(common_prefix_len=0, common_attn_metadata=case.common)  # no stand-in needed
    assert case.path == path
    assert meta.num_decodes == case.num_decodes
    assert meta.num_decodes + meta.num_prefills == case.common.num_reqs
    assert (meta.decode is None) == (path in PREFILL_ONLY)
    assert (meta.prefill is None) == (case.num_decodes == case.common.num_reqs)


@pytest.mark.parametrize("path", [sync_free_param(p) for p in V.VLLM_PATHS])
def test_build_is_sync_free(path):
    case = case_of(path)
    case.build()  # warm-up: first launches, caches
    with no_host_sync(watch=V.vllm_watch(case), layers="sentinel"):
        case.build()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_build_is_sync_free_across_batches(path, seed):
    case = case_of(path, batch=3 + 2 * seed, seed=seed)
    with no_host_sync(watch=V.vllm_watch(case), layers="sentinel"):
        case.build()
        case.build()  # buffers written by one build() and read by the next stay watched


def test_planted_host_read_is_caught_at_its_line():
    case = case_of("decode")
    case.build()

    def build_with_planted_read():
        bound = int(case.common.seq_lens.max().item())  # the planted host read
        case.build()
        return bound

    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=V.vllm_watch(case), layers="sentinel"):
            build_with_planted_read()
    lines, first = inspect.getsourcelines(build_with_planted_read)
    line = first + next(i for i, text in enumerate(lines) if ".item()" in text)
    here = f"{os.path.basename(__file__)}:{line}"
    assert [r for r in err.value.records if r.location.endswith(here)], str(err.value)
    assert "indexer.py" not in str(err.value)  # vLLM's own decode build() read nothing


@pytest.mark.parametrize("path", ["decode", "mtp-flattened-ragged", "dcp2-mtp", "compressed-c4"])
def test_host_read_of_builder_output_is_caught(path):
    case = case_of(path)
    case.build()
    with pytest.raises(HostSyncError, match="scalar_read"):
        with no_host_sync(watch=V.vllm_watch(case), layers="sentinel"):
            meta = case.build()
            assert meta.decode is not None
            int(meta.decode.seq_lens.max())  # decode rows vLLM built (builder buffers or batch views)


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_exact_kernel_max_is_vllms_longest_decode_row(path):
    case = case_of(path, batch=5, seed=3)
    meta = case.build()
    assert meta.decode is not None
    vllm_rows = meta.decode.seq_lens.reshape(-1)[: meta.num_decode_tokens]
    assert V.exact_kernel_max(case) == int(vllm_rows.max())  # read after build(), outside a check


@pytest.mark.parametrize("path", V.VLLM_PATHS)
def test_vllm_bound_is_the_runner_bound(path):
    case = case_of(path)
    real = [s for s, q in zip(case.seq_lens, case.query_lens) if q > 0]
    assert V.vllm_bound(case) == case.common.max_seq_len == max(real)
    assert V.vllm_bound(case, capture=True) == case.max_model_len
    assert V.vllm_bound(case) >= V.exact_kernel_max(case)


def test_bound_is_in_uncompressed_tokens_on_compressed_layers():
    case = case_of("compressed-c4")
    assert case.compress_ratio == 4
    assert V.exact_kernel_max(case) == V.vllm_bound(case) // 4


def test_prefill_only_batches_have_no_decode_rows():
    for path in PREFILL_ONLY:
        assert V.exact_kernel_max(case_of(path)) == 0


def test_device_fields_are_not_their_host_twins():
    for path in V.VLLM_PATHS:
        common = case_of(path).common
        for name in ("query_start_loc", "seq_lens", "dcp_local_seq_lens"):
            dev = getattr(common, name)
            twin = getattr(common, f"{name}_cpu", None)
            if twin is None:
                twin = getattr(common, f"{name}_cpu_upper_bound", None)
            if dev is None:
                continue
            assert twin is not None, (path, name)
            assert dev.untyped_storage().data_ptr() != twin.untyped_storage().data_ptr(), (path, name)
            assert torch.equal(dev.cpu(), twin), (path, name)


def test_watch_is_complete():
    case = case_of("dcp2-mtp")
    watched = {id(t) for t in V.vllm_watch(case)}
    builder_tensors = {k for k, v in vars(case.builder).items() if isinstance(v, torch.Tensor)}
    assert builder_tensors and all(id(getattr(case.builder, k)) in watched for k in builder_tensors)
    for f in dataclasses.fields(case.common):
        value = getattr(case.common, f.name)
        if isinstance(value, torch.Tensor):
            assert (id(value) in watched) == ("cpu" not in f.name.split("_")), f.name


def test_watch_skips_vllm_host_fields_and_buffer_host_sides():
    case = case_of("decode")
    n = case.common.num_reqs
    common = case.common.replace(is_prefilling=torch.zeros(n, dtype=torch.bool),
                                 rswa_prefix_lens=torch.ones(n, dtype=torch.int32))
    buf = CpuGpuBuffer(n, dtype=torch.int32, device=torch.device(DEVICE), pin_memory=False)
    holder = types.SimpleNamespace(lens=buf)
    watched = {id(t) for t in V.vllm_watch(common, holder)}
    assert id(common.seq_lens) in watched and id(buf.gpu) in watched
    assert {id(common.is_prefilling), id(common.rswa_prefix_lens), id(buf.cpu)}.isdisjoint(watched)


def test_dcp_group_is_patched_only_where_asked():
    original = indexer.get_dcp_group
    case = case_of("dcp2-rank1")
    assert indexer.get_dcp_group is original
    assert (case.builder.dcp_rank, case.builder.dcp_world_size) == (1, 2)
    with V.dcp_group(1, 2):
        assert indexer.get_dcp_group().rank_in_group == 1
    assert indexer.get_dcp_group is original


def test_unreachable_unknown_and_impossible_cases_are_refused():
    for path, why in V.UNREACHABLE_PATHS.items():
        with pytest.raises(V.UnreachablePath, match="cannot be reached on a CPU host") as err:
            V.make_vllm_case(path)
        assert why in str(err.value)
    with pytest.raises(ValueError, match="unknown"):
        V.make_vllm_case("no-such-path")
    with pytest.raises(ValueError, match="batch >= 2"):
        V.make_vllm_case("mtp-native-ragged", batch=1)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU process setup only")
def test_prepare_cpu_process_is_idempotent():
    V.prepare_cpu_process()
    V.prepare_cpu_process()
    assert all(os.environ.get(k) == v for k, v in V.CPU_ENV.items())


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU process setup only")
def test_prepare_cpu_process_refuses_a_process_set_up_otherwise(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.platforms",
                        types.SimpleNamespace(_current_platform=types.SimpleNamespace(device_type="cuda")))
    with pytest.raises(RuntimeError, match="cuda"):
        V.prepare_cpu_process()
    monkeypatch.undo()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        V.prepare_cpu_process()


def test_a_device_field_passed_as_its_host_twin_is_left_out_and_named():
    case = case_of("decode")
    common = case.common.replace(query_start_loc=case.common.query_start_loc_cpu)  # as vLLM's tests do
    watch = V.vllm_watch(common)
    watched = {id(t) for t in watch}
    assert id(common.query_start_loc) not in watched and id(common.seq_lens) in watched
    assert watch.unwatched == ("CommonAttentionMetadata.query_start_loc "
                               "(storage of CommonAttentionMetadata.query_start_loc_cpu)",)
    case.build()
    with pytest.raises(HostSyncError, match="seq_lens"):  # the rest of the batch is still checked
        with no_host_sync(watch=watch, layers="sentinel") as check:
            case.builder.build(common_prefix_len=0, common_attn_metadata=common)
            int(common.seq_lens.max())
    assert check.unwatched == watch.unwatched
