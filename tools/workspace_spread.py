"""Does our step's time depend on which workspace it runs on?

    python tools/workspace_spread.py [--shape 1x131072] [--workspaces 4] [--iters 15]
                                          [--pad-mb 0] [--json FILE]

Run 129 read our step up to 1 us apart between processes at 1-8 rows while the peer stack held
(docs/performance.md). Here one process, one set of inputs (``indexer.py``'s) and
``--workspaces`` serving-size workspaces (256 rows, 128K wide, each allocated anew) plus one sized
to the call: each workspace's exact step, its scorer alone and its top-k alone (on the logits the
scorer left) captured as graphs of their own, all replayed in turn
(``graph_timer.interleaved_replay_us``), so the clock and the inputs are the same for every one
and only the workspace differs. With ``.peers``/``.peers_topk`` carried, DeepGEMM + vLLM's
cooperative top-k joins as a reference. Prints each workspace's times, its logits buffer's address,
and the spread of ours per part; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers
from cold_start import require_cuda, shape_arg  # noqa: E402

PARTS = ("step", "scorer", "topk")


def spread_of(times: dict[str, float], part: str = "step") -> dict:
    """The lowest, highest and max - min of our times of ``part`` (names ``ws...:part``)."""
    ours = [v for k, v in times.items() if k.startswith("ws") and k.endswith(f":{part}")]
    if not ours:
        raise ValueError(f"spread_of: no time named ws*:{part}")
    return dict(lowest=min(ours), highest=max(ours), spread=max(ours) - min(ours))


def table(times: dict[str, float], ptrs: dict[str, int]) -> str:
    """One line a workspace (its parts' times and logits address), then each other graph."""
    lines = ["| workspace | logits at | " + " | ".join(PARTS) + " |", "|---|---|" + "---:|" * len(PARTS)]
    for name, ptr in ptrs.items():
        cells = " | ".join(f"{times[f'{name}:{p}']:.2f}" if f"{name}:{p}" in times else "-" for p in PARTS)
        lines.append(f"| {name} | {ptr:#x} | {cells} |")
    for name, us in times.items():
        if name.split(":")[0] not in ptrs:
            lines.append(f"| {name} | - | {us:.2f} |" + " |" * (len(PARTS) - 1))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x131072")
    ap.add_argument("--workspaces", type=int, default=4)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--pad-mb", type=int, default=0, help="MB allocated (and held) before the workspaces")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    B, L = shape_arg(ap, a.shape)
    if a.workspaces < 1 or a.iters < 1 or a.pad_mb < 0:
        ap.error("--workspaces and --iters: must be >= 1; --pad-mb: >= 0")
    require_cuda("workspace_spread.py")
    import indexer as ix
    from graph_timer import interleaved_replay_us

    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    copies, ncalls = ix.graph_sizes(B, L)
    inp = ix.Inputs(B, L, copies)
    out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
    pad = torch.empty(a.pad_mb << 20, dtype=torch.uint8, device=ix.DEV)  # noqa: F841 (held)
    spaces = {f"ws{j}": ix.step_workspaces(B, L, ix.DEFAULT_CONFIG)[0] for j in range(a.workspaces)}
    spaces["ws_call_sized"] = IndexerTopkWorkspace(B, ix.TOPK, L, ix.DEV, config=ix.DEFAULT_CONFIG)
    named = {}
    for name, ws in spaces.items():
        calls = ix.step_calls(inp, ws, out)
        calls["step"](0)  # the logits the top-k alone reads
        for part in PARTS:
            named[f"{name}:{part}"] = [lambda i=i, call=calls[part]: call(i) for i in range(ncalls)]
    dg, vt = ix.load_deepgemm(), ix.load_vllm_topk()
    if dg is not None and vt is not None and B <= 64:
        logits = ix.deepgemm_logits(dg, inp)
        coop = ix.peer_topk_makers(vt, None, None, inp)["vllm_cooperative"]
        named["stack_vllm_cooperative"] = [lambda i=i: coop(logits(i))() for i in range(ncalls)]
    times = interleaved_replay_us(named, a.iters)
    ptrs = {name: ws.logits.data_ptr() for name, ws in spaces.items()}
    row = dict(B=B, L=L, ncalls=ncalls, us={k: round(v, 3) for k, v in times.items()},
               logits_ptr={k: hex(v) for k, v in ptrs.items()},
               spread={part: {k: round(v, 3) for k, v in spread_of(times, part).items()} for part in PARTS})
    print(table(times, ptrs))
    for part in PARTS:
        got = row["spread"][part]
        print(f"ours, {part}: {got['lowest']:.2f}-{got['highest']:.2f} us, spread {got['spread']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
