"""What a new user meets first: every bad input is a ValueError or TypeError naming the field,
checked up front; the command line answers in one line with a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vllm_sparse_sync import (
    DecodeBatch,
    IndexerLayout,
    IndexerMetadataBuilder,
    IndexerStep,
    SeqLenShadow,
    kernels,
)
from vllm_sparse_sync.cli import main
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.synth import make_case

LAY = IndexerLayout(backend="b12x", topk=8, max_model_len=1024)
CAPS = dict(max_num_reqs=4, max_num_tokens=8, max_pages_per_req=16, device="cpu")


def _batch(**change):
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    lens = torch.tensor([100, 200], dtype=torch.int32)
    base = dict(query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=lens.clone(),
                shadow=SeqLenShadow(lens.clone()), block_table=torch.zeros(2, 16, dtype=torch.int32),
                max_seq_len=200)
    return DecodeBatch(**{**base, **change})


BUILD_ERRORS = [
    (lambda: SeqLenShadow(torch.tensor([5]), authoritative="no"), TypeError, "authoritative"),
    (lambda: SeqLenShadow([5, 6]), TypeError, "seq_lens_cpu"),
    (lambda: IndexerMetadataBuilder(None, **CAPS), TypeError, "layout"),
    (lambda: IndexerMetadataBuilder(LAY, legacy_device_sync="no", **CAPS), TypeError, "legacy_device_sync"),
    (lambda: IndexerMetadataBuilder(LAY, check_bound=1, **CAPS), TypeError, "check_bound"),
    (lambda: IndexerLayout(backend="b12x", page_size=48, max_model_len=1024), ValueError, "page_size"),
    (lambda: IndexerLayout(backend="b12x", cp_interleave=128, dcp_world_size=2, max_model_len=1024),
     ValueError, "cp_interleave"),
    (lambda: IndexerLayout(backend="b12x", cp_interleave=24, max_model_len=1024),
     ValueError, "cp_interleave"),
    (lambda: IndexerMetadataBuilder(LAY, **CAPS).build(None), TypeError, "batch"),
    (lambda: IndexerMetadataBuilder(LAY, **CAPS).build(_batch(shadow="x")), TypeError, "shadow"),
    (lambda: IndexerMetadataBuilder(LAY, **CAPS).build(_batch(max_seq_len=200.0)), TypeError, "max_seq_len"),
    (lambda: IndexerMetadataBuilder(LAY, **CAPS).build_for_capture(1.5, 2), TypeError, "num_reqs"),
    (lambda: IndexerStep(None, max_rows=4, max_pages_per_req=4, device="cpu"), TypeError, "layout"),
    (lambda: IndexerStep(LAY, max_rows=0, max_pages_per_req=4, device="cpu"), ValueError, "max_rows"),
    (lambda: IndexerStep(LAY, max_rows=4, max_pages_per_req=4, device="cpu", config={}), TypeError, "config"),
]


@pytest.mark.parametrize("make, exc, field", BUILD_ERRORS, ids=[f for _, _, f in BUILD_ERRORS])
def test_bad_construction_names_the_field(make, exc, field):
    with pytest.raises(exc, match=field):
        make()


def _step_args():
    case = make_case([100, 30], heads=16, seed=0)
    return case


KERNEL_ERRORS = [
    (lambda c: ref.indexer_topk(c.q_fp8[:, 0], c.weights, c.k_cache, c.block_table, c.row_lens, 8),
     ValueError, "q_fp8"),
    (lambda c: kernels.indexer_topk(*c.args, 2.5), TypeError, "k"),
    (lambda c: kernels.indexer_topk(*c.args, True), TypeError, "k"),
    (lambda c: kernels.indexer_topk(*c.args, 0), ValueError, "k"),
    (lambda c: kernels.indexer_topk(*c.args, 8, width=-3), ValueError, "width"),
    (lambda c: kernels.indexer_topk(*c.args, 8, width=10.5), TypeError, "width"),
    (lambda c: kernels.topk_indices(torch.zeros(2, 9), c.row_lens, "8"), TypeError, "k"),
    (lambda c: kernels.paged_indexer_logits(None, c.weights, c.k_cache, c.block_table, c.row_lens, 64),
     TypeError, "q_fp8"),
    (lambda c: kernels.quantize_index_k(torch.tensor([[1.0, float("nan")]])), ValueError, "non-finite"),
    (lambda c: kernels.quantize_index_k(torch.tensor([[1.0, float("inf")]])), ValueError, "non-finite"),
]


@pytest.mark.parametrize("call, exc, field", KERNEL_ERRORS,
                         ids=[f"{f}-{i}" for i, (_, _, f) in enumerate(KERNEL_ERRORS)])
def test_bad_kernel_input_names_the_field(call, exc, field):
    with pytest.raises(exc, match=field):
        call(_step_args())


def test_step_refuses_metadata_it_was_not_planned_for():
    builder = IndexerMetadataBuilder(LAY, **CAPS)
    step = IndexerStep.for_builder(builder)
    case = make_case([100, 30], heads=16, seed=0)
    meta = builder.build(_batch())
    with pytest.raises(TypeError, match="meta"):
        step.run({"row_lens": meta.row_lens}, case.q_fp8, case.weights, case.k_cache)
    with pytest.raises(ValueError, match="q_fp8"):
        step.run(meta, case.q_fp8[:1], case.weights, case.k_cache)


def test_opt_in_device_assertion_catches_a_hint_below_the_device_lengths():
    """max_seq_len below a device length: silently dropped tokens, unless the check is on."""
    lay = IndexerLayout(backend="b12x", compress_ratio=4, topk=8, max_model_len=1024)
    lied = _batch(seq_lens=torch.tensor([100, 900], dtype=torch.int32), shadow=None, max_seq_len=200)
    IndexerMetadataBuilder(lay, **CAPS).build(lied)  # off by default: nothing is read back
    with pytest.raises(RuntimeError, match="bound"):
        IndexerMetadataBuilder(lay, check_bound=True, **CAPS).build(lied)
    honest = _batch(seq_lens=torch.tensor([100, 190], dtype=torch.int32), shadow=None, max_seq_len=200)
    IndexerMetadataBuilder(lay, check_bound=True, **CAPS).build(honest)


def test_device_check_env_switches_the_assertions_on(monkeypatch):
    monkeypatch.setenv(ref.DEVICE_CHECKS_ENV, "1")
    assert IndexerMetadataBuilder(LAY, **CAPS).check_bound
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    k8, ks = kernels.quantize_index_k(torch.randn(3, 128))
    with pytest.raises(RuntimeError, match="slot"):
        kernels.write_index_k_cache(cache, k8, ks, torch.tensor([0, 500, -1]))


def test_out_of_range_slots_are_skipped_like_negative_ones():
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    k8, ks = kernels.quantize_index_k(torch.randn(3, 128) + 3)
    kernels.write_index_k_cache(cache, k8, ks, torch.tensor([0, 500, -1]))
    values, scales = ref.split_index_k_cache(cache)
    assert scales[0, 0] > 0 and int((scales != 0).sum()) == 1  # only slot 0 was written


@pytest.mark.parametrize("argv, words", [
    (["audit", "--device", "cuda:7"], "--device"),
    (["audit", "--device", "nonsense"], "--device"),
    (["audit", "--json", "/nonexistent/folder/out.json"], "does not exist"),
    (["audit", "--batches", "0"], "--batches"),
    (["audit", "--path", "nope"], "unknown path"),
    (["selftest", "--layers", "bogus"], "unknown sync layer"),
    (["selftest", "--json", "/nonexistent/x.json"], "does not exist"),
])
def test_cli_usage_errors_are_one_line_before_any_work(argv, words, capsys):
    if argv[:3] == ["audit", "--device", "cuda:7"] and torch.cuda.device_count() > 7:
        pytest.skip("this host has 8 GPUs")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "[1/9]" not in err  # refused before the audit ran


def test_cli_unwritable_json_is_refused_in_a_subprocess_without_traceback(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    proc = subprocess.run([sys.executable, "-m", "vllm_sparse_sync.cli", "audit", "--json",
                           str(folder / "a.json")], capture_output=True, text=True, timeout=120)
    folder.chmod(0o700)
    if proc.returncode == 0:
        pytest.skip("running as a user who may write anywhere")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "not writable" in proc.stderr


def test_selftest_options_reach_the_selftest(tmp_path):
    out = tmp_path / "st.json"
    assert main(["selftest", "--layers", "sentinel", "--json", str(out)]) == 0
    assert out.exists() and "x.sum().item()" in out.read_text()
