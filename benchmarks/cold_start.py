"""What a fresh process pays before its first decode steps: compiles and first launches, part by part.

    python benchmarks/cold_start.py [--shapes 1x4096,64x16384] [--json FILE]

Each line is one part, timed in this process the first time it runs and then again (the second
time is the warm cost): the CUDA top-k's NVRTC compile, the CUDA scorer's builds, and for each
shape the first step of every route the benchmark times (CUDA scorer + CUDA top-k, the fp8 dot,
the Triton scorer, the fused Triton route for <= 8 rows) and a CUDA-graph capture of the step.
Run it in a fresh process on a machine without Triton's cache (``TRITON_CACHE_DIR`` pointing to
an empty folder) and without the NVRTC cubin cache (``VLLM_SPARSE_SYNC_CACHE_DIR`` likewise) to
see what a serving process's first step costs; run it again to see what a restart pays. Prints
a line a part as it goes and a table at the end; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOPK, PAGE = 2048, 64


def parse_shapes(text: str, option: str = "--shapes") -> list[tuple[int, int]]:
    """``"1x4096,64x16384"`` -> ``[(1, 4096), (64, 16384)]``; a clear error, naming ``option``, for
    anything else."""
    shapes = []
    for part in (p for p in text.split(",") if p):
        try:
            b, l_ = (int(x) for x in part.split("x"))
        except ValueError:
            raise ValueError(f"{option}: {part!r} is not ROWSxWIDTH (e.g. 1x4096)") from None
        if b < 1 or l_ < PAGE or l_ % PAGE:
            raise ValueError(f"{option}: {part!r} needs rows >= 1 and a width that is a multiple of {PAGE}")
        shapes.append((b, l_))
    if not shapes:
        raise ValueError(f"{option}: give at least one ROWSxWIDTH")
    return shapes


def parse_one_shape(text: str, option: str = "--shape") -> tuple[int, int]:
    """One ``ROWSxWIDTH`` (``parse_shapes``'s rules), a clear error naming ``option`` for a list."""
    shapes = parse_shapes(text, option)
    if len(shapes) > 1:
        raise ValueError(f"{option}: one ROWSxWIDTH, got {text!r}")
    return shapes[0]


def shapes_arg(ap: argparse.ArgumentParser, text: str, option: str = "--shapes") -> list[tuple[int, int]]:
    """``parse_shapes`` of an option's text; bad text ends the script as argparse does (exit 2)."""
    try:
        return parse_shapes(text, option)
    except ValueError as exc:
        ap.error(str(exc))


def shape_arg(ap: argparse.ArgumentParser, text: str, option: str = "--shape") -> tuple[int, int]:
    """``parse_one_shape`` of an option's text; bad text ends the script as argparse does (exit 2)."""
    try:
        return parse_one_shape(text, option)
    except ValueError as exc:
        ap.error(str(exc))


def require_cuda(script: str, what: str = "times CUDA kernels") -> None:
    """Exit 2 with one line on stderr where no CUDA device is visible."""
    if not torch.cuda.is_available():
        print(f"error: benchmarks/{script} {what} and needs a CUDA device", file=sys.stderr)
        sys.exit(2)


def timed(rows: list[dict], part: str, fn) -> None:
    """Run ``fn`` twice, synchronizing after each; record and print the first and second times."""
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rows.append(dict(part=part, first_s=times[0], second_s=times[1]))
    print(f"{part}: first {times[0]:.2f} s, then {times[1] * 1e3:.2f} ms", flush=True)


ROUTES = {"default": {}, "fp8 dot": {"precise": False}, "Triton only": {"cuda": False}}
"""the step's routes the indexer benchmark times, as config overrides"""


def shape_parts(rows: list[dict], B: int, L: int, tk, workspace_cls, default_config, inputs_cls) -> None:
    """One shape's first steps on every route of ``ROUTES``, then a graph capture of the default step."""
    inp = inputs_cls(B, L, copies=2)
    out = torch.empty(B, TOPK, dtype=torch.int32, device="cuda")

    def step(ws, i=0):
        tk.indexer_topk(*inp.args(i), TOPK, width=L, workspace=ws, out=out)

    for name, values in ROUTES.items():
        ws = workspace_cls(max(B, 256), TOPK, 131072, "cuda", config=default_config.with_values(**values))
        route = ws.plan_call(B, L, PAGE)
        timed(rows, f"{B}x{L} step, {name} ({route.kind}, {route.scorer} scorer)", lambda ws=ws: step(ws))
    ws = workspace_cls(max(B, 256), TOPK, 131072, "cuda")

    def capture():
        step(ws)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(ws, 1)
        g.replay()

    timed(rows, f"{B}x{L} graph capture of the default step", capture)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x4096,64x16384")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = shapes_arg(ap, a.shapes)
    require_cuda("cold_start.py", "times CUDA compiles and launches")
    print(f"TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR', '(default)')}", flush=True)
    rows: list[dict] = []
    t0 = time.perf_counter()
    from indexer import Inputs  # the benchmark's inputs (its imports load Triton and the package)

    from vllm_sparse_sync.kernels import DEFAULT_CONFIG
    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer
    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk
    from vllm_sparse_sync.kernels import ops as tk
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    rows.append(dict(part="imports", first_s=time.perf_counter() - t0, second_s=0.0))
    print(f"imports: {rows[-1]['first_s']:.2f} s", flush=True)
    from vllm_sparse_sync.kernels.cuda import nvrtc_cache

    print(f"NVRTC cubin cache: {nvrtc_cache.cache_dir() or 'off'}", flush=True)
    dev = torch.cuda.current_device()
    timed(rows, "CUDA top-k module (NVRTC)", lambda: cuda_topk.module_for(dev))
    rows[-1]["origin"] = cuda_topk.module_for(dev).origin
    timed(rows, "CUDA scorer builds (NVRTC)", lambda: cuda_scorer.warmup("cuda"))
    rows[-1]["origin"] = ", ".join(sorted({m.origin for m in cuda_scorer._MODULES.values()}))
    for B, L in shapes:
        shape_parts(rows, B, L, tk, IndexerTopkWorkspace, DEFAULT_CONFIG, Inputs)
    print("\n| part | first (s) | second (ms) | cubin from |\n| --- | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['part']} | {r['first_s']:.2f} | {r['second_s'] * 1e3:.2f} | {r.get('origin', '')} |")
    if a.json:
        meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                    triton_cache_dir=os.environ.get("TRITON_CACHE_DIR"))
        json.dump(dict(meta=meta, rows=rows), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
