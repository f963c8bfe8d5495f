"""The DCP merge kernels on one GPU (no collective): exact against the torch path they replace,
and timed beside it by CUDA-graph replay.

    python benchmarks/dcp_merge_check.py [--out FILE.json]

For world 2 and 4 and B = 1, 8, 64 rows at k = 2048: candidate keys from random local top-k
positions and scores (with ties), the gathered buffer as an all-gather would leave it, then the
send kernel + merge kernel against ``dcp.candidate_keys`` + ``dcp.merge_candidate_keys`` +
``dcp.global_to_local``. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_timer import graph_replay_us  # noqa: E402

from vllm_sparse_sync import dcp  # noqa: E402
from vllm_sparse_sync.kernels.triton_dcp_merge import dcp_merge, dcp_send_keys  # noqa: E402
from vllm_sparse_sync.table import text_table  # noqa: E402

K = 2048


def case(world: int, rows: int, interleave: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    local = torch.stack([torch.randperm(8 * K, generator=g, device="cuda")[:K] for _ in range(rows)]).int()
    local[:, -7:] = -1  # padding
    scores = torch.randn(world, rows, K, generator=g, device="cuda").round(decimals=1)  # ties
    return local, scores


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows_out, errors = [], []
    for world in (2, 4):
        for rows in (1, 8, 64):
            interleave = 64 if rows == 8 else 1
            local, scores = case(world, rows, interleave, seed=world * 100 + rows)
            keys, merged, lidx, mask = torch_path(local, scores, world, interleave)
            send = torch.empty(world, rows * K, dtype=torch.int64, device="cuda")
            gi = torch.empty(rows, K, dtype=torch.int32, device="cuda")
            li, lm = torch.empty_like(gi), torch.empty(rows, K, dtype=torch.bool, device="cuda")

            def kernels_once():
                for r in range(world):  # each rank's send kernel, as the all-gather would lay them out
                    dcp_send_keys(
                        local, scores[r], send[r], world=world, rank=r, interleave=interleave, gather=False
                    )
                dcp_merge(
                    send.view(world, rows, K), K, gi, li, lm, world=world, rank=0, interleave=interleave
                )

            kernels_once()
            torch.cuda.synchronize()
            ok = (
                torch.equal(send.view(world, rows, K), keys)
                and torch.equal(gi, merged)
                and torch.equal(li, lidx)
                and torch.equal(lm, mask)
            )
            if not ok:
                errors.append(f"world {world} rows {rows}: kernels differ from the torch path")
            merge_us = graph_replay_us(
                [
                    lambda: dcp_merge(
                        send.view(world, rows, K), K, gi, li, lm, world=world, rank=0, interleave=interleave
                    )
                ],
                20,
            )
            send_us = graph_replay_us(
                [
                    lambda: dcp_send_keys(
                        local, scores[0], send[0], world=world, rank=0, interleave=interleave, gather=False
                    )
                ],
                20,
            )
            torch_us = graph_replay_us([lambda: torch_path(local, scores, world, interleave)], 20)
            row = dict(
                world=world,
                rows=rows,
                exact=ok,
                send_us=send_us,
                merge_us=merge_us,
                torch_all_ranks_us=torch_us,
            )
            rows_out.append(row)
            print(
                json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    print(
        "\n".join(
            text_table(
                ["world", "rows", "exact", "send us", "merge us", "torch path us (all ranks' keys)"],
                [
                    [
                        str(r["world"]),
                        str(r["rows"]),
                        "yes" if r["exact"] else "NO",
                        f"{r['send_us']:.1f}",
                        f"{r['merge_us']:.1f}",
                        f"{r['torch_all_ranks_us']:.1f}",
                    ]
                    for r in rows_out
                ],
            )
        )
    )
    print("errors: " + ("none" if not errors else "; ".join(errors)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(k=K, rows=rows_out, errors=errors), f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
