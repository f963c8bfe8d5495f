"""Energy per call of our step and of the peer stack at one shape, under the same power cap.

    python tools/step_energy.py [--shapes 64x65536,...] [--seconds 3] [--rounds 3] [--parts]
                                     [--config KEY=VALUE,...]... [--json FILE]

Run 127 found the H200 at its 700 W cap at 64x64K, its SM clock set by the power drawn. A step
that draws more energy a call runs at a lower clock there, whatever its kernels' cycles. Here,
a shape at a time, one set of inputs (``indexer.py``'s) and graphs of our exact and fp8 steps and, with
``.peers``/``.peers_topk`` carried, DeepGEMM + vLLM's cooperative (up to 64 rows) and persistent
top-k (``--parts``: also our scorer, our top-k and DeepGEMM alone).
Each round replays every graph back to back for ``--seconds`` in a rotated order
(``graph_timer.rotation``), reading NVML's energy counter and SM clock (through ``ctypes``, the
driver's ``libnvidia-ml.so.1``) between batches of replays. Per graph: microseconds a call, mean
watts (from the energy counter) and microjoules a call, medians over the rounds; then our steps
over the fastest stack, in time and in energy. Prints tables; ``--json`` writes every round.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers
from cold_start import require_cuda, shapes_arg  # noqa: E402

TRIM_S = 0.5  # the first half second of a window is left out: the clock and power settle
BATCH_US = 5000.0  # replays a batch: at least this much GPU time, longer than an NVML read
NVML_CLOCK_SM = 1


class Nvml:
    """The GPU's energy counter (millijoules since the driver loaded) and SM clock, from NVML.
    NVML numbers GPUs as the driver does: index 0 is CUDA device 0 only where CUDA_VISIBLE_DEVICES
    does not reorder them (the device machines' one-GPU runs)."""

    def __init__(self, index: int = 0) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)), "handle")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML {what}: error {rc}")

    def reading(self) -> dict:
        energy, mhz = ctypes.c_ulonglong(), ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(energy)), "energy")
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(mhz)), "clock")
        return dict(t=time.time(), energy_mj=float(energy.value), sm_mhz=float(mhz.value))


def energy_window(samples: list[dict], t0: float, t1: float) -> dict:
    """Mean watts over [t0, t1] from the energy counter (millijoules) of the samples inside it,
    and the SM clock's mean and minimum there; ``{"samples": n}`` alone with fewer than two."""
    got = [s for s in samples if t0 <= s["t"] <= t1 and "energy_mj" in s]
    if len(got) < 2 or got[-1]["t"] <= got[0]["t"]:
        return {"samples": len(got)}
    watts = (got[-1]["energy_mj"] - got[0]["energy_mj"]) / 1000.0 / (got[-1]["t"] - got[0]["t"])
    mhz = [s["sm_mhz"] for s in got]
    return {"samples": len(got), "watts": watts, "sm_mhz_mean": statistics.fmean(mhz), "sm_mhz_min": min(mhz)}


def summarise(rows: list[dict]) -> dict[str, dict]:
    """Per graph: medians over its rounds of us a call, watts and microjoules a call (W x us)."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r["graph"] for r in rows):
        mine = [r for r in rows if r["graph"] == name and "watts" in r]
        if not mine:
            out[name] = {"rounds": 0}
            continue
        out[name] = dict(rounds=len(mine), us=statistics.median(r["us"] for r in mine),
                         watts=statistics.median(r["watts"] for r in mine),
                         uj=statistics.median(r["watts"] * r["us"] for r in mine),
                         sm_mhz=statistics.median(r["sm_mhz_mean"] for r in mine))
    return out


def table(summary: dict[str, dict]) -> str:
    lines = ["| graph | us a call | W | uJ a call | SM MHz (mean) |", "|---|---:|---:|---:|---:|"]
    for name, s in summary.items():
        if s.get("check", "ok") != "ok":
            name = f"{name} (check: {s['check']})"
        if not s.get("rounds"):
            lines.append(f"| {name} | - | - | - | - |")
            continue
        lines.append(f"| {name} | {s['us']:.2f} | {s['watts']:.0f} | {s['uj']:.0f} | {s['sm_mhz']:.0f} |")
    return "\n".join(lines)


def replay_for(graph: torch.cuda.CUDAGraph, ncalls: int, seconds: float, nvml: Nvml) -> tuple[float, list]:
    """Replays ``graph`` back to back for about ``seconds``: (microseconds a call between CUDA
    events, NVML readings once ``TRIM_S`` has passed). The host stays one batch of at least
    ``BATCH_US`` ahead and reads NVML while the GPU runs the next batch, so the GPU never idles."""
    graph.replay()  # one replay's time sizes the batches
    torch.cuda.synchronize()
    t = time.time()
    graph.replay()
    torch.cuda.synchronize()
    batch = max(1, math.ceil(BATCH_US / max((time.time() - t) * 1e6, 1.0)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    replays, readings, pending = 0, [], []
    while time.time() - t0 < seconds:
        for _ in range(batch):
            graph.replay()
        replays += batch
        done = torch.cuda.Event()
        done.record()
        pending.append(done)
        if len(pending) > 1:
            pending.pop(0).synchronize()  # the batch after it is still queued: the GPU is busy
            if time.time() - t0 >= TRIM_S:
                readings.append(nvml.reading())
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / (replays * ncalls), readings


def stack_check(make, out: torch.Tensor, dense: torch.Tensor, inp) -> str:
    """``"ok"`` if a peer top-k's selection on the first rows of ``dense`` is a top-k (as
    ``indexer.py`` checks its stacks), else the first violation."""
    import indexer as ix

    from vllm_sparse_sync.kernels.verify import topk_violations

    rows = min(inp.B, 2)
    out.fill_(-1)
    make(dense)()
    bad = topk_violations(out[:rows], dense[:rows], inp.lens[:rows], ix.TOPK)
    return "ok" if not bad else bad[0][:120]


def stack_of(summary: dict[str, dict]) -> str | None:
    """The fastest peer stack timed (``stack_*`` with rounds) whose check (if any) is "ok", or None."""
    stacks = [(v["us"], k) for k, v in summary.items()
              if k.startswith("stack_") and v.get("rounds") and v.get("check", "ok") == "ok"]
    return min(stacks)[1] if stacks else None


def ratios(summary: dict[str, dict]) -> dict:
    """Our exact and fp8 steps over the fastest peer stack, in time and in energy a call."""
    stack = stack_of(summary)
    out: dict = {"stack": stack}
    if stack is None:
        return out
    peer = summary[stack]
    for ours in ("step", "step_fp8"):
        mine = summary.get(ours, {})
        if mine.get("rounds"):
            out[f"{ours}_over_stack"] = mine["us"] / peer["us"]
            out[f"{ours}_uj_over_stack"] = mine["uj"] / peer["uj"]
    return out


def ratio_table(results: list[dict]) -> str:
    """One line a shape: sustained time and energy of our steps against the fastest stack."""
    lines = ["| B x L | step us (W) | fp8 step us (W) | stack us (W) | step / stack | fp8 / stack | "
             "step uJ / stack uJ |", "|---|---:|---:|---|---:|---:|---:|"]

    def cell(s: dict, name: str | None) -> str:
        v = s.get(name, {}) if name else {}
        return f"{v['us']:.2f} ({v['watts']:.0f})" if v.get("rounds") else "-"

    def num(r: dict, key: str) -> str:
        return f"{r[key]:.3f}" if key in r else "-"

    for res in results:
        s, r = res["summary"], res["ratios"]
        stack = r["stack"]
        lines.append(f"| {res['B']} x {res['L']} | {cell(s, 'step')} | {cell(s, 'step_fp8')} | "
                     f"{cell(s, stack) + ' ' + stack[6:] if stack else '-'} | {num(r, 'step_over_stack')} | "
                     f"{num(r, 'step_fp8_over_stack')} | {num(r, 'step_uj_over_stack')} |")
    return "\n".join(lines)


def measure(B: int, L: int, seconds: float, rounds: int, parts: bool, nvml: Nvml, configs: list) -> dict:
    """One shape's graphs, ``rounds`` rotated rounds of ``seconds`` each: rows and summary.
    ``configs`` (KernelConfig) each add our exact step under it as ``step_cfg<i>``."""
    import indexer as ix
    from graph_timer import capture, rotation

    from vllm_sparse_sync.kernels import ops as tk

    copies, ncalls = ix.graph_sizes(B, L)
    inp = ix.Inputs(B, L, copies)
    ws, ws8 = ix.step_workspaces(B, L, ix.DEFAULT_CONFIG)
    out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
    step = ix.step_calls(inp, ws, out)
    calls = {"step": step["step"]}
    calls["step_fp8"] = lambda i: tk.indexer_topk(*inp.args(i), ix.TOPK, width=L, workspace=ws8, out=out)
    if parts:
        calls["scorer"], calls["topk"] = step["scorer"], step["topk"]
    for j, cfg in enumerate(configs):
        calls[f"step_cfg{j}"] = ix.step_calls(inp, ix.step_workspaces(B, L, cfg)[0], out)["step"]
    step["step"](0)  # the logits the top-k alone reads
    dg, vt = ix.load_deepgemm(), ix.load_vllm_topk()
    checks: dict[str, str] = {}
    if dg is not None:
        logits = ix.deepgemm_logits(dg, inp)
        if parts:
            calls["deepgemm"] = logits
        if vt is not None:
            makers = ix.peer_topk_makers(vt, None, None, inp)
            for name in ("vllm_cooperative", "vllm_persistent") if B <= 64 else ("vllm_persistent",):
                calls[f"stack_{name}"] = lambda i, make=makers[name]: make(logits(i))()
                checks[f"stack_{name}"] = stack_check(makers[name], makers["out"], logits(0), inp)
    graphs = {name: capture([lambda i=i, c=c: c(i) for i in range(ncalls)]) for name, c in calls.items()}
    rows = []
    for r in range(rounds):
        for name in rotation(list(graphs), r):
            us, readings = replay_for(graphs[name], ncalls, seconds, nvml)
            got = energy_window(readings, -float("inf"), float("inf"))
            rows.append(dict(round=r, graph=name, us=round(us, 3), **got))
            print(json.dumps(dict(B=B, L=L, **rows[-1])), flush=True)
    del graphs
    summary = summarise(rows)
    for name, check in checks.items():
        summary[name]["check"] = check
    return dict(B=B, L=L, ncalls=ncalls, summary=summary, ratios=ratios(summary), rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x65536")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", action="store_true", help="also our scorer, our top-k and DeepGEMM alone")
    ap.add_argument("--config", action="append", default=[],
                    help="our exact step also under this config (as indexer.py's --config): step_cfg0, ...")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = shapes_arg(ap, a.shapes)
    import indexer as ix

    try:
        configs = [ix.parse_config(text) for text in a.config]
    except (ValueError, TypeError, KeyError) as exc:
        ap.error(f"--config: {exc}")
    if a.rounds < 1 or a.seconds <= 2 * TRIM_S:
        ap.error(f"--rounds: must be >= 1; --seconds: must be > {2 * TRIM_S}")
    require_cuda("step_energy.py")
    nvml = Nvml()
    results = []
    for B, L in shapes:
        results.append(measure(B, L, a.seconds, a.rounds, a.parts, nvml, configs))
        print(table(results[-1]["summary"]), flush=True)
        torch.cuda.empty_cache()
    print(ratio_table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(seconds=a.seconds, rounds=a.rounds, configs=a.config, shapes=results), f, indent=1)


if __name__ == "__main__":
    main()
