"""`vllm-sparse-sync selftest`: measure, on the installed torch, which ops synchronize the host
and which detection layer sees each (docs/design.md section 6 lists the layers)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from ..table import text_table
from .cuda_env import no_cuda_reason
from .probes import OPS, Op, make_input

COLUMNS = ("sentinel", "debug_mode", "trace", "runtime_api", "capture")


def _count_region(op: Op, device, layer: str) -> int | None:
    from .guard import SyncCheckUnavailable, sync_recorder

    x = make_input(device)
    op.fn(x)  # warm-up (lazy init, JIT)
    if layer == "sentinel" and not op.tensor_read:
        return None
    rec = sync_recorder(watch=[x] if layer == "sentinel" else (), layers=layer)
    try:
        with rec:
            op.fn(x)
    except SyncCheckUnavailable:
        return None
    return len(rec.records)


def _count_capture(op: Op, device) -> int:
    from .layers.capture_probe import CaptureProbe

    x = make_input(device)
    return len(CaptureProbe(warmup=1).probe(lambda: op.fn(x)))


def _trace_counts() -> dict[str, int | str]:
    """Run every op under the trace layer in a fresh process (the hooks cannot be undone)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trace.json")
        env = dict(os.environ, VLLM_SPARSE_SYNC_TRACE="1",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.run([sys.executable, "-m", __name__, "--trace-child", out], env=env,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not os.path.exists(out):
            return {op.name: "err" for op in OPS} | {"_error": proc.stderr[-2000:]}
        with open(out) as f:
            return json.load(f)


def _trace_child(out: str) -> int:
    counts = {op.name: _count_region(op, "cuda", "trace") for op in OPS}
    with open(out, "w") as f:
        json.dump(counts, f)
    return 0


def measure(layers: Sequence[str] = COLUMNS, device=None) -> list[dict]:
    """One row per op: {op, expected, <layer>: count | None (n/a) | "err"}."""
    cuda = no_cuda_reason() is None
    device = device or ("cuda" if cuda else "cpu")
    trace = _trace_counts() if cuda and "trace" in layers else {}
    rows = []
    for op in OPS:
        row: dict = {"op": op.name, "expected": op.expected}
        for layer in COLUMNS:
            if layer not in layers:
                row[layer] = None
                continue
            if layer != "sentinel" and not cuda:
                row[layer] = None
                continue
            if not op.tensor_read and not cuda:
                row[layer] = None
                continue
            try:
                if layer == "trace":
                    row[layer] = trace.get(op.name)
                elif layer == "capture":
                    row[layer] = _count_capture(op, device)
                else:
                    row[layer] = _count_region(op, device, layer)
            except Exception as exc:  # a probe that cannot run here is a result, not a crash
                row[layer] = f"err: {type(exc).__name__}"
        rows.append(row)
    return rows


def verdict(row: dict) -> tuple[str, bool]:
    """(words, ok) for one row."""
    seen = [k for k in COLUMNS if isinstance(row.get(k), int) and row[k] > 0]
    ran = [k for k in COLUMNS if isinstance(row.get(k), int)]
    if row["expected"] is None:
        return ("measured: " + (", ".join(seen) if seen else "no layer saw a sync")), True
    if row["expected"]:
        if row.get("sentinel") == 0:
            return "sentinel MISSED a host read", False
        if ran and not seen:
            return "NO LAYER caught it", False
        return ("caught by " + ", ".join(seen)) if seen else "not measurable here", True
    if seen:
        return "FALSE POSITIVE in " + ", ".join(seen), False
    return "clean", True


def format_table(rows: list[dict]) -> str:
    head = ("op", "syncs?", *COLUMNS, "verdict")
    cells = []
    for r in rows:
        exp = {True: "yes", False: "no", None: "?"}[r["expected"]]
        vals = ["-" if r[c] is None else str(r[c]) for c in COLUMNS]
        cells.append((r["op"], exp, *vals, verdict(r)[0]))
    return "\n".join(text_table(head, cells))


def rng_after_failed_capture() -> str:
    """Whether CUDA RNG works after the failed captures above."""
    import torch

    try:
        torch.randn(4, device="cuda")
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:
        return f"BROKEN ({exc})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-sparse-sync selftest", description=__doc__)
    parser.add_argument("--layers", default=",".join(COLUMNS),
                        help="comma-separated layers to measure (default: all)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--trace-child", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.trace_child:
        return _trace_child(args.trace_child)
    import torch

    layers = tuple(s.strip() for s in args.layers.split(",") if s.strip())
    reason = no_cuda_reason()
    print(f"torch {torch.__version__}; CUDA: {'yes' if reason is None else 'no (' + reason + ')'}")
    rows = measure(layers)
    print(format_table(rows))
    ok = all(verdict(r)[1] for r in rows)
    if reason is None and "capture" in layers:
        rng = rng_after_failed_capture()
        print(f"CUDA RNG after failed captures: {rng}")
        ok = ok and rng == "ok"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    print("selftest: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
