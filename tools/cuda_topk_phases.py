"""Where the cluster-route top-k spends its time: the kernel source cut short at
each phase (an experiment copy, compiled here; the library source is unchanged), timed by
CUDA-graph replay. Phase times are differences of cumulative times.

    python tools/cuda_topk_phases.py [--cases 1:1x4096,8:1x65536,2:64x65536]

A case is ``C:BxL`` (C CTAs per row, B rows of L live keys, host width L) or ``C:BxL/W`` (host
width W: the plan a wider bound gets, e.g. a short row on a cluster's first CTA), with ``@T`` at
the end for a launch of T threads per CTA (default: the planner's for that width). ``--define
SHORT_ACT=256`` compiles a variant of the source (a macro it leaves open); ``--stops 99`` times
the whole kernel only (one compile). ``--source A.cu --source ''`` times copies side by side on
the same inputs: every source's and cut's graph of a case is replayed in turn, ``--rounds``
rounds in rotated order (a source timed first reads faster at one 4K row), the median kept;
each source's shared memory is sized by its own layout of the pass counts (``source_plan``), and
each source's whole kernel (stop 99) is checked to select what the first source's does
(``output``: same or differs) and reported with its registers and spilled bytes (ptxas);
``--slots 64`` times the slots entries instead (the slots module's source, ``TOPK_SLOTS_MODULE``:
the top-k written as KV-cache slots through a page table of distinct random pages of that size
per row), copies side by side as above.
``--logits indexer --per-seed`` times benchmarks/indexer.py's
logits of each seed on its own (the top-k's time follows how many keys share the threshold's
bins). Only the kernels the cases launch are compiled, the cuts in parallel.

    python tools/cuda_topk_phases.py --logits indexer --per-seed --stops 99 \
        --cases 8:1x131072 --source old.cu --source ''
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import re
import sys
import types

import torch

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers

from graph_timer import graph_replay_us, interleaved_replay_us  # noqa: E402

from vllm_sparse_sync.kernels.cuda import topk as cuda_topk  # noqa: E402
from vllm_sparse_sync.kernels import reference as ref  # noqa: E402

K = 2048
# (stop, anchor in topk.cu, code inserted before each line that holds it): each stop ends the
# kernel there
CUTS = [
    (1, "    if (n <= k) {  // cluster-uniform",
     "if (STOP_AT == 1) { if (tid == 0) o[0] = n; return; }\n"),
    (2, "    // refine on the next",
     "if (STOP_AT == 2) { if (tid == 0) o[0] = (int)(klo ^ need); return; }\n"),
    (3, "    // listed: the bin's keys",
     "if (STOP_AT == 3) { if (tid == 0) o[0] = (int)(klo ^ khi ^ need); return; }\n"),
    (4, "    if (!any) return;",
     "if (STOP_AT == 4) { if (tid == 0) o[0] = (int)(ra ^ rt); return; }\n"),
]
# finer cuts inside the register body (``--stops 0,1,11,12,2,21,22,3,31,32,4,99``)
CUTS += [
    (11, "    const u32* totals = hist;",
     "if (STOP_AT == 11) { if (tid == 0) o[0] = (int)hist[7]; return; }\n"),
    (12, "find_bin<ACT, BAR>(totals, BINS_A",  # (after `if (!taken)` since the counts module)
     "if (STOP_AT == 12) { if (tid == 0) o[0] = (int)totals[7]; return; }\n"),
    (21, "        totals = h;",
     "if (STOP_AT == 21) { if (tid == 0) o[0] = (int)h[7]; return; }\n"),
    (22, "        const u32 base = sh >= 32 ? 0u : (klo >> sh) << sh;",
     "if (STOP_AT == 22) { if (tid == 0) o[0] = (int)totals[7]; return; }\n"),
    (31, "        const u32 c = (u32)(tid / G);",
     "if (STOP_AT == 31) { if (tid == 0) o[0] = (int)s_tkey[1]; return; }\n"),
    (32, "    // collect: per group",
     "if (STOP_AT == 32) { if (tid == 0) o[0] = (int)(kv ^ kp); return; }\n"),
]
STOPS = (0, 1, 11, 12, 2, 21, 22, 3, 31, 32, 4, 99)
DEFAULT_STOPS = (0, 1, 2, 3, 4, 99)
NAMES = {0: "launch (empty)", 1: "live length", 11: "pass A counted", 12: "pass A pushed",
         2: "load + pass A", 21: "refine counted", 22: "refine found", 3: "refine",
         31: "listed gathered", 32: "selection closed", 4: "count + scan", 99: "write"}


INSTANCE = r"(TOPK_CLUSTER_KERNEL|TOPK_KERNEL|DCP_MERGE_KERNEL)\("


def keep_kernels(text: str, keep: set[tuple[int, int]] | None) -> str:
    """The source with only the aligned cluster kernels of ``keep`` ((C, threads) pairs)
    instantiated (a fraction of the compile time); ``None``: all of them."""
    if keep is None:
        return text
    wanted = {f"TOPK_CLUSTER_KERNEL({c}, {t}, 1)" for c, t in keep}

    def instance(line: str) -> str:  # the instantiation without a trailing comment
        return line.split("//", 1)[0].strip()

    lines = [ln for ln in text.splitlines(keepends=True)
             if not re.match(INSTANCE, ln) or instance(ln) in wanted]
    missing = wanted - {instance(ln) for ln in lines}
    if missing:
        raise ValueError(f"the source instantiates none of {sorted(missing)}")
    return "".join(lines)


def cut_source(stop: int, defines: tuple[str, ...] = (), base: str | None = None,
               keep: set[tuple[int, int]] | None = None) -> str:
    text = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines) + keep_kernels(
        base or cuda_topk.source(), keep)
    for _, anchor, code in CUTS:  # in each body that has the phase (registers, shared memory)
        assert text.count(anchor) >= 1, anchor
        text = "".join(code + line if anchor in line else line for line in text.splitlines(keepends=True))
    head = "    const int row = blockIdx.y;\n    const u32 rank"
    assert text.count(head) == 1
    empty = "    if (STOP_AT == 0) { if (threadIdx.x == 0) out[blockIdx.y] = 0; return; }\n"
    text = text.replace(head, empty + head)
    return f"#define STOP_AT {stop}\n" + text


CASE = re.compile(r"(\d+):(\d+)x(\d+)(?:/(\d+))?(?:@(\d+))?")
WORDS = re.compile(r"constexpr int words = C == 1 \? ([^:;]+) : ([^;]+);")


def source_pass_words(text: str) -> tuple[int, int]:
    """The words of pass counts a copy of topk.cu lays out before its keys, with one CTA
    and with more (``topk_cluster_row``'s ``words``, from the copy's own #defines): an
    experiment copy may lay out more than the library's host sizes shared memory for."""
    m = WORDS.search(text)
    if m is None:
        raise ValueError("the source has no `constexpr int words = C == 1 ? ... : ...;` (topk_cluster_row)")
    defines = dict(re.findall(r"#define ([A-Z_][A-Z0-9_]*) (\([0-9 +*]+\))", text))

    def value(expr: str) -> int:
        def name(n: re.Match) -> str:
            if n[0] not in defines:
                raise ValueError(f"words: {n[0]} is not a #define of digits, + and * in the source")
            return defines[n[0]]

        digits = re.sub(r"[A-Z_][A-Z0-9_]*", name, expr.strip())
        if not re.fullmatch(r"[0-9 +*()]+", digits):
            raise ValueError(f"words: cannot evaluate {expr!r}")
        return int(eval(digits))  # noqa: S307 (digits, +, * and parentheses only)

    return value(m[1]), value(m[2])


def source_plan(plan, cluster: int, text: str, smem_optin: int):
    """``plan`` with the shared memory a copy of the source needs for it (the same keys per CTA
    and threads); ValueError where that exceeds what a CTA may have."""
    solo, multi = source_pass_words(text)
    words = (solo if cluster == 1 else multi) + plan.cap + cuda_topk.RANGE_PAD * plan.threads
    if 4 * words > smem_optin:
        raise ValueError(f"the source needs {4 * words} bytes of shared memory for C={cluster} with "
                         f"{plan.cap} keys a CTA; a CTA may have {smem_optin}")
    return dataclasses.replace(plan, smem=4 * words)


def parse_cases(text: str, sm_count: int, smem_optin: int) -> list[tuple]:
    """``C:BxL[/W][@T]`` cases, comma-separated, as ``(C, B, L, W, plan)``: C CTAs per row, B
    rows of L live keys under the host width W (default L), T threads per CTA (default: the
    planner's for that width); a case the syntax or the planner refuses raises ValueError."""
    cases = []
    for case in text.split(","):
        m = CASE.fullmatch(case.strip())
        if m is None:
            raise ValueError(f"case {case!r}: want C:BxL[/W][@T], e.g. 8:1x4096/131072@1024")
        C, B, L = int(m[1]), int(m[2]), int(m[3])
        W = int(m[4]) if m[4] else L
        threads = int(m[5]) if m[5] else None
        plan = cuda_topk.plan_cluster(B, W, sm_count, smem_optin, cluster=C, threads=threads)
        if plan is None:
            raise ValueError(f"case {case!r}: the cluster route cannot plan it")
        cases.append((C, B, L, W, plan))
    return cases


SLOTS_DEFINE = "TOPK_SLOTS_MODULE=1"  # the slots module's entries (cuda_topk.SLOTS_OPTIONS)


def slots_page_table(rows: int, width: int, page_bits: int, seed: int, device) -> torch.Tensor:
    """int32 ``[rows, pages]``: distinct random physical pages per row, enough pages for ``width``
    positions."""
    pages = -(-width >> page_bits)
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(2 * pages + 1, generator=g)[:pages] for _ in range(rows)]).to(
        device=device, dtype=torch.int32)


def cut_calls(mod, fn, plan, cluster: int, xs: list, lens, out, ncalls: int,
              page_table: torch.Tensor | None = None, page_bits: int = 0) -> list:
    """``ncalls`` launches of one cut kernel over rotating inputs, as a list of calls (a slots
    entry's with ``page_table``)."""
    rows, width = xs[0].shape
    tail = cuda_topk.cluster_tail(plan.cap, False, page_table, page_bits)

    def call(x):
        return lambda: cuda_topk._launch(mod, fn, (cluster, rows, 1), plan.threads, plan.smem, x, width, lens,
                                         None, out, K, width, True, tail)

    return [call(xs[i % len(xs)]) for i in range(ncalls)]


def time_cut(mod, fn, plan, cluster: int, xs: list, lens, out, ncalls: int) -> float:
    """us per launch of one cut kernel over rotating inputs (CUDA-graph replays)."""
    return graph_replay_us(cut_calls(mod, fn, plan, cluster, xs, lens, out, ncalls), 20)


def same_sets(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two top-k outputs select the same positions in every row (any order)."""
    return torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


def indexer_logits(B: int, L: int, W: int, seed: int) -> torch.Tensor:
    """``[B, W]`` scores of our paged scorer over benchmarks/indexer.py's random inputs of ``seed``
    (its copy 0)."""
    from indexer import Inputs  # benchmarks/indexer.py

    from vllm_sparse_sync.kernels import ops as tk

    return tk.paged_indexer_logits(*Inputs(B, L, 1, seed=seed).args(0), W)


def _compile(arch: str, text: str) -> bytes:
    return cuda_topk.compile_source(arch, text=text)[0]


def _compile_reported(arch: str, text: str) -> tuple[bytes, str]:
    """The cubin and ptxas's ``-v`` report (``kernel_resources`` reads it)."""
    return cuda_topk.compile_source(arch, text=text, extra_options=("--ptxas-options=-v",))


def kernel_resources(log: str, name: str) -> tuple[int, int] | None:
    """(registers a thread, spill-store bytes) of entry ``name`` in a ``ptxas -v`` log (None: not
    in it). A source change can move a kernel's registers and slow a path it does not touch
    (docs/performance.md): the whole kernel's numbers go beside its time."""
    m = re.search(rf"entry function '{re.escape(name)}'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                  log, re.S)
    return (int(m.group(2)), int(m.group(1))) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1:1x4096,8:1x65536,8:1x131072,8:8x65536,2:64x65536,1:128x8192")
    ap.add_argument("--ncalls", type=int, default=16)
    ap.add_argument("--mean", type=float, default=0.0, help="the logits' mean (normal)")
    ap.add_argument("--std", type=float, default=1.0,
                    help="the logits' standard deviation (the indexer benchmark's: about mean 8.5, std 19)")
    ap.add_argument("--logits", choices=("normal", "indexer"), default="normal",
                    help="normal: --mean/--std; indexer: our scorer's logits of random inputs "
                         "(the indexer benchmark's; the width past L is -inf)")
    ap.add_argument("--seeds", default="0,1,2,3", help="the input copies rotated (indexer: their seeds)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a macro for the source (repeatable), e.g. SHORT_ACT=256")
    ap.add_argument("--stops", default=",".join(str(s) for s in DEFAULT_STOPS),
                    help=f"the cuts to time, of {STOPS} (99: the whole kernel; 11-32: inside the "
                         "register body)")
    ap.add_argument("--source", action="append", default=None, metavar="PATH",
                    help="time this copy of topk.cu instead of the library's (e.g. an earlier "
                         "commit's); "
                         "repeatable: the copies side by side (--source '' names the library's)")
    ap.add_argument("--slots", type=int, default=0, metavar="PAGE",
                    help="time the slots entries, writing KV-cache slots through a random page table "
                         "of pages of PAGE slots (a power of two, e.g. 64)")
    ap.add_argument("--per-seed", action="store_true", help="time each input copy (seed) on its own")
    ap.add_argument("--rounds", type=int, default=20,
                    help="replays of each cut's graph, every source and cut of a case in turn each "
                         "round (rotated), so no source is timed first; the median is reported")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: $OUT/cuda_topk_phases.json if $OUT is set)")
    a = ap.parse_args()
    stops = tuple(int(s) for s in a.stops.split(","))
    seeds = [int(s) for s in a.seeds.split(",")]
    if not set(stops) <= set(STOPS) or not stops:
        ap.error(f"--stops: a comma list of {STOPS}")
    bad = [d for d in a.define if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\w+", d)]
    if bad:
        ap.error(f"--define wants NAME=VALUE, got {bad}")
    if a.rounds < 1:
        ap.error(f"--rounds: must be >= 1, got {a.rounds}")
    page_bits = 0
    if a.slots:
        try:
            page_bits = ref.page_size_bits(a.slots)
        except ValueError as e:
            ap.error(f"--slots: {e}")
    defines = tuple(a.define) + ((SLOTS_DEFINE,) if a.slots else ())
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    sources = [src or None for src in a.source] if a.source else [None]  # None: the library's
    bases = {}
    for src in sources:
        if src is not None:
            with open(src) as fh:
                bases[src] = fh.read()
    mod = cuda_topk.module_for(0)
    driver = mod.driver
    fake = types.SimpleNamespace(driver=driver, ctx=mod.ctx)
    major, minor = torch.cuda.get_device_capability()
    cases = parse_cases(a.cases, mod.sm_count, mod.smem_optin)
    for C, B, L, _, plan in cases:  # every copy's layout fits before anything compiles
        for src in sources:
            try:
                source_plan(plan, C, bases.get(src) or cuda_topk.source(), mod.smem_optin)
            except ValueError as e:
                ap.error(f"--source {src or 'library'}, case {C}:{B}x{L}: {e}")
    keep = {(c[0], c[4].threads) for c in cases}
    jobs = [(src, stop) for src in sources for stop in stops]
    texts = [cut_source(stop, defines, bases.get(src), keep) for src, stop in jobs]
    arch = f"sm_{major}{minor}"
    print(f"compiling {len(jobs)} cuts in parallel ...", flush=True)
    spawn = multiprocessing.get_context("spawn")  # NVRTC only: no CUDA context in the workers
    workers = min(len(jobs), os.cpu_count() or 1)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        built = list(pool.map(_compile_reported, [arch] * len(texts), texts))
    modules = {job: cuda_topk._check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
               for job, (cubin, _) in zip(jobs, built)}
    logs = {job: log for job, (_, log) in zip(jobs, built)}
    rows_out = []
    for C, B, L, W, plan in cases:
        name = cuda_topk.cluster_kernel_name(C, True, plan.threads, slots=bool(a.slots))
        table = slots_page_table(B, W, page_bits, B + L, "cuda") if a.slots else None
        g = torch.Generator(device="cuda").manual_seed(B + L)
        if a.logits == "indexer":
            xs = [indexer_logits(B, L, W, seed) for seed in seeds]
        else:
            xs = [torch.randn(B, W, device="cuda", generator=g) * a.std + a.mean for _ in seeds]
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        out = torch.empty(B, K, dtype=torch.int32, device="cuda")
        groups = [[i] for i in range(len(seeds))] if a.per_seed else [list(range(len(seeds)))]
        for group in groups:
            inputs = [xs[i] for i in group]
            named, fns, plans = {}, {}, {}
            for src in sources:  # the sources side by side on the same inputs, timed in turn
                plans[src] = source_plan(plan, C, bases.get(src) or cuda_topk.source(), mod.smem_optin)
                for stop in stops:
                    fn = cuda_topk.load_cluster_function(driver, modules[(src, stop)], name, plans[src].smem)
                    fns[(src, stop)] = fn
                    named[(src, stop)] = cut_calls(fake, fn, plans[src], C, inputs, lens, out, a.ncalls,
                                                   table, page_bits)
            times = interleaved_replay_us(named, a.rounds)
            first = None
            for src in sources:
                res = {"C": C, "B": B, "L": L, "W": W, "cap": plan.cap, "threads": plan.threads,
                       "logits": a.logits, "seeds": [seeds[i] for i in group], "mean": a.mean, "std": a.std,
                       "defines": a.define, "slots": a.slots, "source": src, "rounds": a.rounds}
                for stop in stops:
                    res[NAMES[stop]] = times[(src, stop)]
                used = kernel_resources(logs[(src, 99)], name) if 99 in stops else None
                if used is not None:
                    res["registers"], res["spill_bytes"] = used
                if 99 in stops:  # the whole kernel's selection, against the first source's
                    once = cut_calls(fake, fns[(src, 99)], plans[src], C, inputs[:1], lens, out, 1,
                                     table, page_bits)
                    once[0]()
                    got = out.clone()
                    first = got if first is None else first
                    res["output"] = "same" if same_sets(got, first) else "differs"
                rows_out.append(res)
                prev = 0.0
                parts = []
                for stop in stops:
                    t = res[NAMES[stop]]
                    parts.append(f"{NAMES[stop]} {t - prev:+.2f}")
                    prev = t
                print(f"C={C} B={B} L={L} W={W} cap={plan.cap} threads={plan.threads} seeds={res['seeds']} "
                      f"{' '.join(a.define)}{f' slots of {a.slots}' if a.slots else ''} {src or 'library'} "
                      f"total {res[NAMES[stops[-1]]]:.2f} us: " + ", ".join(parts)
                      + (f" (output {res['output']})" if "output" in res else "")
                      + (f" [{used[0]} registers, {used[1]} bytes spilled]" if used is not None else ""),
                      flush=True)
    write_rows(rows_out, a.out, "cuda_topk_phases.json")


def write_rows(rows: list, path: str | None, default_name: str) -> None:
    """The rows as JSON at ``path``, or at ``$OUT/default_name`` when $OUT is set (else nowhere)."""
    path = path or (os.path.join(os.environ["OUT"], default_name) if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
