"""benchmarks/indexer.py's run arithmetic, on the CPU: ``merge_rounds`` (one shape's rotated
rounds as one result) and ``spread`` (each shape's ratios across runs of one build); and
tools/wgmma_rate.py's source (one kernel a form, compiled by NVRTC where it is) and its
cycle arithmetic; tools/wide_bound.py's arguments and table; the argument parsing and
arithmetic of step_drift.py, step_energy.py, step_ab.py and workspace_spread.py; cold_l2.py's
table; graph_timer.py's interleaved timing."""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import tarfile

import pytest

from scripts import load_script


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` or ``tools/<name>.py`` as a module."""
    return load_script(name, f"{name}_bench")


def main_exit_code(mod, argv: list[str], monkeypatch) -> int:
    """The exit code of benchmark module ``mod``'s ``main()`` run with ``argv`` (it must exit)."""
    monkeypatch.setattr(sys, "argv", [f"{mod.__name__}.py", *argv])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    return exc.value.code


@pytest.fixture(scope="module")
def indexer():
    return load_benchmark("indexer")


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


def test_derive_compares_the_step_with_the_fastest_checked_peer_stack(indexer):
    res = dict(B=1, L=4096, step_us=7.0, step_fp8_us=6.3, deepgemm_us=3.8, vllm_cooperative_topk_us=3.5,
               stack_vllm_persistent_us=9.0, stack_vllm_persistent_check="ok",
               stack_vllm_cooperative_us=7.0, stack_vllm_cooperative_check="ok",
               stack_sgl_us=5.0, stack_sgl_check="row 0: selected scores differ from the top-2048 multiset",
               stack_fi_auto_err="launch failed")
    out = indexer.derive(dict(res), bw=4.0)
    assert out["best_peer_step_us"] == pytest.approx(7.3)  # the separately timed sum, kept beside it
    assert (out["peer_stack_us"], out["peer_stack_topk"]) == (7.0, "vllm_cooperative")  # sgl: check failed
    assert out["ours_over_peer_stack"] == pytest.approx(1.0)
    assert out["ours_fp8_over_peer_stack"] == pytest.approx(0.9)
    del res["stack_vllm_persistent_check"], res["stack_vllm_cooperative_check"]  # unchecked: not a peer
    assert "peer_stack_us" not in indexer.derive(dict(res), bw=4.0)
    assert "0.90" in indexer.table([out]).split("\n")[-1]


def test_the_wgmma_rate_source_compiles_one_kernel_a_form():
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer
    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk

    rate = load_benchmark("wgmma_rate")
    assert rate.per_tile(2048000.0, 2000, 4) == (256.0, 1024.0)  # 4 warpgroups: an SM's tile a quarter
    text = rate.source()
    names = [f"rate_{name}" for name, *_ in rate.FORMS]
    assert all(f" {n}(" in text for n in names)
    ok, why = cuda_topk.compiler_status()
    if not ok:
        pytest.skip(f"NVRTC unavailable: {why}")
    _, log = cuda_topk.compile_source(cuda_scorer.ARCH, text=text, name="wgmma_rate.cu",
                                      extra_options=("--ptxas-options=-v",))
    assert sorted(n for n in names if f"entry function '{n}'" in log) == sorted(names)


@pytest.fixture(scope="module")
def wide_bound():
    return load_benchmark("wide_bound")


def test_wide_bound_takes_lengths_and_tables_each_columns_fastest_repeat(wide_bound):
    a = wide_bound.parse_args(["--lengths", "4096,16384", "--copies", "4"])
    assert a.lengths == [4096, 16384] and a.copies == 4
    for bad in (["--lengths", "4k"], ["--lengths", "0"], ["--lengths", "262144"], ["--copies", "0"]):
        with pytest.raises(SystemExit):
            wide_bound.parse_args(bad)
    row = dict(L=4096, step_exact_0=7.9, step_exact_1=7.7, topk_exact=4.4)
    lines = wide_bound.table([row]).splitlines()
    cols = lines[0].strip("| ").split(" | ")
    cells = lines[2].strip("| ").split(" | ")
    assert cols[0] == "L" and cols[1:] == list(wide_bound.COLUMNS) and len(cells) == len(cols)
    got = dict(zip(cols, cells))
    assert got["L"] == "4096" and got["step_exact"] == "7.70" and got["topk_exact"] == "4.40"
    assert got["step_wide_host"] == "-"  # not measured


def test_targets_table_marks_misses_and_counts_only_measured_shapes(indexer):
    stack = dict(stack_vllm_cooperative_us=10.0, stack_vllm_cooperative_check="ok")
    rows = [
        indexer.derive(dict(B=1, L=4096, route="cuda_radix", step_us=9.0, step_fp8_us=8.5, step_fused_us=7.5,
                            topk_us=4.0, vllm_cooperative_topk_us=3.5, **stack), bw=4.0),
        indexer.derive(dict(B=4, L=4096, route="fused", step_us=8.0, step_fp8_us=9.5, **stack), bw=4.0),
        indexer.derive(dict(B=64, L=65536, route="cuda_radix", step_us=10.5, step_fp8_us=8.0,
                            step_fused_us=1.0, **stack), bw=4.0),
    ]
    assert rows[0]["fused_over_peer_stack"] == pytest.approx(0.75)  # the fused step the planner passed over
    assert rows[1]["fused_over_peer_stack"] == pytest.approx(0.8)  # the fused route's own step
    assert "fused_over_peer_stack" not in rows[2]  # above 8 rows the fused target does not apply
    text = indexer.targets_table(rows)
    lines = text.splitlines()
    assert lines[2] == "| 1 | 4096 | 1.143 (miss) | 0.900 | 0.850 | - | - | 0.750 |"
    assert lines[3] == "| 4 | 4096 | - | 0.800 | 0.950 (miss) | - | - | 0.800 |"
    assert lines[4] == "| 64 | 65536 | - | 1.050 (miss) | 0.800 | - | - | - |"
    assert lines[-1] == ("met: top-k / best peer top-k 0/1, exact step / peer stack 2/3, "
                         "fp8 step / peer stack 2/3, exact step / peer stack, interleaved 0/0, "
                         "fp8 step / peer stack, interleaved 0/0, fused step / peer stack (rows <= 8) 2/2")


def test_derive_takes_interleaved_ratios_against_the_fastest_checked_stack(indexer):
    res = dict(B=64, L=65536, il_step_us=165.0, il_step_fp8_us=160.0,
               il_stack_vllm_cooperative_us=150.0, stack_vllm_cooperative_check="differs",
               il_stack_vllm_persistent_us=165.0, stack_vllm_persistent_check="ok",
               il_stack_sgl_us=200.0, stack_sgl_check="ok")
    out = indexer.derive(dict(res), bw=4.0)
    assert out["il_peer_stack_topk"] == "vllm_persistent"  # the faster cooperative stack failed its check
    assert out["il_ours_over_peer_stack"] == pytest.approx(1.0)
    assert out["il_ours_fp8_over_peer_stack"] == pytest.approx(160 / 165)
    line = indexer.targets_table([out]).splitlines()[2]
    assert line == "| 64 | 65536 | - | - | - | 1.000 | 0.970 (miss) | - |"
    del res["stack_vllm_persistent_check"], res["stack_sgl_check"]  # no checked stack: no ratio
    assert "il_ours_over_peer_stack" not in indexer.derive(dict(res), bw=4.0)


def test_rotation_puts_every_graph_in_every_place(indexer):
    from graph_timer import rotation

    names = ["step", "step_fp8", "stack_a", "stack_b"]
    orders = [rotation(names, it) for it in range(2 * len(names))]
    for order in orders:
        assert sorted(order) == sorted(names)
    for pos in range(len(names)):  # each name in each place twice over 2k rounds
        assert sorted(o[pos] for o in orders) == sorted(names * 2)
    assert orders[1] == orders[0][::-1]  # odd rounds reversed: the last of one round leads the next


def test_interleaved_timing_cancels_a_clock_drift(indexer, monkeypatch):
    import graph_timer

    clock = {"t": 0}

    def fake_replay(graph, ncalls):  # every graph costs 10 us a call, plus a drift of 0.1 a replay
        clock["t"] += 1
        return 10.0 + 0.1 * clock["t"]

    monkeypatch.setattr(graph_timer, "capture", lambda calls: object())
    monkeypatch.setattr(graph_timer, "replay_us", fake_replay)
    got = graph_timer.interleaved_replay_us({"ours": [None] * 12, "peer": [None] * 12}, 15)
    assert abs(got["ours"] - got["peer"]) <= 0.1 + 1e-9  # equal costs read equal, drift or not
    clock["t"] = 0
    apart = {n: graph_timer.graph_replay_us([None] * 12, 15) for n in ("ours", "peer")}  # one slot each
    assert apart["peer"] - apart["ours"] >= 1.4  # the later slot reads 15 replays' drift slower
    with pytest.raises(ValueError, match="iters"):
        graph_timer.interleaved_replay_us({"ours": [None]}, 0)


def test_shape_options_read_rows_by_width_and_exit_2_naming_the_option(monkeypatch, capsys):
    cold = load_benchmark("cold_start")
    ap = argparse.ArgumentParser()
    assert cold.shapes_arg(ap, "64x65536,1x4096") == [(64, 65536), (1, 4096)]
    assert cold.shape_arg(ap, "8x65536") == (8, 65536)
    for bad in ("64", "0x4096", "1x1000", "1x4100", "", "1x0"):
        with pytest.raises(SystemExit) as exc:
            cold.shapes_arg(ap, bad, "--shapes")
        assert exc.value.code == 2 and "--shapes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cold.shape_arg(ap, "1x4096,2x4096")  # a list where one shape is asked for
    assert exc.value.code == 2 and "--shape: one ROWSxWIDTH" in capsys.readouterr().err
    mod = load_benchmark("step_ab")  # a script's own option, before it looks for a GPU
    assert main_exit_code(mod, ["--shapes", "1x100"], monkeypatch) == 2
    assert "--shapes: '1x100'" in capsys.readouterr().err


def test_spread_takes_todays_ratios_from_an_older_runs_times(indexer, tmp_path, monkeypatch, capsys):
    shape = dict(B=1, L=4096, route="cuda_radix", step_us=7.4, step_fp8_us=7.0, step_fused_us=16.0,
                 stack_vllm_cooperative_us=7.5, stack_vllm_cooperative_check="ok")  # no ratio stored
    paths = []
    for i in range(2):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps(dict(copy_tbs=4.3, shapes=[dict(shape)])))
        paths.append(str(p))
    monkeypatch.setattr(sys, "argv", ["indexer.py", "--spread", *paths, "--out", str(tmp_path / "s.json")])
    indexer.main()
    (row,) = json.loads((tmp_path / "s.json").read_text())["shapes"]
    assert row["fused_over_peer_stack"]["runs"] == 2 and row["fused_over_peer_stack"]["met"] == 0
    assert row["ours_over_peer_stack"]["median"] == pytest.approx(7.4 / 7.5)
    assert "2.13 [2.13, 2.13] 0/2 <= 0.8" in capsys.readouterr().out


def test_step_drift_summarises_the_gpu_samples_of_a_window():
    mod = load_benchmark("step_drift")
    sampler = object.__new__(mod.Sampler)  # no nvidia-smi: the samples as its reader would store them
    sampler.samples = [(1.0, 1980.0, 300.0, 45.0, "0x0"), (2.0, 1770.0, 650.0, 52.0, "0x4"),
                       (3.0, 1905.0, 500.0, 50.0, "0x4"), (9.0, 345.0, 80.0, 40.0, "0x1")]
    got = sampler.window(1.5, 3.5)
    assert got == dict(samples=2, sm_mhz_min=1770.0, sm_mhz_max=1905.0, power_w_max=650.0, temp_c=52.0,
                       reasons=["0x4"])
    assert sampler.window(4.0, 8.0) == {"samples": 0}  # no sample in the window: nothing made up


def test_cold_l2_table_shows_each_parts_cold_cost():
    mod = load_benchmark("cold_l2")
    rows = [dict(B=1, L=131072, step_warm_us=20.5, step_cold_us=21.4, topk_warm_us=12.5, topk_cold_us=13.0),
            dict(B=8, L=65536, step_warm_us=32.5, step_cold_us=33.5)]
    lines = mod.table(rows).splitlines()
    assert lines[0] == "| B | L | step warm / cold / + | topk warm / cold / + |"  # parts no row has: left out
    assert lines[2] == "| 1 | 131072 | 20.50 / 21.40 / +0.90 | 12.50 / 13.00 / +0.50 |"
    assert lines[3] == "| 8 | 65536 | 32.50 / 33.50 / +1.00 | - |"


def test_workspace_spread_reads_one_shape_and_spreads_only_ours(monkeypatch, capsys):
    mod = load_benchmark("workspace_spread")
    times = {"ws0:step": 20.5, "ws0:topk": 11.0, "ws1:step": 21.4, "ws_call_sized:step": 20.7,
             "ws1:topk": 11.6, "stack_vllm_cooperative": 19.0}
    got = mod.spread_of(times)
    assert got == pytest.approx(dict(lowest=20.5, highest=21.4, spread=0.9))  # the peer stack left out
    assert mod.spread_of(times, "topk") == pytest.approx(dict(lowest=11.0, highest=11.6, spread=0.6))
    with pytest.raises(ValueError, match="no time"):
        mod.spread_of({"stack_vllm_cooperative": 19.0})
    lines = mod.table(times, {"ws0": 0x7F0000000000, "ws1": 0x7F0008000000}).splitlines()
    assert lines[2] == "| ws0 | 0x7f0000000000 | 20.50 | - | 11.00 |"  # a part not timed: "-"
    assert lines[4] == "| ws_call_sized:step | - | 20.70 | | |"  # not in ptrs: a graph of its own
    bad = (["--shape", "1x4096,2x4096"], ["--shape", "1x100"], ["--workspaces", "0"], ["--pad-mb", "-1"])
    for argv in bad:
        assert main_exit_code(mod, argv, monkeypatch) == 2
    assert "--shape" in capsys.readouterr().err


def test_graph_sizes_rotate_inputs_past_l2(indexer):
    for B, L in ((64, 65536), (1, 4096), (8, 65536), (1, 131072)):
        copies, ncalls = indexer.graph_sizes(B, L)
        assert 2 <= copies <= 128 and ncalls == max(12, copies)
        assert copies == 128 or copies * B * L * 132 >= indexer.L2_BYTES  # one graph's K caches pass L2
    assert indexer.graph_sizes(64, 65536) == (2, 12) and indexer.graph_sizes(1, 4096) == (128, 128)


def test_step_energy_reads_watts_from_the_energy_counter_inside_the_window(monkeypatch):
    mod = load_benchmark("step_energy")
    samples = [dict(t=0.0, sm_mhz=1980.0, energy_mj=0.0),  # before the window: left out
               dict(t=1.0, sm_mhz=1800.0, energy_mj=1000.0), dict(t=1.5, sm_mhz=1600.0),  # no counter
               dict(t=2.0, sm_mhz=1700.0, energy_mj=1700.0), dict(t=3.0, sm_mhz=1500.0, energy_mj=2300.0)]
    got = mod.energy_window(samples, 0.5, 3.0)
    assert got == pytest.approx(dict(samples=3, watts=0.65, sm_mhz_mean=1666.6667, sm_mhz_min=1500.0))
    assert mod.energy_window(samples, 2.5, 3.5) == {"samples": 1}  # one reading: no rate made up
    rows = [dict(round=0, graph="step", us=170.0, watts=690.0, sm_mhz_mean=1600.0),
            dict(round=1, graph="step", us=168.0, watts=700.0, sm_mhz_mean=1650.0),
            dict(round=2, graph="step", us=172.0, watts=680.0, sm_mhz_mean=1550.0),
            dict(round=0, graph="stack", us=165.0, samples=1)]
    summary = mod.summarise(rows)
    assert summary["step"] == pytest.approx(dict(rounds=3, us=170.0, watts=690.0, uj=117300.0, sm_mhz=1600.0))
    assert summary["stack"] == {"rounds": 0}  # a round without watts is not averaged in
    lines = mod.table(summary).splitlines()
    assert lines[2] == "| step | 170.00 | 690 | 117300 | 1600 |" and lines[3] == "| stack | - | - | - | - |"
    summary["stack_vllm_persistent"] = dict(rounds=2, us=168.0, watts=680.0, uj=114240.0, sm_mhz=1700.0)
    summary["stack_vllm_cooperative"] = dict(rounds=2, us=160.0, watts=700.0, uj=112000.0, sm_mhz=1650.0)
    summary["stack_sgl"] = {"rounds": 0}  # not timed: never the fastest
    got = mod.ratios(summary)  # no fp8 step timed: no fp8 ratio made up
    assert got == pytest.approx(dict(stack="stack_vllm_cooperative", step_over_stack=170.0 / 160.0,
                                     step_uj_over_stack=117300.0 / 112000.0))
    assert mod.ratios({"step": summary["step"]}) == {"stack": None}
    broken = dict(summary, stack_fast=dict(rounds=2, us=100.0, watts=700.0, uj=70000.0, sm_mhz=1700.0,
                                           check="row 0: selected scores differ from the top-2048 multiset"))
    assert mod.ratios(broken)["stack"] == "stack_vllm_cooperative"  # failed its check: never the peer
    assert "| stack_fast (check: row 0: selected scores differ" in mod.table(broken)
    res = [dict(B=64, L=65536, summary=summary, ratios=got),
           dict(B=1, L=4096, summary={"step": summary["step"]}, ratios={"stack": None})]
    lines = mod.ratio_table(res).splitlines()
    assert lines[2] == "| 64 x 65536 | 170.00 (690) | - | 160.00 (700) vllm_cooperative | 1.062 | - | 1.047 |"
    assert lines[3] == "| 1 x 4096 | 170.00 (690) | - | - | - | - | - |"
    bad = (["--shapes", "64x65536,1x100"], ["--seconds", "1"], ["--rounds", "0"], ["--config", "scorer.no=2"])
    for argv in bad:
        assert main_exit_code(mod, argv, monkeypatch) == 2


@pytest.fixture(scope="module")
def step_ab():
    return load_benchmark("step_ab")


def test_step_ab_reads_named_configs_the_configs_assignments_last(step_ab, indexer):
    from vllm_sparse_sync.kernels import planner

    got = step_ab.parse_named(" cuda : planner.CUDA_FP8_SCORER_MIN_TOKENS=1 ")
    assert got == ("cuda", "planner.CUDA_FP8_SCORER_MIN_TOKENS=1")
    assert step_ab.parse_named("triton:") == ("triton", "")  # no assignments: the base alone
    for bad in ("triton", ":precise=false", " :x=1"):
        with pytest.raises(ValueError, match="NAME:ASSIGNMENTS"):
            step_ab.parse_named(bad)
    base = "precise=false,planner.CUDA_FP8_SCORER_MIN_TOKENS=64"
    assert step_ab.joined(base, "") == base and step_ab.joined("", "topk=radix") == "topk=radix"
    rest, constants = step_ab.split_constants(step_ab.joined(base, "planner.CUDA_FP8_SCORER_MIN_TOKENS=1"))
    assert constants == {"CUDA_FP8_SCORER_MIN_TOKENS": 1}  # the config's value wins
    assert indexer.parse_config(rest).precise is False
    before = planner.CUDA_FP8_SCORER_MIN_TOKENS
    with step_ab.Variant(indexer.parse_config(rest), constants) as cfg:  # set while its routes are planned
        assert planner.CUDA_FP8_SCORER_MIN_TOKENS == 1 and cfg.precise is False
    assert planner.CUDA_FP8_SCORER_MIN_TOKENS == before
    for bad, why in (("planner.NOPE=1", "no int constant"), ("planner.SAMPLE_MIN_ROWS=x", "takes an int")):
        with pytest.raises(ValueError, match=why):
            step_ab.split_constants(bad)


def test_step_ab_summarises_each_configs_median_round_and_its_ratio_to_the_first(step_ab):
    names = ["triton", "cuda"]
    rounds = [dict(step_triton=10.0, scorer_triton=8.0, step_cuda=5.0, scorer_cuda=3.0),
              dict(step_triton=30.0, scorer_triton=9.0, step_cuda=6.0, scorer_cuda=1.0),
              dict(step_triton=12.0, scorer_triton=1.0, step_cuda=25.0, scorer_cuda=2.0)]
    extra = dict(kind_triton="triton", kind_cuda="cuda", check="ok")
    row = step_ab.summarise(64, 65536, names, rounds, extra)
    got = [row[f"{part}_{name}"] for name in names for part in ("step", "scorer")]
    assert got == [12.0, 8.0, 6.0, 2.0]  # each the median of its 3 rounds: not the mean, not the first
    assert row["step_cuda_over_triton"] == 0.5  # the config's step over the baseline's, not inverted
    assert "step_triton_over_triton" not in row and row["rounds"] == rounds
    row2 = dict(row, B=1, L=4096, check="cuda: row 0: differs")
    lines = step_ab.table([row, row2], names).splitlines()
    assert lines[0].split(" | ") == ["| B", "L", "step triton", "step cuda", "scorer triton", "scorer cuda",
                                     "cuda / triton", "check |"]
    assert len(lines) == 4  # header, rule, one line a shape
    assert lines[2] == "| 64 | 65536 | 12.00 (triton) | 6.00 (cuda) | 8.00 | 2.00 | 0.500 | ok |"
    assert lines[3].startswith("| 1 | 4096 |") and lines[3].endswith("| cuda: row 0: differs |")


def test_step_ab_exits_2_on_its_own_options_before_looking_for_a_gpu(step_ab, monkeypatch, capsys):
    def no_gpu(*args):
        raise AssertionError("reached require_cuda")

    monkeypatch.setattr(step_ab, "require_cuda", no_gpu)
    two = ["--config", "a:", "--config"]
    bad = [(["--config", "a:"], "--config: give at least two"),
           ([*two, "b"], "--config: expected NAME:ASSIGNMENTS"),
           ([*two, "a:precise=false"], "--config: config name 'a' given twice"),
           ([*two, "b:nope=1"], "--config: config: unknown field 'nope'"),
           ([*two, "b:planner.nope=1"], "--config: config key 'planner.nope'"),
           ([*two, "b:", "--rounds", "0"], "--rounds and --iters: must be >= 1")]
    for argv, message in bad:
        assert main_exit_code(step_ab, argv, monkeypatch) == 2
        assert f"error: {message}" in capsys.readouterr().err, argv
    monkeypatch.setattr(sys, "argv", ["step_ab.py", *two, "b:planner.CUDA_FP8_SCORER_MIN_TOKENS=1"])
    with pytest.raises(AssertionError, match="require_cuda"):  # valid options: on to the GPU check
        step_ab.main()


def test_step_ab_names_every_shape_whose_check_failed(step_ab):
    rows = [dict(B=64, L=65536, check="ok"), dict(B=32, L=16384, check="early: row 0: duplicate positions"),
            dict(B=1, L=4096, check="ok")]
    assert step_ab.failed_checks(rows) == ["32x16384: early: row 0: duplicate positions"]
    assert step_ab.failed_checks([rows[0], rows[2]]) == []


def test_indexer_fails_on_our_checks_and_raised_rounds_not_on_a_peers(indexer):
    ok = dict(B=1, L=4096, step_check="ok", topk_radix_check="ok", topk_cuda_radix_check="unavailable: x",
              vllm_persistent_topk_check="differs", stack_sgl_check="row 0: differs")
    assert indexer.our_failures([ok]) == []  # a peer's failed check drops the peer, not the run
    bad = [dict(ok, B=8, L=65536, step_check="row 1: duplicate positions"),
           dict(ok, B=64, L=16384, topk_sample_check="differs"),
           dict(B=128, L=8192, error="RuntimeError: launch failed")]
    assert indexer.our_failures(bad) == ["8x65536: step row 1: duplicate positions",
                                         "64x16384: topk_sample_check differs",
                                         "128x8192: RuntimeError: launch failed"]
    assert indexer.our_failures([dict(B=1, L=4096)]) == []  # --peers-only: none of our checks ran


def test_a_prebuilt_flashinfer_peer_loads_only_with_todays_stamp(indexer, tmp_path, monkeypatch):
    src = tmp_path / ".peers_fi"
    src.mkdir()
    (src / "include.tar.xz").write_bytes(b"headers v1")
    so = src / "libfi_topk.sm_90a.so"
    assert indexer.flashinfer_prebuilt(str(src), "90a") is None  # nothing built
    so.write_bytes(b"\x7fELF")
    assert indexer.flashinfer_prebuilt(str(src), "90a") is None  # built, never stamped
    (src / "libfi_topk.sm_90a.so.sha256").write_text(indexer.flashinfer_stamp(str(src)) + "\n")
    assert indexer.flashinfer_prebuilt(str(src), "90a") == str(so)
    assert indexer.flashinfer_prebuilt(str(src), "100a") is None  # another device's arch
    (src / "include.tar.xz").write_bytes(b"headers v2")  # new headers: the library is stale
    assert indexer.flashinfer_prebuilt(str(src), "90a") is None
    (src / "include.tar.xz").write_bytes(b"headers v1")
    wrapper = tmp_path / "peer.cu"
    wrapper.write_text("// v2")
    monkeypatch.setattr(indexer, "FI_WRAPPER", str(wrapper))  # a changed wrapper: stale too
    assert indexer.flashinfer_prebuilt(str(src), "90a") is None
    # a library cached elsewhere (the GPU host's temp dir) follows the same sources' stamp
    cached = tmp_path / "cache" / "libfi_topk.sm_90a.so"
    cached.parent.mkdir()
    cached.write_bytes(b"\x7fELF")
    (tmp_path / "cache" / "libfi_topk.sm_90a.so.sha256").write_text(indexer.flashinfer_stamp(str(src)))
    assert indexer.flashinfer_fresh(str(cached), str(src))
    (src / "include.tar.xz").write_bytes(b"headers v3")  # the checkout's headers moved on
    assert not indexer.flashinfer_fresh(str(cached), str(src))


def test_build_flashinfer_exits_2_naming_what_is_missing(indexer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(indexer, "ROOT", str(tmp_path))
    assert indexer.build_flashinfer_cli("9x", "nvcc") == 2
    assert "'9x' is not an arch" in capsys.readouterr().err
    assert indexer.build_flashinfer_cli("90a", "nvcc") == 2
    assert "no .peers_fi/" in capsys.readouterr().err
    (tmp_path / ".peers_fi").mkdir()
    with tarfile.open(tmp_path / ".peers_fi" / "include.tar.xz", "w:xz"):
        pass
    monkeypatch.setattr(indexer, "FI_WRAPPER", str(tmp_path / "peer.cu"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert indexer.build_flashinfer_cli("90a", "") == 2
    assert "no nvcc" in capsys.readouterr().err
    assert indexer.build_flashinfer_cli("90a", str(tmp_path / "no-nvcc")) == 2
    assert "no-nvcc" in capsys.readouterr().err
    assert not list((tmp_path / ".peers_fi").glob("*.so*"))  # nothing half-built left behind


def test_topk_slots_compares_ours_with_the_fastest_checked_peer_and_reads_shapes(monkeypatch):
    slots = load_benchmark("topk_slots")
    assert slots.parse_shapes("1x4096, 64x65536") == [(1, 4096), (64, 65536)]
    assert len(slots.parse_shapes("")) == 9
    for bad in ("64", "0x4096", "ax5"):
        with pytest.raises(SystemExit, match="--shapes"):
            slots.parse_shapes(bad)
    res = slots.derive({"B": 1, "L": 4096, "ours_us": 4.0, "ours_slots_us": 4.2,
                        "ours_then_transform_us": 6.0,
                        "fi_auto_slots_us": 3.0, "fi_auto_slots_check": "differs",  # fastest, but wrong
                        "fi_filtered_slots_us": 5.0, "fi_filtered_slots_check": "ok",
                        "vllm_cooperative_then_transform_us": 6.3,
                        "vllm_cooperative_then_transform_check": "ok"})
    assert res["best_peer"] == "fi_filtered_slots" and res["slots_over_best_peer"] == pytest.approx(0.84)
    assert res["fusion_saves_us"] == pytest.approx(1.8)
    text = slots.table([res, {"B": 2, "L": 8, "ours_us": 1.0}])
    assert "1/1" in text and "fi_auto_slots_check" in text  # the failed check is named
    monkeypatch.setattr(slots.torch.cuda, "is_available", lambda: False)
    code = main_exit_code(slots, ["--shapes", "1x4096"], monkeypatch)
    assert code == "topk_slots.py times CUDA kernels: no CUDA device here"


def test_ptx_diff_sees_through_numbering_and_names_but_not_an_instruction():
    pd = load_benchmark("ptx_diff")
    old = """.visible .entry topk_cluster_c1_t512_a1(
\t.param .u64 topk_cluster_c1_t512_a1_param_0
)
.maxntid 512, 1, 1
{
\t.reg .b32 \t%r<9>;
\t.shared .align 4 .b8 _ZZ16topk_cluster_rowILi1ELi512ELb1EEvPKfE2sc[1052];
\tld.param.u64 \t%rd1, [topk_cluster_c1_t512_a1_param_0];
\tld.shared.u32 \t%r3, [_ZZ16topk_cluster_rowILi1ELi512ELb1EEvPKfE2sc+648];
\tcall _Z14split_smem_rowILi8ELi1024ELb1EEvPKfiiPi, (%r3);
$L__BB0_2:
\tbra.uni \t$L__BB0_2;
}"""
    renumbered = (old.replace("%r3", "%r13").replace("%rd1", "%rd7").replace("BB0_2", "BB4_9")
                  .replace("[1052]", "[1068]").replace("ILi1ELi512ELb1EE", "ILi1ELi512ELb1ELb0EE")
                  .replace("ILi8ELi1024ELb1EE", "ILi8ELi1024ELb1ELb0EE").replace("<9>", "<12>"))
    assert list(pd.entries(old)) == ["topk_cluster_c1_t512_a1"]
    assert pd.compare(pd.entries(old), pd.entries(renumbered)) == {"topk_cluster_c1_t512_a1": "same"}
    vectorised = renumbered.replace("ld.shared.u32", "ld.shared.v2.u32")  # a vectorised shared load
    assert pd.compare(pd.entries(old), pd.entries(vectorised)) == {"topk_cluster_c1_t512_a1": "differs"}
    assert pd.compare(pd.entries(old), {}) == {"topk_cluster_c1_t512_a1": "gone"}
