"""A/B of run 189 (benchmarks/NOTES.md, session 33; run 188 crashed: a first copy let the first
variant's workspaces go while its graphs still used them): ``scorer.pdl`` on (the library) and off,
with more rounds where run 185 read it slower (32x64K, 64x64K), and after a previous kernel that
lets the step launch early. ``PYTHONPATH=. python benchmarks/results/run189_pdl_gate_ab.py`` on a
GPU host (``SHAPES=1x4096,...``, ``ROUNDS``, ``JSON``). Parts: the exact and e4m3 steps and
scorers; ``plain_prev``: the e4m3 step after a kernel that writes the scorer's weights and does
not let the step launch early (a ``mul_``); ``early_prev``: the same after a kernel that lets its
dependents launch as it starts, then writes them (as a model's kernel launched to allow it)."""
import ctypes
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import indexer as ix  # noqa: E402
from graph_timer import capture, replay_us, replayed_outputs, rotation  # noqa: E402

from vllm_sparse_sync.kernels import cuda_topk  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "15"))
SHAPES = [tuple(int(x) for x in s.split("x")) for s in os.environ.get(
    "SHAPES", "1x4096,1x65536,8x65536,64x16384,32x65536,64x65536").split(",")]

# lets the next launch start, then rewrites `n` floats in place (w * 1)
_EARLY = r"""
extern "C" __global__ void early_rewrite(float* w, int n) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    for (int i = threadIdx.x; i < n; i += blockDim.x) w[i] = w[i] * 1.0f;
}
"""


def early_rewriter():
    mod = cuda_topk.module_for(ix.DEV)
    cubin, _ = cuda_topk.compile_source(mod.arch, text=_EARLY, name="early_rewrite.cu")
    module = cuda_topk._check(mod.driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    fn = cuda_topk._check(mod.driver.cuModuleGetFunction(module, b"early_rewrite"), "cuModuleGetFunction")

    def run(w):
        values = (ctypes.c_void_p(w.data_ptr()), ctypes.c_int(w.numel()))
        cuda_topk.launch_values(mod, fn, (1, 1, 1), 256, 0, values, w.device)

    return run


def main():
    rewrite = early_rewriter()
    variants = {"pdl": True, "nopdl": False}
    rows = []
    for B, L in SHAPES:
        copies, ncalls = ix.graph_sizes(B, L)
        inp = ix.Inputs(B, L, copies)
        out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
        graphs, sel, alive = {}, {}, []  # alive: what the graphs use, until they go
        for name, pdl in variants.items():
            config = ix.DEFAULT_CONFIG.with_values(**{"scorer.pdl": pdl})
            ws, ws8 = ix.step_workspaces(B, L, config)
            parts = ix.step_calls(inp, ws, out)
            parts8 = ix.step_calls(inp, ws8, out)

            def plain_prev(i, s=parts8["step"]):
                inp.w.mul_(1.0)  # noqa: B023 (this iteration's inputs)
                return s(i)

            def early_prev(i, s=parts8["step"]):
                rewrite(inp.w)  # noqa: B023
                return s(i)
            alive.append((ws, ws8))
            calls = {"step": parts["step"], "step_fp8": parts8["step"], "plain_prev": plain_prev,
                     "early_prev": early_prev, "scorer": parts["scorer"], "scorer_fp8": parts8["scorer"]}
            for part, call in calls.items():
                graphs[(name, part)] = capture([(lambda i=i, c=call: c(i)) for i in range(ncalls)])
                if part not in ("scorer", "scorer_fp8"):
                    sel[(name, part)] = replayed_outputs(graphs[(name, part)], out)
        base = {p: sel[("nopdl", "step_fp8" if "prev" in p else p)] for _, p in sel}
        bad = [f"{n}/{p}" for (n, p), o in sel.items()
               if not all(torch.equal(a, b) for a, b in zip(o, base[p]))]
        times = {k: [] for k in graphs}
        for it in range(ROUNDS):
            for key in rotation(list(graphs), it):
                times[key].append(replay_us(graphs[key], ncalls))
        for part in sorted({p for _, p in graphs}, key=list(calls).index):
            off = statistics.median(times[("nopdl", part)])
            on = statistics.median(times[("pdl", part)])
            spread = [round(min(times[(n, part)]), 2) for n in variants] + [round(max(times[(n, part)]), 2)
                                                                            for n in variants]
            print(f"{B}x{L} {part:>10}: pdl off {off:7.2f} | on {on:7.2f} ({on - off:+.2f}, {on / off:.4f})"
                  f"  min on/off {spread[0]}/{spread[1]} max {spread[2]}/{spread[3]}", flush=True)
            rows.append(dict(B=B, L=L, part=part, on_us=on, off_us=off, all_on=times[("pdl", part)],
                             all_off=times[("nopdl", part)]))
        print(f"{B}x{L} selections: {'same' if not bad else 'DIFFER ' + ','.join(bad)}", flush=True)
        del graphs, alive
    with open(os.environ.get("JSON", "/tmp/pdl_gate.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
