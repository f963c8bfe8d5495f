"""Host time per decode step: `IndexerMetadataBuilder.build()` and an eager `IndexerStep.run()`.

    python benchmarks/host_overhead.py [--device cuda|cpu] [--batches 1,8,64] [--out FILE.json]

For every decode path (`vllm_sparse_sync.scenarios`) and batch size, the median host
microseconds of one call (time.perf_counter around the call; on CUDA the queue is drained
outside the timed calls, so the time is launch work, not waiting). With `--device cpu` where vLLM
0.33 is installed (`vllm_sparse_sync.vllm`), vLLM's own `DeepseekV32IndexerMetadataBuilder.build()`
runs on the same decode batches in the same process. Targets: `build()` at or under vLLM's, and <= 60 us on
a CUDA host for B <= 64; an eager step <= 100 us.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm_sparse_sync import DecodeBatch, IndexerMetadataBuilder, IndexerStep, SeqLenShadow  # noqa: E402
from vllm_sparse_sync.lengths import dcp_localize, kernel_lengths  # noqa: E402
from vllm_sparse_sync.scenarios import PATHS, DecodePath  # noqa: E402

WARMUP, CALLS = 20, 200
BUILD_TARGET_US, STEP_TARGET_US = 60.0, 100.0


REPEATS = 3


def median_us(fn, device: torch.device, calls: int = CALLS) -> float:
    """The lowest of REPEATS medians of `fn()`'s host microseconds (a shared host's noise only
    adds time); the garbage collector is paused and CUDA work drained every 25 calls, untimed."""
    return min(_median_us(fn, device, calls) for _ in range(REPEATS))


def _median_us(fn, device: torch.device, calls: int) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    gc.collect()
    gc.disable()
    try:
        for i in range(calls):
            if device.type == "cuda" and i % 25 == 0:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    finally:
        gc.enable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def decode_batch(path: DecodePath, B: int, device: torch.device, gen: torch.Generator):
    """B requests with the path's query-length pattern, lengths up to max_model_len / 2."""
    lay = path.layout
    q = [path.query_lens[i % len(path.query_lens)] for i in range(B)]
    max_seq_len = lay.max_model_len // 2
    lens = torch.randint(max_seq_len // 4, max_seq_len + 1, (B,), generator=gen, dtype=torch.int32)
    lens = torch.maximum(lens, torch.tensor(q, dtype=torch.int32))
    lens[0] = max_seq_len
    starts = [0]
    for x in q:
        starts.append(starts[-1] + x)
    qsl = torch.tensor(starts, dtype=torch.int32)
    rows = kernel_lengths(max_seq_len, lay.compress_ratio, lay.dcp_world_size, lay.dcp_rank,
                          lay.cp_interleave)
    pages = math.ceil((rows + 1) / lay.page_size) + 1
    table = torch.randint(0, 1 << 16, (B, pages), generator=gen, dtype=torch.int32)
    local = None
    if path.dcp_local_shadow:
        local = torch.tensor([dcp_localize(int(x), lay.dcp_world_size, lay.dcp_rank, lay.cp_interleave)
                              for x in lens], dtype=torch.int32)
    shadow = SeqLenShadow(lens.clone(), authoritative=path.authoritative, dcp_local_seq_lens_cpu=local)
    batch = DecodeBatch(qsl.to(device, copy=True), qsl, lens.to(device, copy=True), shadow,
                        table.to(device), max_seq_len)
    return batch, sum(q), pages


def bench_one(path: DecodePath, B: int, device: torch.device, gen: torch.Generator) -> dict:
    """Host time of one path's build() (and, on CUDA, of an eager step) at batch B."""
    lay = path.layout
    batch, n_rows, pages = decode_batch(path, B, device, gen)
    builder = IndexerMetadataBuilder(lay, max_num_reqs=max(B, 256), max_num_tokens=max(4 * B, 1024),
                                     max_pages_per_req=pages, device=device)
    res = dict(path=path.name, B=B, rows=n_rows, device=device.type)
    if path.capture:
        res["build_us"] = median_us(lambda: builder.build_for_capture(B, n_rows), device)
    else:
        res["build_us"] = median_us(lambda: builder.build(batch), device)
    if device.type != "cuda":  # the reference on the CPU times Python loops, not launches
        return res
    meta = builder.build(batch)
    step = IndexerStep.for_builder(builder)
    q = torch.randn(n_rows, lay.num_heads, lay.head_dim, generator=gen).to(torch.float8_e4m3fn).to(device)
    w = torch.randn(n_rows, lay.num_heads, generator=gen).to(device)
    cache = torch.zeros(B * pages, lay.page_size * (lay.head_dim + 4), dtype=torch.uint8, device=device)
    out = torch.empty(n_rows, lay.topk, dtype=torch.int32, device=device)
    res["route"] = step.route(n_rows, step.contract(meta)[1]).kind
    res["step_us"] = median_us(lambda: step.run(meta, q, w, cache, out=out), device)
    health = step.health()
    res["step_health"] = "ok" if health.ok else f"{health.stalled_rows} stalled rows"
    return res


def bench_ours(device: torch.device, batches: list[int]) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for path in PATHS:
        for B in batches:
            res = bench_one(path, B, device, gen)
            rows.append(res)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}),
                  flush=True)
    return rows


# each of our decode paths beside the vLLM 0.33 path that does the same work
VLLM_PAIRS = {
    "b12x-compressed": "compressed-c4", "b12x-uncompressed": "decode",
    "b12x-uncompressed-dcp2": "dcp2-rank1", "b12x-uncompressed-async-spec": "mtp-flattened-uniform",
    "deepgemm-compressed": "compressed-c4", "deepgemm-uncompressed": "decode",
    "deepgemm-uncompressed-async-spec": "mtp-native-uniform", "mtp-ragged": "mtp-flattened-ragged",
    "capture": "decode-cudagraph-padded",
}


def bench_vllm(batches: list[int]) -> list[dict]:
    """vLLM's own builder on its paths at the same batch sizes (when vLLM is installed)."""
    try:
        from vllm_sparse_sync.vllm import make_vllm_case
    except ImportError as exc:
        print(f"vLLM side skipped: {exc}", file=sys.stderr)
        return []
    rows = []
    for path in sorted(set(VLLM_PAIRS.values())):
        for B in batches:
            try:
                case = make_vllm_case(path, batch=B, seed=0)
            except ValueError as exc:  # e.g. a ragged batch needs two requests
                print(f"vllm:{path} B={B}: {exc}", file=sys.stderr)
                continue
            us = median_us(lambda c=case: c.builder.build(common_prefix_len=0, common_attn_metadata=c.common),
                           torch.device("cpu"))
            rows.append(dict(path=path, B=B, build_us=us))
            print(json.dumps(dict(path=f"vllm:{path}", B=B, build_us=round(us, 1))), flush=True)
    return rows


def table(ours: list[dict], theirs: list[dict]) -> str:
    vllm_us = {(r["path"], r["B"]): r["build_us"] for r in theirs}
    lines = ["| path | B | build us | vLLM path | vLLM build us | step us | route |",
             "|---|---:|---:|---|---:|---:|---|"]
    for r in ours:
        pair = VLLM_PAIRS.get(r["path"], "-")
        v = vllm_us.get((pair, r["B"]))
        step = f"{r['step_us']:.1f}" if "step_us" in r else "-"
        lines.append(f"| {r['path']} | {r['B']} | {r['build_us']:.1f} | {pair if v else '-'} | "
                     f"{f'{v:.1f}' if v else '-'} | {step} | {r.get('route', '-')} |")
    return "\n".join(lines)


def verdict(ours: list[dict], theirs: list[dict], device: torch.device) -> list[str]:
    out = []
    worst_build = max(ours, key=lambda r: r["build_us"])
    if device.type == "cuda":
        ok = worst_build["build_us"] <= BUILD_TARGET_US
        out.append(f"build: worst {worst_build['build_us']:.1f} us ({worst_build['path']}, "
                   f"B={worst_build['B']}) vs target {BUILD_TARGET_US:.0f} us: {'met' if ok else 'MISSED'}")
        worst_step = max(ours, key=lambda r: r.get("step_us", 0.0))
        ok = worst_step.get("step_us", 0.0) <= STEP_TARGET_US
        out.append(f"eager step: worst {worst_step.get('step_us', 0.0):.1f} us ({worst_step['path']}, "
                   f"B={worst_step['B']}) vs target {STEP_TARGET_US:.0f} us: {'met' if ok else 'MISSED'}")
    if theirs:
        vllm_us = {(r["path"], r["B"]): r["build_us"] for r in theirs}
        over = [(r, vllm_us[(VLLM_PAIRS[r["path"]], r["B"])]) for r in ours
                if (VLLM_PAIRS.get(r["path"]), r["B"]) in vllm_us]
        slower = [(r, v) for r, v in over if r["build_us"] > v]
        out.append(f"build beside vLLM's: {len(over) - len(slower)} of {len(over)} paths at or under"
                   + "".join(f"; OVER: {r['path']} B={r['B']} {r['build_us']:.1f} vs {v:.1f} us"
                             for r, v in slower))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--out", default="")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's builder even if installed")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device visible", file=sys.stderr)
        return 2
    batches = [int(x) for x in a.batches.split(",") if x]
    meta = dict(device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                torch=torch.__version__, python=sys.version.split()[0], calls=CALLS)
    print(json.dumps(meta), flush=True)
    ours = bench_ours(device, batches)
    theirs = [] if a.no_vllm or device.type == "cuda" else bench_vllm(batches)
    print(table(ours, theirs))
    for line in verdict(ours, theirs, device):
        print(line)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(meta=meta, ours=ours, vllm=theirs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
