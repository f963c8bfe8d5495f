"""benchmarks/indexer.py's run arithmetic, on the CPU: ``merge_rounds`` (one shape's rotated
rounds as one result) and ``spread`` (each shape's ratios across runs of one build)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).parents[1] / "benchmarks" / "indexer.py"


@pytest.fixture(scope="module")
def indexer():
    sys.path.insert(0, str(PATH.parent))
    spec = importlib.util.spec_from_file_location("indexer_bench", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_merge_rounds_takes_each_time_s_median(indexer):
    rounds = [dict(B=1, L=2, step_us=3.0, check="ok"), dict(B=1, L=2, step_us=1.0, check="bad", dg_us=5.0),
              dict(B=1, L=2, step_us=2.0, check="ok")]
    out = indexer.merge_rounds(rounds)
    assert out == dict(B=1, L=2, step_us=2.0, check="ok", dg_us=5.0)  # a field one round has: its value
    assert indexer.merge_rounds(rounds[:2])["step_us"] == 3.0  # an even count: the upper median
    with pytest.raises(ValueError, match="round"):
        indexer.merge_rounds([])


def test_spread_counts_runs_that_met_each_target(indexer):
    def run(*ratios):
        return dict(shapes=[dict(B=1, L=4096, ours_over_best_peer=r, ours_fp8_over_best_peer=r - 0.1,
                                 topk_over_best_peer=None) for r in ratios])

    runs = [run(0.99), run(1.02), run(1.01), dict(shapes=[])]  # the last run lacks the shape
    (row,) = indexer.spread(runs)
    exact = row["ours_over_best_peer"]
    got = (exact["median"], exact["min"], exact["max"], exact["runs"], exact["met"])
    assert got == (1.01, 0.99, 1.02, 3, 1)
    assert row["ours_fp8_over_best_peer"]["met"] == 1  # 0.89 <= 0.9; 0.92 and 0.91 not
    assert "topk_over_best_peer" not in row  # a ratio no run has is not reported (and not a pass)
    assert "1.01 [0.99, 1.02] 1/3 <= 1.0" in indexer.spread_table([row])
    with pytest.raises(ValueError, match="run"):
        indexer.spread([])
