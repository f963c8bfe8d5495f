"""The decode loop in miniature on the CPU (2 layers, 8 tokens): every variant runs the real
builder and the reference kernels; token ids agree; the legacy variant's sync is seen."""

from __future__ import annotations

import json
import os
import sys

import pytest

from vllm_sparse_sync import IndexerLayout
from vllm_sparse_sync.decode_loop import VARIANT_NAMES, DecodeLoop, ModelShape, ffn_width, variant_named

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = IndexerLayout(backend="b12x", page_size=16, topk=16, num_heads=4, head_dim=32, max_model_len=256)
SHAPE = ModelShape(num_layers=2, weight_mb=0.01, vocab=64)


@pytest.fixture(scope="module")
def loop():
    return DecodeLoop(LAYOUT, SHAPE, batch=3, context=40, max_steps=8, device="cpu")


def test_every_variant_samples_the_same_tokens(loop):
    runs = {v: loop.run(v, 8) for v in VARIANT_NAMES}
    ref = runs["exact"].tokens
    assert len(ref) == 8 and all(len(t) == 3 for t in ref)
    assert len({tuple(t) for t in ref}) > 1, "the sampled tokens never change: the loop feeds nothing back"
    for v, r in runs.items():
        assert r.tokens == ref, v
        assert r.steps == 8 and r.wall_s > 0 and len(r.host_us) == 8 and len(r.step_ms) == 7


def test_a_different_top_k_set_changes_the_tokens(loop):
    """Plant a wrong indexer (one selected position moved): the token check must see it."""
    want = loop.run("exact", 8).tokens
    planted = DecodeLoop(LAYOUT, SHAPE, batch=3, context=40, max_steps=8, device="cpu")
    real = planted.indexer

    def wrong(v):
        fn = real(v)

        def run(layer, q, w):
            out = fn(layer, q, w)
            out[0, 0] = (out[0, 0] + 1) % 40
            return out

        return run

    planted.indexer = wrong
    assert planted.run("exact", 8).tokens != want


def test_legacy_syncs_once_more_per_step_than_ideal_and_the_fixes_never_more(loop):
    counts = {v: loop.count_syncs(v, steps=4) for v in VARIANT_NAMES}
    assert counts["legacy"]["scalar_read"] >= 1.0
    assert counts["legacy"]["total"] >= counts["ideal"]["total"] + 1.0
    for v in ("exact", "broad", "broad-sensitive"):
        assert counts[v]["total"] <= counts["ideal"]["total"], (v, counts[v])
        assert counts[v].get("scalar_read", 0) == 0, (v, counts[v])


def test_bad_arguments_are_refused(loop):
    with pytest.raises(ValueError, match="steps"):
        loop.run("exact", 9)
    with pytest.raises(ValueError, match="before"):
        loop.run("exact", 2, before=1.5)
    with pytest.raises(ValueError, match="unknown variant"):
        variant_named("fast")
    with pytest.raises(ValueError, match="variant: 'fast'"):
        loop.run("fast", 2)
    with pytest.raises(ValueError, match="max_model_len"):
        DecodeLoop(LAYOUT, SHAPE, batch=1, context=250, max_steps=8, device="cpu")
    with pytest.raises(ValueError, match="vocab"):
        DecodeLoop(
            LAYOUT,
            ModelShape(num_layers=1, weight_mb=0.01, vocab=1000),
            batch=1,
            context=40,
            max_steps=2,
            device="cpu",
        )
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape(num_layers=0)


def test_the_stand_in_reads_the_stated_weight_slice():
    cols = ffn_width(8192, 512.0)
    assert cols % 8192 == 0 and cols * 8192 * 2 == 512 * 2**20


def test_the_benchmark_script_runs_and_writes_its_json(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import decode_loop as bench
    finally:
        sys.path.pop(0)
    out = tmp_path / "loop.json"
    assert (
        bench.main(
            [
                "--device",
                "cpu",
                "--tokens",
                "4",
                "--batches",
                "1",
                "--contexts",
                "40",
                "--sweep-context",
                "40",
                "--sweep-host-us",
                "0,100",
                "--sweep-tokens",
                "3",
                "--rounds",
                "1",
                "--sync-steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {r["variant"] for r in data["table"]} == set(VARIANT_NAMES)
    assert {r["host_work_us"] for r in data["sweep"]} == {0, 100}
    assert all(r["summary"]["tokens_match"] for r in data["table"] + data["sweep"])
    assert "token ids identical across variants: yes" in printed
    assert "legacy syncs 1 more per step than ideal (target >= 1)  met" in printed
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--variants", "fast"])
