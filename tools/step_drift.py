"""Does one shape's step drift over a process's life, and do the GPU's clocks follow it?

    python tools/step_drift.py [--shape 64x65536] [--cycles 8] [--json FILE]

One set of inputs and one workspace (as ``indexer.py`` builds them), then ``--cycles`` cycles of
CUDA-graph replays, each cycle timing, in a rotated order: the exact step, its scorer alone, its
top-k alone (on the logits the scorer left), and the fp8 step. Beside each time: the SM clock
(MHz), power (W) and temperature (C) sampled every 20 ms while it ran, from ``nvidia-smi`` (the
samples' minimum clock and maximum power), and the clock-event reasons seen. Prints a table and
writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers
from cold_start import require_cuda, shape_arg  # noqa: E402

PARTS = ("step", "scorer", "topk", "step_fp8")
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


class Sampler:
    """``nvidia-smi`` polled every 20 ms in the background; ``window(t0, t1)`` summarises it."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float, float, str]] = []
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "20",
                 "-i", "0"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                sample = (time.time(), float(parts[0]), float(parts[1]), float(parts[2]), parts[3])
            except (ValueError, IndexError):
                continue
            self.samples.append(sample)

    def window(self, t0: float, t1: float) -> dict:
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return {"samples": 0}
        return {"samples": len(got), "sm_mhz_min": min(s[1] for s in got),
                "sm_mhz_max": max(s[1] for s in got), "power_w_max": max(s[2] for s in got),
                "temp_c": max(s[3] for s in got),
                "reasons": sorted({s[4] for s in got})}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="64x65536")
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    B, L = shape_arg(ap, a.shape)
    if a.cycles < 1:
        ap.error(f"--cycles: must be >= 1, got {a.cycles}")
    require_cuda("step_drift.py")
    import indexer as ix

    from vllm_sparse_sync.kernels import ops as tk

    copies, ncalls = ix.graph_sizes(B, L)
    inp = ix.Inputs(B, L, copies)
    ws, ws8 = ix.step_workspaces(B, L, ix.DEFAULT_CONFIG)
    route = ws.plan_call(B, L, ix.PAGE)
    out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
    calls = ix.step_calls(inp, ws, out)
    calls["step_fp8"] = lambda i: tk.indexer_topk(*inp.args(i), ix.TOPK, width=L, workspace=ws8, out=out)
    makers = {part: (lambda i, call=calls[part]: lambda: call(i)) for part in PARTS}
    makers["step"](0)()  # the logits the top-k alone reads
    sampler = Sampler()
    rows = []
    try:
        for c in range(a.cycles):
            for j in range(len(PARTS)):
                part = PARTS[(c + j) % len(PARTS)]
                t0 = time.time()
                us = ix.timeit(makers[part], ncalls)
                t1 = time.time()
                gpu = sampler.window(t0, t1)
                rows.append(dict(cycle=c, part=part, us=round(us, 3), t=round(t0, 3), **gpu))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        sampler.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(B=B, L=L, route=route.kind, scorer=route.scorer, rows=rows), f, indent=1)
    print("| cycle | " + " | ".join(PARTS) + " | SM MHz (min) | W (max) | C |")
    print("|---:|" + "---:|" * (len(PARTS) + 3))
    for c in range(a.cycles):
        got = {r["part"]: r for r in rows if r["cycle"] == c}
        mhz = min((r.get("sm_mhz_min", math.inf) for r in got.values()), default=math.inf)
        watts = max((r.get("power_w_max", 0.0) for r in got.values()), default=0.0)
        temp = max((r.get("temp_c", 0.0) for r in got.values()), default=0.0)
        times = " | ".join(f"{got[p]['us']:.1f}" for p in PARTS)
        print(f"| {c} | {times} | {mhz:.0f} | {watts:.0f} | {temp:.0f} |")


if __name__ == "__main__":
    main()
