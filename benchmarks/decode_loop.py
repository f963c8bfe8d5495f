"""The decode loop: tokens per second of a synthetic serving loop under each indexer-bound variant.

    python benchmarks/decode_loop.py                  # the default sweep (H200: about 4-5 min)
    python benchmarks/decode_loop.py --device cpu     # a tiny loop on the CPU (the code path only)

A host runner (async scheduling: it waits for the tokens of step t-1 only after launching step
t) drives a synthetic model on the GPU: N layers, each the project's indexer step (fp8 paged
scorer + top-k, k = 2048, over the live lengths) plus a memory-bound GEMV stand-in for the rest
of the layer, captured in one CUDA graph per variant. Variants run interleaved (A B C D E, A B
C D E, ...): ``legacy`` (the builder's ``legacy_device_sync``: ``seq_lens.max().item()`` each
step), ``broad`` (sync-free, max_model_len bound, our kernels), ``broad-sensitive`` (the same
bound, kernels forced to the bound width), ``exact`` (sync-free, CPU shadow), ``ideal`` (no
metadata work). Per variant: tok/s, step time, GPU time, host time, syncs per step counted by
the harness's runtime-API layer, and whether the sampled token ids match across runs
(every run is compared with the first run of the same length: ``legacy``'s).

Prints a table, writes JSON (``--out``) and a PNG (``--plot``; needs matplotlib: the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm_sparse_sync import IndexerLayout  # noqa: E402
from vllm_sparse_sync.decode_loop import (  # noqa: E402
    VARIANT_NAMES,
    DecodeLoop,
    ModelShape,
    ffn_width,
    variant_named,
)
from vllm_sparse_sync.table import text_table  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
SEED_TABLE = (
    "seed (DS4, H200 pair, TP2): 117.77 tok/s with the .item() sync, 124.66 without (+5.8%); "
    "GLM-5.2 B12X: 77.56 .item(), 72.43 broad active-width, 78.50 revert, 78.20 exact shadow"
)


def ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected non-negative ints, got {text!r}")
    return vals


def variants_arg(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for n in names:
        try:
            variant_named(n)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="model layers (61: DeepSeek-V3.2; 78: GLM-5)")
    ap.add_argument(
        "--weight-mb",
        type=float,
        default=None,
        help="bf16 weights the stand-in reads per layer, MiB (default 512 on CUDA)",
    )
    ap.add_argument("--tokens", type=int, default=None, help="generated tokens per request (512)")
    ap.add_argument("--batches", type=ints, default=None, help="batch sizes (1,8)")
    ap.add_argument("--contexts", type=ints, default=None, help="context lengths (4096,65536)")
    ap.add_argument(
        "--host-us",
        type=float,
        default=None,
        help="other host work per step for the table, us (default 1000)",
    )
    ap.add_argument(
        "--before",
        type=float,
        default=0.5,
        help="share of the host work done before the metadata build (0.5)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the table")
    ap.add_argument(
        "--sweep-host-us",
        type=ints,
        default=None,
        help="host work per step for the sweep, us (0,1000,2000,4000,8000,12000); empty: none",
    )
    ap.add_argument("--sweep-batch", type=int, default=1)
    ap.add_argument("--sweep-context", type=int, default=None, help="(65536)")
    ap.add_argument("--sweep-tokens", type=int, default=None, help="tokens per sweep run (128)")
    ap.add_argument("--max-model-len", type=int, default=None, help="(131072: the broad bound)")
    ap.add_argument("--variants", type=variants_arg, default=list(VARIANT_NAMES))
    ap.add_argument("--sync-steps", type=int, default=8, help="steps under the runtime-API counter")
    ap.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/decode_loop_<device>.json)"
    )
    ap.add_argument("--plot", default=None, help="PNG path (default beside the JSON)")
    args = ap.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available here")
    big = dict(
        layers=61,
        weight_mb=512.0,
        tokens=512,
        batches=[1, 8],
        contexts=[4096, 65536],
        host_us=1000.0,
        sweep_host_us=[0, 1000, 2000, 4000, 8000, 12000],
        sweep_context=65536,
        sweep_tokens=128,
        max_model_len=131072,
    )
    tiny = dict(
        layers=2,
        weight_mb=0.01,
        tokens=8,
        batches=[1, 2],
        contexts=[40, 100],
        host_us=100.0,
        sweep_host_us=[0, 2000],
        sweep_context=100,
        sweep_tokens=4,
        max_model_len=256,
    )
    for key, value in (big if cuda else tiny).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.sweep_context not in args.contexts:
        ap.error(f"--sweep-context {args.sweep_context}: must be one of --contexts {args.contexts}")
    if args.sweep_batch not in args.batches:
        ap.error(f"--sweep-batch {args.sweep_batch}: must be one of --batches {args.batches}")
    if max(args.contexts) + max(args.tokens, args.sweep_tokens) > args.max_model_len:
        ap.error("--contexts + --tokens exceed --max-model-len")
    if not 0 <= args.before <= 1:
        ap.error("--before: must lie in [0, 1]")
    for name in ("rounds", "layers", "tokens", "sweep_tokens", "sync_steps"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')}: must be positive")
    args.sync_steps = min(args.sync_steps, args.tokens)
    args.out = args.out or os.path.join(RESULTS, f"decode_loop_{'h200' if cuda else 'cpu'}.json")
    args.plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    return args


def layout_for(args, cuda: bool) -> IndexerLayout:
    if cuda:
        return IndexerLayout(
            backend="b12x",
            page_size=64,
            topk=2048,
            num_heads=64,
            head_dim=128,
            max_model_len=args.max_model_len,
        )
    return IndexerLayout(
        backend="b12x", page_size=16, topk=16, num_heads=4, head_dim=32, max_model_len=args.max_model_len
    )


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict], syncs: dict) -> dict:
    """Median and spread over a variant's runs (one per round)."""
    tok = [r["tok_s"] for r in runs]
    return dict(
        tok_s=median(tok),
        tok_s_min=min(tok),
        tok_s_max=max(tok),
        tok_s_per_req=median([r["tok_s_per_req"] for r in runs]),
        step_ms=median([r["step_ms"] for r in runs]),
        gpu_ms=median([r["gpu_ms"] for r in runs]),
        host_us=median([r["host_us"] for r in runs]),
        build_us=median([r["build_us"] for r in runs]),
        syncs_per_step=syncs,
        tokens_match=all(r["tokens_match"] for r in runs),
        rounds=len(runs),
    )


def run_config(
    loop: DecodeLoop, args, steps: int, host_us: float, rounds: int, ref: dict, progress: str
) -> dict[str, list[dict]]:
    """Interleaved rounds of every variant; each run's summary with ``tokens_match``: its token
    ids equal those of the first run of the same length (kept in ``ref``, keyed by steps)."""
    out: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(rounds):
        for v in args.variants:
            st = loop.run(v, steps, host_us, before=args.before)
            key = steps
            if key not in ref:
                ref[key] = st.tokens
            s = st.summary()
            s["tokens_match"] = st.tokens == ref[key]
            out[v].append(s)
            print(
                f"  {progress} round {r + 1}/{rounds} host {host_us:.0f} us  {v:16s} "
                f"{s['tok_s']:9.2f} tok/s  step {s['step_ms']:.3f} ms  gpu {s['gpu_ms']:.3f} ms  tokens "
                f"{'match' if s['tokens_match'] else 'DIFFER'}",
                flush=True,
            )
    return out


def sync_text(d: dict) -> str:
    parts = [f"{k} {v:g}" for k, v in sorted(d.items()) if k != "total" and v]
    return f"{d.get('total', 0):g}" + (f" ({', '.join(parts)})" if parts else "")


def table(rows: list[dict], *, host_column: bool = False) -> str:
    head = [
        "B",
        "context",
        *(["host work us"] if host_column else []),
        "variant",
        "tok/s",
        "tok/s/req",
        "spread",
        "step ms",
        "GPU ms",
        "host us",
        "build us",
        "syncs/step",
        "tokens",
    ]
    body = []
    for r in rows:
        s = r["summary"]
        host = [f"{r['host_work_us']:.0f}"] if host_column else []
        body.append(
            [
                str(r["batch"]),
                str(r["context"]),
                *host,
                r["variant"],
                f"{s['tok_s']:.2f}",
                f"{s['tok_s_per_req']:.2f}",
                f"{s['tok_s_min']:.1f}-{s['tok_s_max']:.1f}",
                f"{s['step_ms']:.3f}",
                f"{s['gpu_ms']:.3f}",
                f"{s['host_us']:.0f}",
                f"{s['build_us']:.1f}",
                sync_text(s["syncs_per_step"]),
                "same" if s["tokens_match"] else "DIFFER",
            ]
        )
    return "\n".join(text_table(head, body))


def _target(name: str, ratio: float, floor: float) -> str:
    return f"{name} = {ratio:.3f} (target >= {floor:g})  " + ("met" if ratio >= floor else "MISSED")


def verdicts(rows: list[dict]) -> list[str]:
    by = {(r["batch"], r["context"], r["variant"]): r["summary"] for r in rows}
    out = []
    for B, ctx in sorted({(r["batch"], r["context"]) for r in rows}):
        got = {v: by.get((B, ctx, v)) for v in VARIANT_NAMES}
        ex, leg, ide, br, bs = (got[v] for v in ("exact", "legacy", "ideal", "broad", "broad-sensitive"))
        where = f"B={B} ctx={ctx}: "
        if ex and leg:
            ratio = ex["tok_s"] / leg["tok_s"]
            out.append(where + (_target("exact / legacy", ratio, 1.05) if B == 1
                                else f"exact / legacy = {ratio:.3f}"))
        if ex and ide:
            out.append(where + _target("exact / ideal", ex["tok_s"] / ide["tok_s"], 0.99))
        if br and ex:
            out.append(where + _target("broad / exact", br["tok_s"] / ex["tok_s"], 0.99))
        if bs and ex:
            loss = bs["tok_s"] / ex["tok_s"]
            out.append(where + f"broad-sensitive / exact = {loss:.3f} (the bound-sensitive loss)")
        if ide:
            base = ide["syncs_per_step"].get("total", 0)
            for v in ("exact", "broad", "broad-sensitive"):
                s = got[v]
                if s and s["syncs_per_step"].get("total", 0) > base:
                    syncs = sync_text(s["syncs_per_step"])
                    out.append(where + f"{v} syncs {syncs} per step > ideal's {base:g}  MISSED")
            if leg:
                extra = leg["syncs_per_step"].get("total", 0) - base
                out.append(where + f"legacy syncs {extra:g} more per step than ideal (target >= 1)  "
                           + ("met" if extra >= 1 else "MISSED"))
    differ = [f"{r['batch']}/{r['context']}/{r['variant']}" for r in rows if not r["summary"]["tokens_match"]]
    out.append(
        "token ids identical across variants: " + ("yes" if not differ else "NO: " + ", ".join(differ))
    )
    return out


def plot(sweep: list[dict], path: str, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'vllm-sparse-sync[plot]')"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in sorted({r["variant"] for r in sweep}, key=VARIANT_NAMES.index):
        pts = sorted((r["host_work_us"], r["summary"]["tok_s"]) for r in sweep if r["variant"] == v)
        ax.plot([p[0] / 1000 for p in pts], [p[1] for p in pts], marker="o", label=v)
    ax.set_xlabel("other host work per step (ms)")
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    lay = layout_for(args, cuda)
    shape = ModelShape(
        num_layers=args.layers, weight_mb=args.weight_mb, vocab=min(4096, lay.num_heads * lay.head_dim)
    )
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(
        f"decode loop on {name}: {args.layers} layers, stand-in {args.weight_mb:g} MiB bf16 per layer, "
        f"k={lay.topk}, max_model_len={lay.max_model_len}, variants {', '.join(args.variants)}",
        flush=True,
    )
    t_start = time.perf_counter()
    rows, sweep = [], []
    configs = [(B, ctx) for B in args.batches for ctx in args.contexts]
    for i, (B, ctx) in enumerate(configs):
        is_sweep = (B, ctx) == (args.sweep_batch, args.sweep_context) and args.sweep_host_us
        steps = max(args.tokens, args.sweep_tokens if is_sweep else 0)
        loop = DecodeLoop(lay, shape, batch=B, context=ctx, max_steps=steps, device=device)
        for v in args.variants:
            loop.prepare(v)
        syncs = {v: loop.count_syncs(v, args.sync_steps) for v in args.variants}
        progress = f"[{i + 1}/{len(configs)}] B={B} ctx={ctx}"
        print(
            f"{progress}: {loop.model.ffn} stand-in columns; syncs per step: "
            + "; ".join(f"{v} {sync_text(s)}" for v, s in syncs.items()),
            flush=True,
        )
        ref: dict = {}
        runs = run_config(loop, args, args.tokens, args.host_us, args.rounds, ref, progress)
        for v in args.variants:
            rows.append(
                dict(
                    batch=B,
                    context=ctx,
                    variant=v,
                    host_work_us=args.host_us,
                    summary=summarize(runs[v], syncs[v]),
                    runs=runs[v],
                )
            )
        if is_sweep:
            for h in args.sweep_host_us:
                runs = run_config(loop, args, args.sweep_tokens, h, 1, ref, progress + " sweep")
                for v in args.variants:
                    sweep.append(
                        dict(
                            batch=B,
                            context=ctx,
                            variant=v,
                            host_work_us=h,
                            summary=summarize(runs[v], syncs[v]),
                            runs=runs[v],
                        )
                    )
        del loop
        if cuda:
            torch.cuda.empty_cache()
    print()
    print(
        f"tokens per request: {args.tokens}; other host work per step: {args.host_us:g} us "
        f"({args.before:.0%} before the build); median of {args.rounds} interleaved rounds"
    )
    print(table(rows))
    if sweep:
        print(f"\nsweep: B={args.sweep_batch} ctx={args.sweep_context}, {args.sweep_tokens} tokens per run")
        print(table(sweep, host_column=True))
    lines = verdicts(rows)
    print()
    for line in lines:
        print(line)
    print(SEED_TABLE)
    elapsed = time.perf_counter() - t_start
    print(f"elapsed {elapsed:.0f} s")
    result = dict(
        device=name,
        torch=torch.__version__,
        layers=args.layers,
        weight_mb=args.weight_mb,
        stand_in_columns=ffn_width(lay.num_heads * lay.head_dim, args.weight_mb),
        topk=lay.topk,
        max_model_len=lay.max_model_len,
        tokens=args.tokens,
        host_us=args.host_us,
        before=args.before,
        rounds=args.rounds,
        table=rows,
        sweep=sweep,
        verdicts=lines,
        elapsed_s=elapsed,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    if sweep:
        print(
            plot(
                sweep,
                args.plot,
                f"{name}: B={args.sweep_batch}, context {args.sweep_context}, {args.layers} layers",
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
