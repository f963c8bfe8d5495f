"""Where the step's time goes between its scorer and its top-k, launch by launch, for variants of
the top-k source and the CUDA scorer's build side by side in one process.

    python tools/step_timeline.py [--shapes 1x65536,8x65536] [--source old.cu --source '']
        [--variant evict=:KEYS_EVICT_FIRST=1] [--config precise=false] [--phases]
        [--replays 20] [--rounds 5] [--json F]

A variant is a copy of topk.cu (``--source PATH``, ``''`` the library's) or ``--variant
NAME=[TOPK_PATH][:MACRO=V,...]``: a copy of the top-k source and macros defined before the CUDA
scorer's source. Each top-k copy is compiled twice: plain, and with stamps (an experiment copy;
the library source is unchanged). The stamped kernel's thread 0 of every CTA notes the global
timer at its entry, after its dependency wait (``griddepcontrol.wait``: the scorer done) and at
its end (after a barrier: the CTA's), and its SM clock from the wait to the end. Per launch: the
first entry, the first and last release, the last end, the slowest CTA's cycles, and each CTA's
cycles over nanoseconds (the SM clock). The step (``indexer.py``'s exact step, a serving runner's
workspace; ``--config`` changes its config, e.g. the e4m3 dot) and its top-k alone (call i on
input copy i's logits, as the step's scorer wrote them) are captured as CUDA graphs of ``ncalls``
calls, each variant's modules swapped in for its captures; every step graph's last call must
select what the first variant's does (a difference is printed, and the tool exits 1 once its JSON
is written).
Reported, us (means over launches, except the first of each replay):

- ``plain``: the plain graphs' time a call, every variant and part interleaved (``--rounds``);
- ``gap``: the previous top-k's end to this one's first release (in the step: the scorer, its
  launch and its memory flush; alone: the launch gap);
- ``span``: the first release to the last end (the top-k's time as the step sees it);
- ``spread``: the first release to the last; ``early``: the first entry to the first release
  (how long the top-k's first CTA sat resident waiting);
- ``slowest``: the slowest CTA's cycles from its release to its end, at the measured clock;
- ``MHz``: the SM clock over the top-k's CTAs.

``--phases`` adds ``cuda_topk_trace.py``'s stamps: the first CTA's (row 0, rank 0) cycles per
phase (a phase ending at a cluster barrier waits for the cluster's slowest CTA).
A stamped launch costs a barrier and a few reductions at each CTA's end, so ``span`` reads a
little above the plain kernel; compare variants within one stamped column.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers

from cold_start import shapes_arg  # noqa: E402
from cuda_scorer_variants import parse_macros  # noqa: E402

from vllm_sparse_sync.kernels.cuda import topk as cuda_topk  # noqa: E402

SLOTS = 4096  # launches recorded between two resets
FIELDS = ("entry_min", "release_min", "release_max", "end_max", "slowest_cycles", "cycles", "ns", "ctas")
MIN_FIELDS = ("entry_min", "release_min")
U64_MAX = 2**64 - 1
PRELUDE = f"""
struct VssLaunch {{ unsigned long long {", ".join(FIELDS)}; }};
__device__ VssLaunch vss_launches[{SLOTS}];
__device__ unsigned long long vss_tickets;  // CTAs released so far: CTA t belongs to launch t / grid
__device__ __forceinline__ unsigned long long vss_gt() {{
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g) :: "memory");
    return g;
}}
__device__ __forceinline__ unsigned long long vss_clk() {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
    return t;
}}
__device__ __forceinline__ unsigned long long* vss_cta() {{  // entry, release, clock, ticket
    __shared__ unsigned long long t[4];
    return t;
}}
__device__ __forceinline__ void vss_entry() {{
    if (threadIdx.x == 0) vss_cta()[0] = vss_gt();
}}
__device__ __forceinline__ void vss_released() {{
    if (threadIdx.x == 0) {{
        unsigned long long* t = vss_cta();
        t[1] = vss_gt();
        t[2] = vss_clk();
        t[3] = atomicAdd(&vss_tickets, 1ull);  // read at the end: its latency is hidden
    }}
}}
__device__ __forceinline__ void vss_end() {{
    __syncthreads();
    if (threadIdx.x == 0) {{
        const unsigned long long clk = vss_clk(), gt = vss_gt();
        const unsigned long long* t = vss_cta();
        const unsigned long long grid = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
        VssLaunch& s = vss_launches[(t[3] / grid) % {SLOTS}];
        atomicMin(&s.entry_min, t[0]);
        atomicMin(&s.release_min, t[1]);
        atomicMax(&s.release_max, t[1]);
        atomicMax(&s.end_max, gt);
        atomicMax(&s.slowest_cycles, clk - t[2]);
        atomicAdd(&s.cycles, clk - t[2]);
        atomicAdd(&s.ns, gt - t[1]);
        atomicAdd(&s.ctas, 1ull);
    }}
}}
"""
# (anchor, replacement): the stamps' places in topk.cu
EDITS = (
    ('    asm volatile("griddepcontrol.wait;" ::: "memory");\n',
     '    asm volatile("griddepcontrol.wait;" ::: "memory");\n    vss_released();\n'),
    (re.compile(r"(topk_cluster_row<C, T, \(A\) != 0(?:, SLOTS)?>\()"), r"vss_entry(); \1"),
    # (a source from before the lens_early or the page-table parameters too)
    (re.compile(r"(sel_width, k, out, stride_o, nan_low, cap(?:, lens_early)?"
                r"(?:,[\s\\]*lens_early, page_table, page_stride, page_bits,[\s\\]*pages"
                r"|,[\s\\]*page_table, page_stride, page_bits, pages)?\);)"), r"\1 vss_end();"),
    ("#define FULL_MASK", PRELUDE + "#define FULL_MASK"),
)


def stamped_source(text: str) -> str:
    """``text`` (a topk.cu) with the timeline's stamps in every cluster kernel; a source
    without one of the anchors is refused by name."""
    for anchor, replacement in EDITS:
        pattern = anchor if isinstance(anchor, re.Pattern) else re.compile(re.escape(anchor))
        found = len(pattern.findall(text))
        if found != 1:
            raise ValueError(f"anchor not once in the source ({found} times): {pattern.pattern.strip()!r}")
        if isinstance(anchor, re.Pattern):
            text = pattern.sub(replacement, text)
        else:
            text = text.replace(anchor, replacement)
    return text


def empty_records():
    """The host image of ``vss_launches`` after a reset: minima at their top, the rest zero."""
    import numpy

    rec = numpy.zeros((SLOTS, len(FIELDS)), dtype=numpy.uint64)
    for f in MIN_FIELDS:
        rec[:, FIELDS.index(f)] = U64_MAX
    return rec


def launch_stats(records, launches: int, per_replay: int) -> dict:
    """Means in us (and the clock in MHz) over the first ``launches`` records, laid out as replays
    of ``per_replay`` launches; a gap needs the launch before it in the same replay. Raises if a
    launch is missing (no CTA recorded) or recorded more CTAs than another."""
    if launches > SLOTS:
        raise ValueError(f"{launches} launches: at most {SLOTS} between resets")
    col = {f: [int(r[i]) for r in records[:launches]] for i, f in enumerate(FIELDS)}
    ctas = set(col["ctas"])
    if 0 in ctas or len(ctas) != 1:
        raise ValueError(f"launches recorded unequal CTA counts: {sorted(ctas)}")
    cycles, ns = sum(col["cycles"]), sum(col["ns"])
    mhz = cycles / ns * 1e3 if ns else float("nan")
    gaps = [(col["release_min"][i] - col["end_max"][i - 1]) / 1e3 for i in range(launches) if i % per_replay]
    kept = [i for i in range(launches) if i % per_replay]
    mean = statistics.fmean
    return {
        "launches": launches,
        "ctas": ctas.pop(),
        "gap_us": mean(gaps) if gaps else float("nan"),
        "span_us": mean((col["end_max"][i] - col["release_min"][i]) / 1e3 for i in kept),
        "spread_us": mean((col["release_max"][i] - col["release_min"][i]) / 1e3 for i in kept),
        "early_us": mean((col["release_min"][i] - col["entry_min"][i]) / 1e3 for i in kept),
        "slowest_us": mean(col["slowest_cycles"][i] for i in kept) / mhz,
        "mhz": mhz,
    }


def _compile(arch: str, text: str) -> bytes:
    return cuda_topk.module_cubin(arch, text=text)[0]


def parse_variant(text: str) -> tuple[str, str, tuple[tuple[str, int], ...]]:
    """``NAME=[TOPK_PATH][:MACRO=V,...]`` -> ``(name, top-k path or '', scorer macros)``: a copy of
    topk.cu ('' the library's) and macros defined before the CUDA scorer's source."""
    name, sep, rest = text.partition("=")
    if not sep or not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"--variant: want NAME=[TOPK_PATH][:MACRO=V,...], got {text!r}")
    path, _, macros = rest.partition(":")
    return name, path, tuple(parse_macros(text, macros).items())


def topk_on_copies(route, logits: list, lens, ws, out, width: int):
    """``call(i)``: the step's top-k launch (``route``'s) on ``logits[i % len(logits)]``."""
    from vllm_sparse_sync.kernels.launch import launch_topk

    return lambda i: launch_topk(route, logits[i % len(logits)], lens, None, ws, out, out.shape[1], width,
                                 nan_low=False)


def module_from_text(index: int, text: str):
    """A ``cuda_topk._Module`` of device ``index`` built from ``text`` (a copy of the source)."""
    saved = cuda_topk.source
    cuda_topk.source = lambda: text
    try:
        return cuda_topk._Module(index)
    finally:
        cuda_topk.source = saved


def records_io(mod, write=None):
    """``vss_launches`` of a stamped module: written from ``write`` (and the tickets zeroed), or read."""
    import numpy
    import torch

    drv = mod.driver
    torch.cuda.synchronize()
    dptr, size = cuda_topk._check(drv.cuModuleGetGlobal(mod.module, b"vss_launches"), "cuModuleGetGlobal")
    if write is not None:
        cuda_topk._check(drv.cuMemcpyHtoD(dptr, write, size), "cuMemcpyHtoD")
        tptr, tsize = cuda_topk._check(drv.cuModuleGetGlobal(mod.module, b"vss_tickets"), "cuModuleGetGlobal")
        cuda_topk._check(drv.cuMemcpyHtoD(tptr, numpy.zeros(1, dtype=numpy.uint64), tsize), "cuMemcpyHtoD")
        return None
    host = empty_records()
    cuda_topk._check(drv.cuMemcpyDtoH(host, dptr, size), "cuMemcpyDtoH")
    return host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x65536,1x131072,8x65536,32x65536")
    ap.add_argument("--source", action="append", default=[], metavar="PATH",
                    help="a copy of topk.cu (repeatable; '' names the library's): --variant NAME=PATH")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=[TOPK_PATH][:MACRO=V,...]",
                    help="a copy of topk.cu ('' the library's) and macros for the CUDA scorer's build")
    ap.add_argument("--replays", type=int, default=20, help="stamped replays of each graph")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the plain graphs")
    ap.add_argument("--phases", action="store_true",
                    help="also cuda_topk_trace.py's phase stamps (the first CTA's cycles per phase)")
    ap.add_argument("--config", default="",
                    help="the step's config (as indexer.py --config), e.g. precise=false")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = shapes_arg(ap, a.shapes)
    config = step_config(ap, a.config)
    if a.replays < 1 or a.rounds < 1:
        ap.error("--replays and --rounds: at least 1")
    try:
        variants = [(os.path.basename(s) if s else "library", s, ()) for s in a.source]
        variants += [parse_variant(v) for v in a.variant]
    except ValueError as exc:
        ap.error(str(exc))
    variants = variants or [("library", "", ())]
    names = [v[0] for v in variants]
    if len(set(names)) != len(names):
        ap.error(f"two variants share a name: {names}")
    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    import cuda_topk_trace as tr
    import indexer as ix
    from graph_timer import capture, replay_us, rotation

    from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer

    texts = {}  # path -> text
    for _, path, _ in variants:
        if path not in texts:
            if path:
                with open(path) as fh:
                    texts[path] = fh.read()
            else:
                texts[path] = cuda_topk.source()

    def stamped(text: str) -> str:
        return stamped_source(tr.traced_source(text, None) if a.phases else text)

    jobs = [(path, kind) for path in texts for kind in ("plain", "stamped")]
    bodies = [texts[p] if k == "plain" else stamped(texts[p]) for p, k in jobs]
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    print(f"compiling {len(jobs)} top-k modules in parallel ...", flush=True)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=spawn) as pool:
        list(pool.map(_compile, [f"sm_{major}{minor}"] * len(bodies), bodies))  # into the on-disk cache
    topk_modules = {job: module_from_text(index, body) for job, body in zip(jobs, bodies)}
    library_scorer = cuda_scorer.module_for
    scorer_macros: tuple = ()

    def scorer_module(index, defines=()):  # the variant's scorer build: its macros after the launch's
        return library_scorer(index, tuple(defines) + scorer_macros)

    cuda_scorer.module_for = scorer_module
    rows = []
    for B, L in shapes:
        copies, ncalls = ix.graph_sizes(B, L)
        if a.replays * ncalls > SLOTS:
            ap.error(f"--replays: {a.replays} x {ncalls} calls exceeds {SLOTS} recorded launches")
        inp = ix.Inputs(B, L, copies)
        ws, _ = ix.step_workspaces(B, L, config)
        out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
        parts = ix.step_calls(inp, ws, out)
        route = ws.plan_call(B, L, ix.PAGE)
        copy_logits = []  # each input copy's scores, as the step's scorer leaves them
        for j in range(copies):
            parts["scorer"](j)
            copy_logits.append(ws.logits[:B, :L].clone())
        parts["topk"] = topk_on_copies(route, copy_logits, inp.lens, ws, out, L)
        graphs = {}  # (variant, kind, part) -> graph, each captured with its variant's modules
        for name, path, macros in variants:
            scorer_macros = macros
            for kind in ("plain", "stamped"):
                cuda_topk._MODULES[(index, "positions")] = topk_modules[(path, kind)]
                for part in ("step", "topk"):
                    call = parts[part]
                    calls = [(lambda i=i, call=call: call(i)) for i in range(ncalls)]
                    graphs[(name, kind, part)] = capture(calls)
        selected = {}
        for name, kind, part in graphs:  # each step graph's last call selects from the same input copy
            if part == "step":
                graphs[(name, kind, part)].replay()
                selected[(name, kind)] = out.clone()
        first = selected[(names[0], "plain")]
        differs = [f"{n} {k}" for (n, k), got in selected.items() if not torch.equal(got, first)]
        if differs:
            print(f"{B}x{L}: selection differs from {names[0]}'s: {', '.join(differs)}", flush=True)
        plain = {(name, part): [] for name in names for part in ("step", "topk")}
        for it in range(a.rounds):  # the plain graphs interleaved, in rotated order
            for key in rotation(list(plain), it):
                plain[key].append(replay_us(graphs[(key[0], "plain", key[1])], ncalls))
        for name, path, _ in variants:
            mod = topk_modules[(path, "stamped")]
            for part in ("step", "topk"):
                records_io(mod, write=empty_records())
                if a.phases:
                    tr.read_trace(mod.driver, mod.module, zero=True)
                times = [replay_us(graphs[(name, "stamped", part)], ncalls) for _ in range(a.replays)]
                stats = launch_stats(records_io(mod), a.replays * ncalls, ncalls)
                if a.phases:
                    stats["phase_cycles"] = tr.phase_cycles(tr.read_trace(mod.driver, mod.module))
                row = dict(B=B, L=L, variant=name, part=part, cluster=route.topk_cluster, config=a.config,
                           same_selection=f"{name} stamped" not in differs and f"{name} plain" not in differs,
                           plain_us=statistics.median(plain[(name, part)]),
                           stamped_us=statistics.median(times), **stats)
                rows.append(row)
                print(f"{B}x{L} {name:>12} {part:>4}: plain {row['plain_us']:7.2f}"
                      f" stamped {row['stamped_us']:7.2f} | gap {row['gap_us']:6.2f}"
                      f" span {row['span_us']:6.2f}"
                      f" spread {row['spread_us']:5.2f} early {row['early_us']:6.2f}"
                      f" slowest {row['slowest_us']:6.2f} us, {row['mhz']:5.0f} MHz, {row['ctas']} CTAs",
                      flush=True)
                if a.phases:
                    print("    " + ", ".join(f"{label} {cyc / row['mhz']:.2f}"
                                             for label, cyc in row["phase_cycles"].items()), flush=True)
        del graphs
    cuda_topk._MODULES.pop((index, False), None)
    cuda_scorer.module_for = library_scorer
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    failures = selection_failures(rows)
    if failures:
        print(f"error: selections differ from {names[0]}'s: {', '.join(failures)}", file=sys.stderr)
        sys.exit(1)


def step_config(ap: argparse.ArgumentParser, text: str):
    """``--config``'s assignments as the step's ``KernelConfig`` (``indexer.parse_config``); bad text
    ends the script as argparse does (exit 2), before any GPU work."""
    import indexer as ix

    try:
        config = ix.parse_config(text)
    except (ValueError, TypeError, KeyError) as exc:
        ap.error(f"--config: {exc}")
    return config


def selection_failures(rows: list[dict]) -> list[str]:
    """``"BxL variant"`` of every shape and variant whose step selected otherwise than the first
    variant's, in the rows' order, once each."""
    seen = []
    for r in rows:
        name = f"{r['B']}x{r['L']} {r['variant']}"
        if not r["same_selection"] and name not in seen:
            seen.append(name)
    return seen


if __name__ == "__main__":
    main()
