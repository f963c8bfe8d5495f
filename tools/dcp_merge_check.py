"""The DCP merge kernels on one GPU (no collective): exact against the torch path they replace,
and timed beside it by CUDA-graph replay.

    python tools/dcp_merge_check.py [--out FILE.json]

For world 2, 4 and 8 and B = 1, 8, 64 rows at k = 2048: candidate keys from random local
top-k positions and scores (with ties), the gathered buffer as an all-gather would leave it,
then the send kernel and both merge kernels (CUDA; Triton where its rows fit, world 2) against
``dcp.candidate_keys`` + ``dcp.merge_candidate_keys`` + ``dcp.global_to_local``. Prints a
table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers

from graph_timer import graph_replay_us  # noqa: E402

from vllm_sparse_sync import dcp  # noqa: E402
from vllm_sparse_sync.kernels.cuda import dcp_merge as cuda_dcp_merge  # noqa: E402
from vllm_sparse_sync.kernels.triton.dcp_merge import dcp_merge, dcp_send_keys, merge_fits  # noqa: E402
from vllm_sparse_sync.table import text_table  # noqa: E402

K = 2048


def case(world: int, rows: int, interleave: int, seed: int, ties: bool):
    g = torch.Generator(device="cuda").manual_seed(seed)
    local = torch.stack([torch.randperm(8 * K, generator=g, device="cuda")[:K] for _ in range(rows)]).int()
    local[:, -7:] = -1  # padding
    scores = torch.randn(world, rows, K, generator=g, device="cuda")
    return local, scores.round(decimals=1) if ties else scores  # ties: about 60 distinct scores


def torch_path(local, scores, world, interleave):
    keys = torch.stack(
        [
            dcp.candidate_keys(scores[r], dcp.local_to_global(local, world, r, interleave))
            for r in range(world)
        ]
    )
    merged = dcp.merge_candidate_keys(keys, K)
    lidx = dcp.global_to_local(merged, world, 0, interleave)
    return keys, merged, lidx, lidx >= 0


def run_case(world: int, rows: int, ties: bool, errors: list[str]) -> dict:
    """One world size, row count and score style: the kernels against the torch path, and their
    timings."""
    interleave = 64 if rows == 8 else 1
    local, scores = case(world, rows, interleave, seed=world * 100 + rows, ties=ties)
    keys, merged, lidx, mask = torch_path(local, scores, world, interleave)
    send = torch.empty(world, rows * K, dtype=torch.int64, device="cuda")
    gi = torch.empty(rows, K, dtype=torch.int32, device="cuda")
    li, lm = torch.empty_like(gi), torch.empty(rows, K, dtype=torch.bool, device="cuda")
    gathered = send.view(world, rows, K)

    def send_rank(r: int) -> None:
        dcp_send_keys(local, scores[r], send[r], world=world, rank=r, interleave=interleave, gather=False)

    merges = {}
    if merge_fits(world, K, K):
        merges["triton"] = lambda: dcp_merge(gathered, K, gi, li, lm, world=world, rank=0,
                                             interleave=interleave)
    if cuda_dcp_merge.status("cuda")[0] and cuda_dcp_merge.merge_fits(world, K):
        merges["cuda"] = lambda: cuda_dcp_merge.cuda_dcp_merge(gathered, K, gi, li, lm, world=world,
                                                               rank=0, interleave=interleave)
    for r in range(world):  # every rank's keys, laid out as the all-gather leaves them
        send_rank(r)
    torch.cuda.synchronize()
    row = dict(world=world, rows=rows, scores="ties" if ties else "plain",
               send_exact=torch.equal(gathered, keys))
    what = f"world {world} rows {rows} {row['scores']}"
    if not row["send_exact"]:
        errors.append(f"{what}: the send kernel differs from the torch keys")
    for name, merge in merges.items():
        gi.fill_(7), li.fill_(7), lm.fill_(True)
        merge()
        torch.cuda.synchronize()
        ok = torch.equal(gi, merged) and torch.equal(li, lidx) and torch.equal(lm, mask)
        row[f"{name}_exact"] = ok
        if not ok:
            errors.append(f"{what}: the {name} merge differs from the torch path")
        row[f"{name}_merge_us"] = graph_replay_us([merge], 20)
    row["send_us"] = graph_replay_us([lambda: send_rank(0)], 20)
    row["torch_all_ranks_us"] = graph_replay_us([lambda: torch_path(local, scores, world, interleave)], 20)
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows_out: list[dict] = []
    errors: list[str] = []
    for world in (2, 4, 8):
        for rows in (1, 8, 64):
            for ties in (False, True):
                rows_out.append(run_case(world, rows, ties, errors))

    def cell(r, name):
        us = r.get(f"{name}_merge_us")
        return "-" if us is None else f"{us:.1f}" + ("" if r[f"{name}_exact"] else " (WRONG)")

    head = ["world", "rows", "scores", "send exact", "send us", "cuda merge us", "triton merge us",
            "torch path us (all ranks' keys)"]
    body = [[str(r["world"]), str(r["rows"]), r["scores"], "yes" if r["send_exact"] else "NO",
             f"{r['send_us']:.1f}", cell(r, "cuda"), cell(r, "triton"),
             f"{r['torch_all_ranks_us']:.1f}"] for r in rows_out]
    print("\n".join(text_table(head, body)))
    print("errors: " + ("none" if not errors else "; ".join(errors)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(k=K, rows=rows_out, errors=errors), f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
