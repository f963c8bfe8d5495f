"""Top-k as KV-cache slots on one GPU: ours in one launch beside the peers' same output.

    python benchmarks/topk_slots.py [--shapes 1x4096,64x65536] [--rounds 3] [--out F.json]

Sparse attention reads the top-k as KV-cache slots (``page_table[r, p // 64] * 64 + p % 64``),
so every serving stack runs a page-table transform after the indexer's top-k: vLLM's sparse MLA
backends a Triton converter launch, FlashInfer an epilogue of its own top-k
(``top_k_page_table_transform``). Per shape (docs/design.md's nine; k 2048, pages of 64), on
the buffers ``benchmarks/indexer.py`` gives every top-k alone (our scorer's logits of rotated
input copies, read L wide) and a page table of distinct random pages per row, in CUDA-graph
replays, us:

* ``ours_us``: our top-k writing positions; ``ours_slots_us``: the same call with
  ``page_table=`` (on sm_90+ the cluster top-k writes the slots itself); ``ours_then_transform_us``:
  positions, then our transform launch (``kernels.triton.slots``); ``transform_us``: that launch
  alone.
* ``fi_<algo>_slots_us``: FlashInfer's top-k with its page-table epilogue
  (``ConfigurablePageTableKernelPolicy``, page bits 6) through ``benchmarks/flashinfer_topk_peer.cu``;
  ``vllm_<name>_then_transform_us``: vLLM's top-k, then our transform launch standing in for
  vLLM's converter (vLLM itself is not on the GPU host; its converter is a Triton kernel of the
  same work).

Each peer output's set of slots is checked against the reference's slots of our positions
(``<name>_check``). ``slots_over_best_peer`` divides ours by the fastest peer that checks;
``fusion_saves_us`` is ``ours_then_transform_us - ours_slots_us``. ``--rounds N`` times every
entry N times a shape, rotating who goes first; each time is the median of its rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import indexer as ix  # noqa: E402  (benchmarks/indexer.py: inputs, logits, peers)

from vllm_sparse_sync.kernels import reference as ref  # noqa: E402

PAGE_BITS = 6


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x4096,64x65536"`` as ``[(1, 4096), (64, 65536)]`` (empty: the nine standard shapes)."""
    if not text:
        return list(ix.SHAPES)
    shapes = []
    for part in text.split(","):
        b, sep, length = part.strip().partition("x")
        if not sep or not b.isdigit() or not length.isdigit() or int(b) < 1 or int(length) < 1:
            raise SystemExit(f"--shapes: {part!r} is not BxL (e.g. 64x65536)")
        shapes.append((int(b), int(length)))
    return shapes


def slot_sets(t: torch.Tensor) -> torch.Tensor:
    return t.sort(dim=1).values


def makers(inp, bufs, table, peers) -> tuple[dict, torch.Tensor]:
    """Every timed entry as ``name -> make(call index) -> call`` on ``bufs[i]`` (128K wide where it
    fits; ours reads them L wide, the peers take the row stride), writing into one output."""
    from vllm_sparse_sync.kernels import ops as tk
    from vllm_sparse_sync.kernels.triton.slots import launch_page_slots
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    B, L = inp.B, inp.L
    out = torch.full((B, ix.TOPK), -1, dtype=torch.int32, device=ix.DEV)
    ws = IndexerTopkWorkspace(B, ix.TOPK, 0, ix.DEV)
    lens = inp.lens
    views = [b[:, :L] for b in bufs]

    def ours(i, slots=False):
        kw = {"page_table": table, "page_size": 1 << PAGE_BITS} if slots else {}
        return lambda: tk.topk_indices(views[i], lens, ix.TOPK, workspace=ws, out=out, **kw)

    def then_transform(call):
        def run():
            call()
            launch_page_slots(out, table, PAGE_BITS)
        return run

    made = {
        "ours": lambda i: ours(i),
        "ours_slots": lambda i: ours(i, True),
        "ours_then_transform": lambda i: then_transform(ours(i)),
        "transform": lambda i: lambda: launch_page_slots(out, table, PAGE_BITS),
    }
    vt, fi = peers
    if vt is not None:
        vws = torch.empty(1024 * 1024, dtype=torch.uint8, device=ix.DEV)
        for name in ("persistent", "cooperative"):
            op = getattr(vt, f"{name}_topk")
            made[f"vllm_{name}_then_transform"] = lambda i, op=op: then_transform(
                lambda: op(bufs[i], lens, out, vws, ix.TOPK, L))
    if fi is not None and hasattr(fi, "fi_topk_page_table"):
        states = torch.zeros(1 << 20, dtype=torch.uint8, device=ix.DEV)  # zeroed once, as FlashInfer does
        lens32 = lens.to(torch.int32).clone()
        for name, algo in ix.FI_ALGOS.items():
            def fi_call(i, algo=algo):
                x = bufs[i]

                def run():
                    err = fi.fi_topk_page_table(
                        x.data_ptr(), out.data_ptr(), table.data_ptr(), table.stride(0), lens32.data_ptr(),
                        B, ix.TOPK, L, x.stride(0), PAGE_BITS, states.data_ptr(), algo,
                        torch.cuda.current_stream().cuda_stream)
                    if err:
                        raise RuntimeError(f"FlashInfer page-table top-k returned cudaError {err}")
                return run
            made[f"fi_{name}_slots"] = fi_call
    return made, out


def bench_shape(B: int, L: int, peers, rounds: int) -> dict:
    copies, ncalls = ix.graph_sizes(B, L)
    inp = ix.Inputs(B, L, min(copies, 2))
    _, nl, _, bufs = ix.peer_logits(inp, ncalls)
    table = inp.tables[0]
    made, out = makers(inp, [bufs[i % nl] for i in range(ncalls)], table, peers)
    res: dict = {"B": B, "L": L, "ncalls": ncalls, "rounds": rounds}
    # the check: each entry's set of slots on buffer 0 against the reference's of our positions
    made["ours"](0)()
    positions = out.clone()
    res["ours_check"] = "ok" if torch.equal(slot_sets(positions), slot_sets(
        ref.topk_indices(bufs[0][:, :L], inp.lens, ix.TOPK))) else "differs"
    want = slot_sets(ref.page_table_slots(positions, table, 1 << PAGE_BITS))
    names = list(made)
    times: dict = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            try:
                times[name].append(ix.timeit(made[name], ncalls))
            except Exception as exc:  # e.g. vLLM's cooperative top-k serves <= 64 rows only
                res[f"{name}_err"] = str(exc).splitlines()[0][:160]
                torch.cuda.synchronize()
    for name in names:
        if not times[name]:
            continue
        res[f"{name}_us"] = statistics.median(times[name])
        if name in ("ours", "transform"):
            continue
        out.fill_(-7)
        made[name](0)()
        torch.cuda.synchronize()
        res[f"{name}_check"] = "ok" if torch.equal(slot_sets(out), want) else "differs"
    return derive(res)


PEER_KEYS = ("fi_auto_slots", "fi_filtered_slots", "fi_multi_cta_slots", "vllm_persistent_then_transform",
             "vllm_cooperative_then_transform")


def derive(res: dict) -> dict:
    """Ratios from the times: the best checked peer, the fusion's saving."""
    peers = {k: res[f"{k}_us"] for k in PEER_KEYS if res.get(f"{k}_check") == "ok"}
    if peers and "ours_slots_us" in res:
        best = min(peers, key=peers.get)
        res["best_peer"] = best
        res["best_peer_us"] = peers[best]
        res["slots_over_best_peer"] = res["ours_slots_us"] / peers[best]
    if "ours_slots_us" in res and "ours_then_transform_us" in res:
        res["fusion_saves_us"] = res["ours_then_transform_us"] - res["ours_slots_us"]
        res["slots_over_positions"] = res["ours_slots_us"] / res["ours_us"]
    return res


COLS = [("B", "{}"), ("L", "{}"), ("ours_us", "{:.2f}"), ("ours_slots_us", "{:.2f}"),
        ("ours_then_transform_us", "{:.2f}"), ("transform_us", "{:.2f}"), ("fi_auto_slots_us", "{:.2f}"),
        ("fi_filtered_slots_us", "{:.2f}"), ("fi_multi_cta_slots_us", "{:.2f}"),
        ("vllm_persistent_then_transform_us", "{:.2f}"), ("vllm_cooperative_then_transform_us", "{:.2f}"),
        ("best_peer", "{}"), ("slots_over_best_peer", "{:.3f}"), ("fusion_saves_us", "{:.2f}")]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(c for c, _ in COLS) + " |", "|" + "---:|" * len(COLS)]
    for r in rows:
        lines.append("| " + " | ".join(f.format(r[c]) if c in r else "-" for c, f in COLS) + " |")
    met = [r for r in rows if r.get("slots_over_best_peer", 9) <= 1.0]
    measured = [r for r in rows if "slots_over_best_peer" in r]
    lines.append(f"ours (slots) at or under the best peer's slots: {len(met)}/{len(measured)}")
    bad = [f"{r['B']}x{r['L']} {k}" for r in rows for k, v in r.items() if k.endswith("_check") and v != "ok"]
    if bad:
        lines.append("checks that failed: " + ", ".join(bad))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="", help="BxL,... (default: the nine of docs/design.md)")
    ap.add_argument("--rounds", type=int, default=3, help="times each entry is timed a shape, rotated")
    ap.add_argument("--out", default="", help="JSON of every shape's times and ratios")
    a = ap.parse_args()
    shapes = parse_shapes(a.shapes)
    if a.rounds < 1:
        raise SystemExit("--rounds: must be >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("topk_slots.py times CUDA kernels: no CUDA device here")
    peers = (ix.load_vllm_topk(), ix.load_flashinfer_topk())
    rows = []
    for n, (B, L) in enumerate(shapes, 1):
        print(f"[{n}/{len(shapes)}] {B}x{L} ...", flush=True)
        rows.append(bench_shape(B, L, peers, a.rounds))
        torch.cuda.empty_cache()
    print(table(rows))
    if a.out:
        with open(a.out, "w") as f:
            meta = {"device": torch.cuda.get_device_name(), "rounds": a.rounds}
            json.dump({"meta": meta, "shapes": rows}, f, indent=1)
    ours_bad = [k for r in rows for k, v in r.items()
                if k.startswith("ours") and k.endswith("_check") and v != "ok"]
    sys.exit(1 if ours_bad else 0)


if __name__ == "__main__":
    main()
