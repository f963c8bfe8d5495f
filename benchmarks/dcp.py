"""DCP decode indexer step per rank against the single-GPU step, in one run.

    python benchmarks/dcp.py --world 2                       # 2 GPUs, NCCL, the issue's shapes
    python benchmarks/dcp.py --world 2 --device cpu          # gloo, tiny shapes: the code path only
    python benchmarks/dcp.py --world 2 --merge-route torch   # the torch merge (before the kernels)

Spawns its ranks itself (no torchrun; ``vllm_sparse_sync.testing.RankPool``). On every rank:
the single-GPU step over whole rows (``IndexerStep``, world 1, this rank's GPU) and the DCP
step over the rank's shard (``DcpIndexerStep``: builder output, local scorer and top-k,
all-gather, merge, remap), each captured in a CUDA graph and replayed; times are medians of
replays timed with CUDA events (microseconds per step). Also timed alone, in their own graphs:
the local stage (scorer + local top-k + score read-back) and the all-gather of the candidates,
whose share of the DCP step is reported. On ``--device cpu`` the same code runs eagerly over
gloo with wall-clock timing. Prints a table and writes JSON (``--out``, default
``benchmarks/results/dcp_<device>_w<world>.json``). Inputs are not rotated across L2 copies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GPU_SHAPES = "1x131072,8x65536,64x65536"
CPU_SHAPES = "1x2048,4x1024"


def _timer(device: str, iters: int):

    def time_graph(fn) -> float:
        """Median microseconds of one step: eager warm-up, capture, replays timed by events."""
        if device == "cpu":
            fn()
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e6)
            return statistics.median(times)
        from graph_timer import graph_replay_us

        return graph_replay_us([fn], iters)

    return time_graph


def bench_rank(ctx, shapes: list[tuple[int, int]], k: int, heads: int, iters: int,
               merge_route: str = "auto") -> list[dict]:
    out = []
    for B, L in shapes:
        out.append(bench_shape(ctx, B, L, k, heads, iters, merge_route))
        if ctx.device != "cpu":
            import torch

            torch.cuda.empty_cache()
    return out


def bench_shape(ctx, B: int, L: int, k: int, heads: int, iters: int, merge_route: str = "auto") -> dict:
    import torch
    import torch.distributed as dist

    from vllm_sparse_sync import (
        DcpIndexerStep,
        DecodeBatch,
        IndexerLayout,
        IndexerMetadataBuilder,
        IndexerStep,
        SeqLenShadow,
    )
    from vllm_sparse_sync.distributed import torch_local_candidates
    from vllm_sparse_sync.kernels.synth import random_k_cache
    from vllm_sparse_sync.lengths import dcp_localize

    dev, world, rank = ctx.device, ctx.world_size, ctx.rank
    time_graph = _timer("cpu" if dev == "cpu" else "cuda", iters)
    page, head_dim = 64, 128
    g = torch.Generator().manual_seed(B * 7 + L)
    q = (torch.randn(B, heads, head_dim, generator=g) * 0.7).to(torch.float8_e4m3fn).to(dev)
    w = torch.randn(B, heads, generator=g).to(dev)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    seq = torch.full((B,), L, dtype=torch.int32)
    shadow = SeqLenShadow(seq.clone())
    row = {"B": B, "L": L, "k": k, "world": world, "rank": rank}

    def setup(lay, cache_rows):
        pages = -(-cache_rows // page)
        cache = random_k_cache(B * pages, page, head_dim, device=dev,
                               generator=torch.Generator(device=dev).manual_seed(rank))
        table = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
        builder = IndexerMetadataBuilder(lay, max_num_reqs=B, max_num_tokens=B,
                                         max_pages_per_req=pages, device=dev)
        batch = DecodeBatch(qsl.clone().to(dev), qsl, seq.clone().to(dev), shadow, table, L)
        return cache, builder.build(batch), builder, pages

    # the single-GPU step over whole rows
    glay = IndexerLayout(backend="b12x", topk=k, max_model_len=L, num_heads=heads)
    gcache, gmeta, gbuilder, _ = setup(glay, L)
    single = IndexerStep.for_builder(gbuilder)
    res = torch.empty(B, k, dtype=torch.int32, device=dev)
    if dev == "cpu":  # the reference reads lengths on the host: time the sync-free torch route
        act, width = single.contract(gmeta)
        row["single_us"] = time_graph(lambda: torch_local_candidates(
            q, w, gcache, gmeta.block_table, gmeta.row_lens, k, width, active_width=act))
    else:
        row["single_us"] = time_graph(lambda: single.run(gmeta, q, w, gcache, out=res))
    # the DCP step over this rank's shard
    lay = IndexerLayout(backend="b12x", topk=k, max_model_len=L, num_heads=heads,
                        dcp_world_size=world, dcp_rank=rank)
    cache, meta, _, pages = setup(lay, dcp_localize(L, world, rank))
    step = DcpIndexerStep(lay, max_rows=B, max_pages_per_req=pages, device=dev, merge_route=merge_route)
    row["send_route"], row["merge_route"] = step.send_route, step.merge_route
    dist.barrier()
    row["dcp_us"] = time_graph(lambda: step.run(meta, q, w, cache))
    dist.barrier()
    row["local_us"] = time_graph(lambda: step.local_candidates(meta, q, w, cache))
    send, gathered = step.send[: B * k], step.gathered[: world * B * k]
    dist.barrier()
    row["allgather_us"] = time_graph(lambda: step._gather(gathered, send, group=step.group))
    idx, scores = step.local_candidates(meta, q, w, cache)
    dist.barrier()
    row["merge_us"] = time_graph(lambda: step.merge(idx, scores))  # keys + all-gather + merge + remap
    row["ratio"] = row["dcp_us"] / row["single_us"]
    row["allgather_share"] = row["allgather_us"] / row["dcp_us"]
    return row


def table(rows: list[dict]) -> str:
    from vllm_sparse_sync.table import text_table

    head = ["B", "L", "rank", "single us", "DCP us", "DCP/single", "local us", "all-gather us",
            "all-gather share", "merge+gather us"]
    body = [[str(r["B"]), str(r["L"]), str(r["rank"]), f"{r['single_us']:.1f}", f"{r['dcp_us']:.1f}",
             f"{r['ratio']:.2f}", f"{r['local_us']:.1f}", f"{r['allgather_us']:.1f}",
             f"{r['allgather_share']:.0%}", f"{r['merge_us']:.1f}"] for r in rows]
    return "\n".join(text_table(head, body))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shapes", default=None, help=f"BxL,... (default: {GPU_SHAPES}; cpu: {CPU_SHAPES})")
    p.add_argument("--k", type=int, default=None, help="top-k (default 2048; cpu: 64)")
    p.add_argument("--heads", type=int, default=None, help="indexer heads (default 64; cpu: 16)")
    p.add_argument("--iters", type=int, default=None, help="timed replays (default 50; cpu: 5)")
    p.add_argument("--merge-route", choices=("auto", "cuda", "triton", "torch"), default="auto",
                   help="DcpIndexerStep's merge + remap route (auto: the CUDA merge on CUDA where "
                        "NVRTC is available, else Triton; torch on CPU)")
    p.add_argument("--timeout", type=float, default=540.0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    spec = a.shapes or (CPU_SHAPES if cpu else GPU_SHAPES)
    shapes = [tuple(int(x) for x in s.split("x")) for s in spec.split(",")]
    k = a.k or (64 if cpu else 2048)
    heads = a.heads or (16 if cpu else 64)
    iters = a.iters or (5 if cpu else 50)

    from vllm_sparse_sync.testing import RankPool

    with RankPool(a.world, "gloo" if cpu else "nccl") as pool:
        per_rank = pool.run(bench_rank, shapes, k, heads, iters, a.merge_route, timeout=a.timeout)
    rows = [r for ranks in zip(*per_rank) for r in ranks]
    print(table(rows))
    out = a.out or os.path.join(ROOT, "benchmarks", "results", f"dcp_{a.device}_w{a.world}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    import torch

    meta = {"torch": torch.__version__, "device": a.device, "world": a.world, "k": k, "heads": heads,
            "iters": iters, "merge_route": a.merge_route}
    if not cpu:
        meta["gpu"] = torch.cuda.get_device_name(0)
        meta["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE")
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
