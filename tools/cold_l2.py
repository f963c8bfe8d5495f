"""What a cold L2 costs each kernel of our step and of the peer stack.

    python tools/cold_l2.py [--shapes 1x131072,8x65536,1x4096] [--iters 15] [--json FILE]

For each shape (``indexer.py``'s inputs and workspaces), each part is captured in a CUDA graph of
``ncalls`` calls and timed two ways: ``warm``, replays back to back (what ``indexer.py``'s slots
time), and ``cold``, each replay after a 256 MB write that leaves nothing of the part in L2 (data
or code; the write is not timed). In serving, other layers run between two indexer steps, so the
cold time is the one a decode loop sees. Parts: our exact ``step``, its ``scorer`` and ``topk``
launches alone (as the step launches them), and with ``.peers``/``.peers_topk`` carried
DeepGEMM's logits (``dg``), vLLM's cooperative top-k on them (``coop``) and the two in one graph
(``stack``). Prints a table (us a call, and cold - warm); ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers
from cold_start import require_cuda, shapes_arg  # noqa: E402

FLUSH_BYTES = 256 * 2**20
PARTS = ("step", "scorer", "topk", "dg", "coop", "stack")


def cold_replay_us(graph, ncalls: int, flush, iters: int) -> float:
    """Median microseconds per call of ``graph`` replayed right after ``flush()`` each time."""
    from graph_timer import replay_us

    times = []
    for _ in range(iters):
        flush()
        times.append(replay_us(graph, ncalls))
    return statistics.median(times)


def measure(B: int, L: int, iters: int) -> dict:
    import indexer as ix
    from graph_timer import capture, replay_us

    copies, ncalls = ix.graph_sizes(B, L)
    inp = ix.Inputs(B, L, copies)
    ws, _ = ix.step_workspaces(B, L, ix.DEFAULT_CONFIG)
    route = ws.plan_call(B, L, ix.PAGE)
    out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
    parts = ix.step_calls(inp, ws, out)
    dg, vt = ix.load_deepgemm(), ix.load_vllm_topk()
    if dg is not None and vt is not None and B <= 64:
        logits = ix.deepgemm_logits(dg, inp)
        coop = ix.peer_topk_makers(vt, None, None, inp)["vllm_cooperative"]
        dense = logits(0)
        parts["dg"] = lambda i: logits(i)
        parts["coop"] = lambda i: coop(dense)()
        parts["stack"] = lambda i: coop(logits(i))()
    parts["step"](0)  # the logits the top-k alone reads
    sink = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=ix.DEV)
    row = dict(B=B, L=L, route=route.kind, cluster=route.topk_cluster, ncalls=ncalls)
    for name, call in parts.items():
        graph = capture([lambda i=i, call=call: call(i) for i in range(ncalls)])
        warm = statistics.median(replay_us(graph, ncalls) for _ in range(iters))
        cold = cold_replay_us(graph, ncalls, lambda: sink.fill_(1), iters)
        row[f"{name}_warm_us"], row[f"{name}_cold_us"] = round(warm, 3), round(cold, 3)
        del graph
    return row


def table(rows: list[dict]) -> str:
    names = [n for n in PARTS if any(f"{n}_warm_us" in r for r in rows)]
    lines = ["| B | L | " + " | ".join(f"{n} warm / cold / +" for n in names) + " |",
             "|---:|---:|" + "---|" * len(names)]
    for r in rows:
        cells = []
        for n in names:
            w, c = r.get(f"{n}_warm_us"), r.get(f"{n}_cold_us")
            cells.append("-" if w is None else f"{w:.2f} / {c:.2f} / {c - w:+.2f}")
        lines.append(f"| {r['B']} | {r['L']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x131072,8x65536,1x4096")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = shapes_arg(ap, a.shapes)
    if a.iters < 1:
        ap.error(f"--iters: must be >= 1, got {a.iters}")
    require_cuda("cold_l2.py")
    rows = []
    for B, L in shapes:
        rows.append(measure(B, L, a.iters))
        print(json.dumps(rows[-1]), flush=True)
        if a.json:
            json.dump(rows, open(a.json, "w"), indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
