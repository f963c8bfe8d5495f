"""A/B of runs 182 and 185 (benchmarks/NOTES.md, session 32): the CUDA scorer as a programmatic
dependent launch (``scorer.pdl``) and the top-k letting its dependents launch (``TOPK_TRIGGER``),
each on and off. ``PYTHONPATH=. python benchmarks/results/run182_185_pdl_ab.py`` on a GPU host
(``SHAPES=1x4096,...``, ``ROUNDS``, ``JSON``). Variants: before (neither), library (both),
trig_only, pdl_only; each variant's top-k module is swapped in for its captures. Parts: the exact
and e4m3 steps, the e4m3 step after a kernel that writes the scorer's weights (``fstep_fp8``: a
previous kernel that does not let the step launch early), the top-k alone, the e4m3 scorer alone."""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import indexer as ix  # noqa: E402
from graph_timer import capture, replay_us, replayed_outputs, rotation  # noqa: E402
from step_timeline import module_from_text  # noqa: E402

from vllm_sparse_sync.kernels import cuda_topk  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "7"))
SHAPES = [tuple(int(x) for x in s.split("x")) for s in os.environ.get(
    "SHAPES", "1x4096,1x65536,1x131072,8x65536,32x16384,64x16384,128x8192,32x65536,64x65536").split(",")]


def topk_module(index, trigger):
    return module_from_text(index, f"#define TOPK_TRIGGER {int(trigger)}\n" + cuda_topk.source())


def main():
    index = torch.cuda.current_device()
    mods = {False: topk_module(index, False), True: topk_module(index, True)}
    # name -> (top-k triggers, scorer.pdl)
    variants = {"before": (False, False), "library": (True, True), "trig_only": (True, False),
                "pdl_only": (False, True)}
    rows = []
    for B, L in SHAPES:
        copies, ncalls = ix.graph_sizes(B, L)
        inp = ix.Inputs(B, L, copies)
        out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
        calls = {}
        for name, (_, pdl) in variants.items():
            config = ix.DEFAULT_CONFIG.with_values(**{"scorer.pdl": pdl})
            ws, ws8 = ix.step_workspaces(B, L, config)
            parts = ix.step_calls(inp, ws, out)
            parts8 = ix.step_calls(inp, ws8, out)

            def foreign(i, s=parts8["step"]):  # a kernel that writes the scorer's weights, then the step
                inp.w.mul_(1.0)  # noqa: B023 (this iteration's inputs)
                return s(i)
            calls[name] = {"step": parts["step"], "step_fp8": parts8["step"], "fstep_fp8": foreign,
                           "topk": parts["topk"], "scorer_fp8": parts8["scorer"]}
        graphs, sel = {}, {}
        for name, (trig, _) in variants.items():
            cuda_topk._MODULES[index] = mods[trig]
            for part, call in calls[name].items():
                graphs[(name, part)] = capture([(lambda i=i, c=call: c(i)) for i in range(ncalls)])
                if "step" in part:
                    sel[(name, part)] = replayed_outputs(graphs[(name, part)], out)
        bad = [f"{n}/{p}" for (n, p), o in sel.items()
               if not all(torch.equal(a, b) for a, b in zip(o, sel[("before", p)]))]
        times = {k: [] for k in graphs}
        for it in range(ROUNDS):
            for key in rotation(list(graphs), it):
                times[key].append(replay_us(graphs[key], ncalls))
        for part in calls["before"]:
            base = statistics.median(times[("before", part)])
            line = f"{B}x{L} {part:>10}: before {base:7.2f}"
            for name in variants:
                if name == "before":
                    continue
                t = statistics.median(times[(name, part)])
                line += f" | {name} {t:7.2f} ({t - base:+.2f})"
                rows.append(dict(B=B, L=L, part=part, variant=name, us=t, before_us=base,
                                 all=times[(name, part)], all_before=times[("before", part)]))
            print(line, flush=True)
        print(f"{B}x{L} selections: {'same' if not bad else 'DIFFER ' + ','.join(bad)}", flush=True)
        del graphs
    cuda_topk._MODULES.pop(index, None)
    with open(os.environ.get("JSON", "/tmp/pdl.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
