"""A/B of run 180 (benchmarks/NOTES.md, session 32; not kept): the shared-memory carveout
preference of the scorer and top-k kernels. ``PYTHONPATH=. python benchmarks/results/run180_carveout_ab.py``.

Variants: library (driver default), both=100, topk=100, scorer=100 (percent of the unified L1 as
shared memory). Each variant's freshly loaded modules are swapped in for its captures; the step
(exact, fp8), the scorer alone and the top-k alone are timed interleaved.
"""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import indexer as ix  # noqa: E402
from graph_timer import capture, replay_us, rotation  # noqa: E402

from vllm_sparse_sync.kernels import cuda_scorer, cuda_topk  # noqa: E402

CARVE = int(os.environ.get("CARVE", "100"))
ROUNDS = int(os.environ.get("ROUNDS", "7"))
SHAPES = [tuple(int(x) for x in s.split("x")) for s in os.environ.get(
    "SHAPES", "1x4096,1x65536,1x131072,8x65536,32x16384,64x16384,128x8192,64x65536").split(",")]


def carved_topk(index, carve):
    mod = cuda_topk._Module(index)
    orig = mod.function
    attr = mod.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT

    def function(name, smem):
        fn = orig(name, smem)
        if carve is not None:
            cuda_topk._check(mod.driver.cuFuncSetAttribute(fn, attr, carve), "carveout")
        return fn
    mod.function = function
    return mod


def carved_scorer(index, carve):
    mods = {}

    def get(defines):
        m = mods.get(defines)
        if m is None:
            m = cuda_scorer._Module(index, defines)
            orig = m.function
            attr = m.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT

            def function(heads, precise, stages=cuda_scorer.STAGES_SHORT, orig=orig, m=m):
                fn = orig(heads, precise, stages)
                if carve is not None:
                    cuda_topk._check(m.driver.cuFuncSetAttribute(fn, attr, carve), "carveout")
                return fn
            m.function = function
            mods[defines] = m
        return m
    return get


def main():
    index = torch.cuda.current_device()
    variants = {"library": (None, None), f"both{CARVE}": (CARVE, CARVE), f"topk{CARVE}": (CARVE, None),
                f"scorer{CARVE}": (None, CARVE)}
    topk_mods = {n: carved_topk(index, v[0]) for n, v in variants.items()}
    scorer_mods = {n: carved_scorer(index, v[1]) for n, v in variants.items()}
    library_module_for = cuda_scorer.module_for
    current = ["library"]
    cuda_scorer.module_for = lambda idx, defines=(): scorer_mods[current[0]](tuple(defines))
    rows = []
    config = ix.DEFAULT_CONFIG
    for B, L in SHAPES:
        copies, ncalls = ix.graph_sizes(B, L)
        inp = ix.Inputs(B, L, copies)
        ws, ws8 = ix.step_workspaces(B, L, config)
        out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
        parts = ix.step_calls(inp, ws, out)
        parts8 = ix.step_calls(inp, ws8, out)
        calls = {"step": parts["step"], "step_fp8": parts8["step"], "scorer_fp8": parts8["scorer"],
                 "topk": parts["topk"]}
        graphs, sel = {}, {}
        for name in variants:
            current[0] = name
            cuda_topk._MODULES[index] = topk_mods[name]
            for part, call in calls.items():
                graphs[(name, part)] = capture([(lambda i=i, c=call: c(i)) for i in range(ncalls)])
                if part.startswith("step"):
                    graphs[(name, part)].replay()
                    torch.cuda.synchronize()
                    sel[(name, part)] = out.clone()
        same = all(torch.equal(sel[(n, p)], sel[("library", p)]) for (n, p) in sel)
        times = {k: [] for k in graphs}
        for it in range(ROUNDS):
            for key in rotation(list(graphs), it):
                times[key].append(replay_us(graphs[key], ncalls))
        for part in calls:
            base = statistics.median(times[("library", part)])
            line = f"{B}x{L} {part:>10}: library {base:7.2f}"
            for name in variants:
                if name == "library":
                    continue
                t = statistics.median(times[(name, part)])
                line += f" | {name} {t:7.2f} ({t - base:+.2f})"
                rows.append(dict(B=B, L=L, part=part, variant=name, us=t, library_us=base,
                                 all=times[(name, part)], all_library=times[("library", part)]))
            print(line + ("" if same else "  SELECTION DIFFERS"), flush=True)
        del graphs
    cuda_scorer.module_for = library_module_for
    cuda_topk._MODULES.pop(index, None)
    with open(os.environ.get("JSON", "/tmp/carveout.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
