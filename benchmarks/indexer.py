"""Decode indexer benchmark on one GPU: our scorer, top-k and whole step beside the peers.

    python benchmarks/indexer.py [--out benchmarks/results/NAME.json] [--shapes 1x4096,64x65536]
                                 [--peers-only] [--no-peers] [--config topk=radix,...]
                                 [--topk-algos radix,sample] [--baseline results/OLD.json]
    python benchmarks/indexer.py --combine A.json B.json --out C.json   # merge runs, print table
    python benchmarks/indexer.py --spread A.json B.json C.json [--out S.json]  # ratios across runs
    python benchmarks/indexer.py --rounds 3 ...   # ours and each peer timed 3 times a shape, rotated

Our step runs on a workspace sized for a serving runner (``SERVING_ROWS`` rows, 128K wide), so
the route each call takes is the planner's choice for the call's own rows. ``--baseline`` prints
each shape's step time over a committed run's. Times are medians of CUDA-graph replays (per-call
= replay time / calls per graph) with inputs rotated over enough copies that one graph's inputs
exceed L2; every top-k alone (ours and each peer's) reads the same rotated buffers of those
copies' scores. Shapes are docs/design.md's (H=64, D=128, k=2048). Peers are measured when the
checkout holds ``.peers/`` (DeepGEMM paged MQA logits) or ``.peers_topk/`` (vLLM top-k ops),
made by ``benchmarks/peers.sh``, or ``.peers_fi/`` (FlashInfer's native top-k headers, made by
``benchmarks/peers_flashinfer.sh``, compiled here with nvcc) or ``.peers_sgl/`` (SGLang's
top-k cubin, ``benchmarks/peers_sglang.sh``); all four fit one device transfer together (about
26 MB, vLLM's library trimmed to its sm_90 code), so every peer is timed in the same run
(``--combine`` still merges separate runs). The best of the peer top-k times measured (with a
passing set check) is what ``topk_over_best_peer`` divides by. ``best_peer_step_us`` adds
DeepGEMM's time alone to it; ``peer_stack_us`` times DeepGEMM then each peer top-k in one graph
(the top-k reading the logits DeepGEMM just wrote, as ours does) and takes the fastest whose
selection checks. ``--spread`` takes runs of one build and prints each shape's same-run ratios
across them (median, lowest, highest, and how many runs met their target), each derived again
from the run's times. ``--rounds N`` times ours and every peer N times a shape, round k
starting with the k-th of them (a sustained shape slows the device as it runs, so whoever is
timed first gains); each time is the median over the rounds, every round kept under ``rounds``.
With ours and a peer stack, one more slot (``interleaved``) captures our exact and fp8 steps and
every peer stack as graphs of their own and replays them in turn (``il_*``): the H200 holds its
700 W cap by lowering the SM clock, so whatever a slot times after a stretch of heavy work reads
slower, and only interleaved do both sides of ``il_ours_over_peer_stack`` and
``il_ours_fp8_over_peer_stack`` meet the same clock.
After the table of times, a table of the speed targets (``TARGETS``: each shape's ratio, the
misses marked, how many shapes met each). The run exits 1 after its tables and JSON where our
step or a top-k algorithm failed its check or a round raised (``our_failures``).
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import sys
import tarfile
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from graph_timer import graph_replay_us, interleaved_replay_us  # noqa: E402

from vllm_sparse_sync.kernels import reference as ref  # noqa: E402
from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG, KernelConfig  # noqa: E402
from vllm_sparse_sync.kernels.config import parse_config as parse_kernel_config  # noqa: E402
from vllm_sparse_sync.kernels.planner import FUSED_MAX_ROWS, Route, score_splits  # noqa: E402
from vllm_sparse_sync.kernels.synth import random_k_cache  # noqa: E402
from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace  # noqa: E402

SHAPES = [(1, 4096), (1, 65536), (1, 131072), (8, 65536), (32, 16384), (32, 65536),
          (64, 16384), (64, 65536), (128, 8192)]
H, D, PAGE, TOPK, WIDE = 64, 128, 64, 2048, 131072
L2_BYTES = 160 * 2**20  # what one graph's rotated inputs should exceed (H200 L2 is ~50-60 MB)
DEV = "cuda"
SERVING_ROWS = 256  # the step's workspace capacity: a serving runner's, whatever the call's rows


def graph_sizes(B: int, L: int) -> tuple[int, int]:
    """``(copies, ncalls)``: input copies whose K caches together exceed ``L2_BYTES``, and the calls
    of one timed graph (each on copy ``i % copies``)."""
    copies = max(2, min(128, math.ceil(L2_BYTES / (B * L * 132))))
    return copies, max(12, copies)


def step_calls(inp: Inputs, ws: IndexerTopkWorkspace, out: torch.Tensor) -> dict:
    """Our exact step on ``ws`` and its two launches as the step makes them (its route's splits,
    ``ws``'s logits buffer), each as ``call(i)`` on input copy ``i``: ``step``, ``scorer``,
    ``topk`` (the latter reads what the scorer last left in the buffer)."""
    from vllm_sparse_sync.kernels import ops as tk
    from vllm_sparse_sync.kernels.launch import launch_scorer, launch_topk

    L = inp.L
    route = ws.plan_call(inp.B, L, PAGE)
    cfg = ws.config
    return {
        "step": lambda i: tk.indexer_topk(*inp.args(i), TOPK, width=L, workspace=ws, out=out),
        "scorer": lambda i: launch_scorer(route, *inp.args(i), None, ws.logits, page=PAGE, width=L,
                                          precise=cfg.precise, pdl=cfg.pdl),
        "topk": lambda i: launch_topk(route, ws.logits, inp.lens, None, ws, out, TOPK, L, nan_low=False),
    }


def unfused_splits(B: int, L: int, scorer: str = "triton") -> int:
    """Programs per row of the ``scorer`` kernel on the unfused route for B rows."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return score_splits(B, sms, scorer)


def without(config: KernelConfig, **changes) -> IndexerTopkWorkspace:
    """A serving-size workspace planning as if its device lacked something (``cuda_scorer=False``:
    the Triton scorer beside the CUDA top-k; ``cluster_smem=0``: no cluster route)."""
    import dataclasses

    from vllm_sparse_sync.kernels.device import device_info

    info = dataclasses.replace(device_info(DEV, config), **changes)
    return IndexerTopkWorkspace(SERVING_ROWS, TOPK, WIDE, DEV, config=config, device_info=info)


def timeit(make_call, ncalls: int, iters: int = 15) -> float:
    """Median microseconds per call: a graph of ``ncalls`` calls (call i uses input copy i), replayed."""
    return graph_replay_us([make_call(i) for i in range(ncalls)], iters)


def copy_tbs() -> float:
    """Measured device-to-device copy bandwidth (read + write), TB/s."""
    n = 2 * 1024**3
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    sec = s.elapsed_time(e) / 1000.0 / 10
    del a, b
    return 2 * n / sec / 1e12


class Inputs:
    """``copies`` independent K caches and page tables for B rows of L entries (table width WIDE)."""

    def __init__(self, B: int, L: int, copies: int, seed: int = 0):
        torch.manual_seed(seed)
        self.B, self.L = B, L
        live = L // PAGE
        self.table_pages = max(live, WIDE // PAGE)
        self.q = (torch.randn(B, H, D, device=DEV) * 0.7).to(ref.FP8_DTYPE)
        self.w = torch.randn(B, H, device=DEV)
        self.lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
        self.caches, self.tables, self.wide_tables = [], [], []
        for _ in range(copies):
            n_pages = B * live
            self.caches.append(random_k_cache(n_pages, PAGE, D, device=DEV))
            t = torch.randperm(n_pages, device=DEV, dtype=torch.int32).view(B, live)
            wide = torch.full((B, self.table_pages), -1, dtype=torch.int32, device=DEV)
            wide[:, :live] = t
            self.tables.append(t)
            self.wide_tables.append(wide)

    def args(self, i: int, wide: bool = False):
        """Inputs of copy ``i``: exact page table ``[B, L/64]`` or a 128K-wide one (``-1`` past L)."""
        t = (self.wide_tables if wide else self.tables)[i % len(self.tables)]
        return self.q, self.w, self.caches[i % len(self.caches)], t, self.lens


def step_workspaces(B: int, L: int, config) -> tuple[IndexerTopkWorkspace, IndexerTopkWorkspace]:
    """The exact step's workspace (a serving runner's, 128K wide) and the fp8 step's (the call's
    own size, ``precise`` off)."""
    ws = IndexerTopkWorkspace(max(B, SERVING_ROWS), TOPK, WIDE, DEV, config=config)
    ws8 = IndexerTopkWorkspace(B, TOPK, L, DEV, config=config.with_values(precise=False))
    return ws, ws8


def bench_ours(inp: Inputs, ncalls: int, config, res: dict, algos: tuple[str, ...] = ()) -> None:
    from vllm_sparse_sync.kernels import ops as tk
    from vllm_sparse_sync.kernels.device import cuda_topk_status
    from vllm_sparse_sync.kernels.launch import launch_scorer
    from vllm_sparse_sync.kernels.planner import TRITON

    B, L = inp.B, inp.L
    ws, ws8 = step_workspaces(B, L, config)
    out = torch.empty(B, TOPK, dtype=torch.int32, device=DEV)
    active = torch.tensor([L], dtype=torch.int32, device=DEV)
    kind = ws.plan_call(B, L, PAGE).scorer
    res["scorer_kind"] = kind

    def scorer(i, cfg=config, logits=ws.logits, kind=kind):  # the step's scorer alone
        route = Route("scorer", B, score_splits=unfused_splits(B, L, kind), scorer=kind)
        return lambda: launch_scorer(route, *inp.args(i), None, logits, page=PAGE, width=L,
                                     precise=cfg.precise, pdl=cfg.pdl)

    def step(i, width, act=None):
        return lambda: tk.indexer_topk(*inp.args(i, width == WIDE), TOPK, active_width=act, width=width,
                                       workspace=ws, out=out)

    res["scorer_us"] = timeit(scorer, ncalls)
    # the same step with the fp8 tensor-core dot (DeepGEMM's numerics) instead of the exact fp16 one
    cfg8 = ws8.config
    kind8 = ws8.plan_call(B, L, PAGE).scorer
    res["scorer_fp8_us"] = timeit(lambda i: scorer(i, cfg8, ws8.logits, kind8), ncalls)
    if kind != TRITON:  # the Triton scorer beside it and the step it makes; the CUDA e4m3 kernel
        res["scorer_triton_us"] = timeit(lambda i: scorer(i, kind=TRITON), ncalls)
        res["scorer_cuda_fp8_us"] = timeit(lambda i: scorer(i, cfg8, ws8.logits, kind), ncalls)
        ws_t = without(config, cuda_scorer=False)
        res["step_triton_us"] = timeit(lambda i: lambda: tk.indexer_topk(
            *inp.args(i), TOPK, width=L, workspace=ws_t, out=out), ncalls)
    res["step_fp8_us"] = timeit(lambda i: lambda: tk.indexer_topk(
        *inp.args(i), TOPK, width=L, workspace=ws8, out=out), ncalls)
    res["step_us"] = timeit(lambda i: step(i, L), ncalls)
    res["route"] = ws.plan_call(B, L, PAGE).kind
    if res["route"] == "fused":  # the same step as score-then-select launches, for comparison
        ws_u = IndexerTopkWorkspace(B, TOPK, WIDE, DEV, config=config.with_values(fused=False))
        res["step_unfused_us"] = timeit(lambda i: lambda: tk.indexer_topk(
            *inp.args(i), TOPK, width=L, workspace=ws_u, out=out), ncalls)
    elif config.fused and B <= FUSED_MAX_ROWS:  # the fused step the planner passed over
        ws_f = without(config, cluster_smem=0)
        if ws_f.plan_call(B, L, PAGE).fused:
            res["step_fused_us"] = timeit(lambda i: lambda: tk.indexer_topk(
                *inp.args(i), TOPK, width=L, workspace=ws_f, out=out), ncalls)
    res["step_wide_host_us"] = timeit(lambda i: step(i, WIDE), ncalls)
    res["step_wide_active_us"] = timeit(lambda i: step(i, WIDE, active), ncalls)
    # top-k alone, on the buffers the peers' top-k get (each input copy's scores), read L wide
    _, npeer, _, peer_bufs = peer_logits(inp, ncalls)
    views = [b[:, :L] for b in peer_bufs]
    tws = IndexerTopkWorkspace(B, TOPK, 0, DEV, config=config)
    res["topk_us"] = timeit(lambda i: lambda: tk.topk_indices(
        views[i % npeer], inp.lens, TOPK, workspace=tws, out=out), ncalls)
    # dense logits of width L (each input copy's) for the dense scorer and the other top-k
    nl = max(2, min(ncalls, math.ceil(L2_BYTES / (B * L * 4))))
    logits = [tk.paged_indexer_logits(*inp.args(j), L) for j in range(nl)]
    res["dense_scorer_us"] = timeit(lambda i: lambda: tk.paged_indexer_logits(
        *inp.args(i), L, out=logits[i % nl], config=config), ncalls)
    # the other top-k algorithms: top-k alone and the whole step (``topk_<algo>_us``, ``step_<algo>_us``)
    for algo in (a for a in algos if a != config.topk):
        cfg_a = config.with_values(topk=algo, fused=False)
        tws_a = IndexerTopkWorkspace(B, TOPK, 0, DEV, config=cfg_a)
        if algo == "cuda" and not cuda_topk_status(tws_a.device)[0]:  # it would time the Triton fallback
            res["topk_cuda_check"] = f"unavailable: {cuda_topk_status(tws_a.device)[1]}"
            continue
        res[f"topk_{algo}_us"] = timeit(lambda i, w=tws_a: lambda: tk.topk_indices(
            logits[i % nl], inp.lens, TOPK, workspace=w, out=out), ncalls)
        ws_a = IndexerTopkWorkspace(B, TOPK, L, DEV, config=cfg_a)
        res[f"step_{algo}_us"] = timeit(lambda i, w=ws_a: lambda: tk.indexer_topk(
            *inp.args(i), TOPK, width=L, workspace=w, out=out), ncalls)
        mine = tk.topk_indices(logits[0], inp.lens, TOPK, workspace=tws)
        theirs = tk.topk_indices(logits[0], inp.lens, TOPK, workspace=tws_a)
        same = torch.equal(mine.sort(dim=1).values, theirs.sort(dim=1).values)  # a set per row
        res[f"topk_{algo}_check"] = "ok" if same else "differs"
    res["torch_topk_us"] = timeit(lambda i: lambda: out.copy_(
        torch.topk(logits[i % nl], TOPK, dim=1).indices), min(ncalls, 24))
    # correctness of this run's step (row 0 .. 1), against our dense logits
    from vllm_sparse_sync.kernels.verify import topk_violations

    got = tk.indexer_topk(*inp.args(0), TOPK, width=L)
    dense = tk.paged_indexer_logits(*inp.args(0), L)
    rows = min(B, 2)
    bad = topk_violations(got[:rows], dense[:rows], inp.lens[:rows], TOPK, tol=1e-3)
    if kind != TRITON:  # the step's selection on the Triton scorer's logits too
        triton_only = config.with_values(cuda=False)
        dense_t = tk.paged_indexer_logits(*inp.args(0), L, config=triton_only)
        bad = bad or topk_violations(got[:rows], dense_t[:rows], inp.lens[:rows], TOPK, tol=1e-3)
        fin = torch.isfinite(dense_t[:rows])
        res["scorer_vs_triton_max_rel"] = float(((dense[:rows] - dense_t[:rows]).abs()[fin]).max()
                                                / dense_t[:rows][fin].abs().max())
    res["fused_stalls"] = ws.stalled_rows()  # rows whose barriers gave up (marked -1): must be 0
    trouble = ["stalled rows"] if res["fused_stalls"] else []
    res["step_check"] = "ok" if not bad and not trouble else (bad or trouble)[0]
    if B * L <= 65536:  # the torch reference scorer (Python loop over rows, host syncs): eager timing
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ref.paged_indexer_logits(*inp.args(0), L)
        s.record()
        for i in range(5):
            ref.paged_indexer_logits(*inp.args(i), L)
        e.record()
        torch.cuda.synchronize()
        res["reference_scorer_us"] = s.elapsed_time(e) * 1000.0 / 5


def load_deepgemm():
    if not os.path.isdir(os.path.join(ROOT, ".peers")):
        return None
    dst = os.path.join(tempfile.gettempdir(), "peers")
    if not os.path.isdir(dst + "/vllm"):
        os.makedirs(dst, exist_ok=True)
        with tarfile.open(os.path.join(ROOT, ".peers/peers.tgz")) as tf:
            tf.extractall(dst)
    sys.path.insert(0, dst + "/vllm/third_party")
    import deep_gemm

    return deep_gemm


def load_vllm_topk():
    if not os.path.isdir(os.path.join(ROOT, ".peers_topk")):
        return None
    so = os.path.join(tempfile.gettempdir(), "_C_stable_libtorch.abi3.so")
    if not os.path.exists(so):
        with lzma.open(os.path.join(ROOT, ".peers_topk/cstable.xz")) as f, open(so, "wb") as g:
            g.write(f.read())
    torch.ops.load_library(so)
    return torch.ops._C


FI_ALGOS = {"auto": 0, "filtered": 1, "multi_cta": 2}
"""FlashInfer's native top-k paths (``benchmarks/flashinfer_topk_peer.cu``)"""


FI_WRAPPER = os.path.join(ROOT, "benchmarks", "flashinfer_topk_peer.cu")


def flashinfer_stamp(src: str) -> str:
    """The sha256 of what a FlashInfer peer library is built from: our wrapper and the headers'
    archive in ``src`` (``.peers_fi/``)."""
    import hashlib

    h = hashlib.sha256()
    for path in (FI_WRAPPER, os.path.join(src, "include.tar.xz")):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def flashinfer_fresh(so: str, src: str) -> bool:
    """Whether the library ``so`` exists and its ``.sha256`` stamp is today's wrapper and ``src``'s
    headers (else it is missing or stale)."""
    try:
        with open(so + ".sha256") as f:
            stamp = f.read().strip()
    except OSError:
        return False
    return os.path.exists(so) and stamp == flashinfer_stamp(src)


def flashinfer_prebuilt(src: str, arch: str) -> str | None:
    """``src``'s prebuilt library for ``arch`` (``libfi_topk.sm_<arch>.so``) when it is fresh
    (``flashinfer_fresh``), else None."""
    so = os.path.join(src, f"libfi_topk.sm_{arch}.so")
    return so if flashinfer_fresh(so, src) else None


def build_flashinfer_topk(src: str, arch: str, so: str, nvcc: str) -> None:
    """Compile our wrapper over ``src``'s FlashInfer headers for ``sm_<arch>`` into ``so`` (the
    CUDA runtime linked statically, so it loads wherever the driver is new enough) and stamp it."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(os.path.join(src, "include.tar.xz")) as tf:
            tf.extractall(tmp)
        cmd = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-use_fast_math",
               "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3",
               "-DFLASHINFER_ENABLE_FP8_E5M2", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-shared",
               "-cudart", "static", "-Xcompiler", "-fPIC", "-I", tmp, FI_WRAPPER, "-o", so + ".tmp"]
        print(f"compiling FlashInfer's top-k for sm_{arch} with {nvcc} (a minute or two) ...", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed ({done.returncode}): {done.stderr[-2000:]}")
        os.replace(so + ".tmp", so)
    with open(so + ".sha256", "w") as f:
        f.write(flashinfer_stamp(src) + "\n")


def build_flashinfer_cli(arch: str, nvcc: str) -> int:
    """``--build-flashinfer ARCH``: the prebuilt library in ``.peers_fi/``; 0 when built, 2 (with
    the reason on stderr) when the arch, the headers or nvcc are missing or nvcc fails."""
    import re
    import shutil

    src = os.path.join(ROOT, ".peers_fi")
    nvcc = nvcc or shutil.which("nvcc") or ""
    why = (f"--build-flashinfer: {arch!r} is not an arch like 90a or 100a"
           if not re.fullmatch(r"[0-9]{2,3}[af]?", arch) else
           "--build-flashinfer: no .peers_fi/ (run benchmarks/peers_flashinfer.sh first)"
           if not os.path.isfile(os.path.join(src, "include.tar.xz")) else
           "--build-flashinfer: no nvcc (set NVCC or put nvcc on PATH)" if not nvcc else "")
    if not why:
        so = os.path.join(src, f"libfi_topk.sm_{arch}.so")
        try:
            build_flashinfer_topk(src, arch, so, nvcc)
        except (RuntimeError, OSError) as exc:
            why = f"--build-flashinfer: {exc}"
        else:
            print(f"built {os.path.relpath(so, ROOT)} ({os.path.getsize(so) >> 10} KiB)")
            return 0
    print(f"error: {why}", file=sys.stderr)
    return 2


def load_flashinfer_topk():
    """FlashInfer's native ragged top-k through our C wrapper, when the checkout holds
    ``.peers_fi/`` (``benchmarks/peers_flashinfer.sh``): its prebuilt library for this device when
    the stamp matches, else compiled here with the host's nvcc (cached under the temp dir); None
    without ``.peers_fi/``."""
    import ctypes
    import shutil

    src = os.path.join(ROOT, ".peers_fi")
    if not os.path.isdir(src):
        return None
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}{'a' if major >= 9 else ''}"
    so = flashinfer_prebuilt(src, arch)
    if so is None:
        stale = os.path.join(src, f"libfi_topk.sm_{arch}.so")
        if os.path.exists(stale):
            print(f"FlashInfer's top-k: {os.path.relpath(stale, ROOT)} is stale or unstamped (not built from "
                  "today's wrapper and headers): compiling here", flush=True)
        build = os.path.join(tempfile.gettempdir(), "peers_fi")
        os.makedirs(build, exist_ok=True)
        so = os.path.join(build, f"libfi_topk.sm_{arch}.so")  # cached for later runs of these sources
        if not flashinfer_fresh(so, src):
            build_flashinfer_topk(src, arch, so, shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    else:
        print(f"FlashInfer's top-k: prebuilt {os.path.relpath(so, ROOT)}", flush=True)
    lib = ctypes.CDLL(so)
    p, u = ctypes.c_void_p, ctypes.c_uint
    lib.fi_topk_ragged.argtypes = [p, p, p, p, u, u, u, p, ctypes.c_int, ctypes.c_int, p]
    lib.fi_topk_ragged.restype = ctypes.c_int
    if hasattr(lib, "fi_topk_page_table"):  # (benchmarks/topk_slots.py)
        ll = ctypes.c_longlong
        lib.fi_topk_page_table.argtypes = [p, p, p, ll, p, u, u, u, ll, u, p, ctypes.c_int, p]
        lib.fi_topk_page_table.restype = ctypes.c_int
    return lib


def peer_logits(inp: Inputs, ncalls: int):
    """The dense logits every top-k alone gets, ours and the peers': ``(width, buffers, first,
    buffer list)``, 128K-wide buffers (``-inf`` past the live length) where they fit, rotated past
    L2; buffer j holds input copy j's scores, so the calls select from the inputs the step sees."""
    from vllm_sparse_sync.kernels import ops as tk

    B, L = inp.B, inp.L
    width = WIDE if B * WIDE * 4 < 2e9 else L
    nl = max(2, min(ncalls, math.ceil(L2_BYTES / (B * width * 4)), 16))
    bufs = []
    for j in range(nl):
        buf = torch.full((B, width), float("-inf"), device=DEV)
        buf[:, :L] = tk.paged_indexer_logits(*inp.args(j), L)
        bufs.append(buf)
    return width, nl, bufs[0], bufs


def fi_call(lib, x, out, offsets, lens, states, algo: int):
    """A call of FlashInfer's ragged top-k (``FI_ALGOS``) on ``x`` (rows of stride ``x.stride(0)``)
    into ``out``, on torch's current stream; raises on a CUDA error."""
    def run():
        err = lib.fi_topk_ragged(x.data_ptr(), out.data_ptr(), offsets.data_ptr(), lens.data_ptr(),
                                 x.shape[0], out.shape[1], x.stride(0), states.data_ptr(), algo, 0,
                                 torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"FlashInfer top-k returned cudaError {err}")
    return run


def bench_flashinfer_topk(lib, inp: Inputs, ncalls: int, res: dict) -> None:
    """FlashInfer's ragged top-k (offsets 0: plain indices) on the buffers vLLM's top-k gets."""
    from vllm_sparse_sync.kernels import ops as tk

    B = inp.B
    _, nl, base, bufs = peer_logits(inp, ncalls)
    offsets = torch.zeros(B, dtype=torch.int32, device=DEV)
    lens = inp.lens.to(torch.int32).clone()
    states = torch.zeros(1 << 20, dtype=torch.uint8, device=DEV)  # zeroed once, as FlashInfer does
    out = torch.full((B, TOPK), -1, dtype=torch.int32, device=DEV)
    want = tk.topk_indices(base, inp.lens, TOPK).sort(dim=1).values

    def call(buf, algo):
        return fi_call(lib, buf, out, offsets, lens, states, algo)

    for name, algo in FI_ALGOS.items():
        try:
            res[f"fi_{name}_topk_us"] = timeit(lambda i, a=algo: call(bufs[i % nl], a), ncalls)
            call(base, algo)()
            same = torch.equal(out.sort(dim=1).values, want)
            res[f"fi_{name}_topk_check"] = "ok" if same else "differs"
        except Exception as exc:
            res[f"fi_{name}_topk_err"] = str(exc).splitlines()[0][:160]
            torch.cuda.synchronize()


def bench_deepgemm(dg, inp: Inputs, ncalls: int, res: dict) -> None:
    B, L = inp.B, inp.L
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    q4 = inp.q.view(B, 1, H, D)
    lens2 = inp.lens.view(B, 1)
    sched = dg.get_paged_mqa_logits_metadata(lens2, PAGE, nsm)

    def call(i, width):
        _, _, cache, table, _ = inp.args(i, width == WIDE)
        kv = cache.view(cache.shape[0], PAGE, 1, D + 4)
        return lambda: dg.fp8_fp4_paged_mqa_logits((q4, None), kv, inp.w, lens2, table, sched, width)

    res["deepgemm_us"] = timeit(lambda i: call(i, L), ncalls)
    if B * WIDE * 4 < 2e9:
        res["deepgemm_wide_us"] = timeit(lambda i: call(i, WIDE), ncalls)
    res["deepgemm_sched_us"] = timeit(
        lambda i: lambda: dg.get_paged_mqa_logits_metadata(lens2, PAGE, nsm), 12)


def bench_vllm_topk(ops, inp: Inputs, ncalls: int, res: dict) -> None:
    """vLLM's persistent and cooperative top-k; each one's set checked against the reference."""
    from vllm_sparse_sync.kernels import ops as tk

    B, L = inp.B, inp.L
    _, nl, base, bufs = peer_logits(inp, ncalls)
    ws = torch.empty(1024 * 1024, dtype=torch.uint8, device=DEV)
    out = torch.full((B, TOPK), -1, dtype=torch.int32, device=DEV)
    want = tk.topk_indices(base, inp.lens, TOPK).sort(dim=1).values
    for name in ("persistent", "cooperative"):
        op = getattr(ops, f"{name}_topk")
        try:
            res[f"vllm_{name}_topk_us"] = timeit(
                lambda i, op=op: lambda: op(bufs[i % nl], inp.lens, out, ws, TOPK, L), ncalls)
            out.fill_(-1)
            op(base, inp.lens, out, ws, TOPK, L)
            res[f"vllm_{name}_topk_check"] = "ok" if torch.equal(out.sort(dim=1).values, want) else "differs"
        except Exception as exc:  # cooperative_topk serves <= 64 rows only
            res[f"vllm_{name}_topk_err"] = str(exc).splitlines()[0][:100]
            torch.cuda.synchronize()


class SglangTopk:
    """SGLang's decode top-k (sgl-kernel's ``topk_kernel``: one CTA per row, k 2048), loaded from
    the cubin ``benchmarks/peers_sglang.sh`` extracts from the sgl-kernel wheel, and launched
    with the CUDA driver in torch's context."""

    TOPK = 2048
    THREADS = 1024
    SMEM = 128 * 1024

    def __init__(self, folder: str) -> None:
        import ctypes

        from vllm_sparse_sync.kernels.cuda import topk as cuda_topk

        self.ctypes = ctypes
        self.mod = cuda_topk.module_for(torch.cuda.current_device())  # the primary context
        drv = self.driver = self.mod.driver
        with open(os.path.join(folder, "fast_topk.sm_90a.cubin"), "rb") as f:
            self.module = cuda_topk._check(drv.cuModuleLoadData(f.read()), "cuModuleLoadData(sglang)")
        symbol = open(os.path.join(folder, "SYMBOL")).read().strip().encode()
        self.fn = cuda_topk._check(drv.cuModuleGetFunction(self.module, symbol),
                                   "cuModuleGetFunction(sglang)")
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        cuda_topk._check(drv.cuFuncSetAttribute(self.fn, attr, self.SMEM), "cuFuncSetAttribute(sglang)")

        class Params(ctypes.Structure):  # FastTopKParams, passed by value (40 bytes)
            _fields_ = [("input", ctypes.c_void_p), ("row_starts", ctypes.c_void_p),
                        ("indices", ctypes.c_void_p), ("lengths", ctypes.c_void_p),
                        ("input_stride", ctypes.c_int64)]

        self.Params = Params

    def __call__(self, logits: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        """``out[r]`` = the top-2048 positions of ``logits[r, :lengths[r]]`` (int32 lengths)."""
        from vllm_sparse_sync.kernels.cuda import topk as cuda_topk

        p = self.Params(logits.data_ptr(), None, out.data_ptr(), lengths.data_ptr(), logits.stride(0))
        args = (self.ctypes.c_void_p * 1)(self.ctypes.addressof(p))
        stream = self.driver.CUstream(torch.cuda.current_stream().cuda_stream)
        cuda_topk._check(self.driver.cuCtxSetCurrent(self.mod.ctx), "cuCtxSetCurrent")
        launch = self.driver.cuLaunchKernel(self.fn, out.shape[0], 1, 1, self.THREADS, 1, 1, self.SMEM,
                                            stream, self.ctypes.addressof(args), 0)
        cuda_topk._check(launch, "sglang topk launch")


def load_sglang_topk():
    """SGLang's top-k when the checkout holds ``.peers_sgl/`` and the GPU is sm_90; else None."""
    folder = os.path.join(ROOT, ".peers_sgl")
    if not os.path.isdir(folder) or torch.cuda.get_device_capability() != (9, 0):
        return None
    return SglangTopk(folder)


def bench_sglang_topk(sgl, inp: Inputs, ncalls: int, res: dict) -> None:
    """SGLang's top-k on the buffers vLLM's top-k gets; the set checked against the reference."""
    from vllm_sparse_sync.kernels import ops as tk

    width, nl, base, bufs = peer_logits(inp, ncalls)
    lens = inp.lens.to(torch.int32).clone()
    out = torch.full((inp.B, TOPK), -1, dtype=torch.int32, device=DEV)
    want = tk.topk_indices(base, inp.lens, TOPK).sort(dim=1).values
    try:
        res["sgl_topk_us"] = timeit(lambda i: lambda b=bufs[i % nl]: sgl(b, lens, out), ncalls)
        sgl(base, lens, out)
        res["sgl_topk_check"] = "ok" if torch.equal(out.sort(dim=1).values, want) else "differs"
    except Exception as exc:
        res["sgl_topk_err"] = str(exc).splitlines()[0][:160]
        torch.cuda.synchronize()


STACK_TOPKS = ("vllm_persistent", "vllm_cooperative", "fi_auto", "sgl")
"""the peer top-k kernels timed after DeepGEMM in one graph (``stack_<name>_us``); FlashInfer by
its own dispatch (``auto``), as a FlashInfer user gets it"""


def peer_topk_makers(vt, fi, sgl, inp: Inputs) -> dict:
    """Each loaded peer top-k as ``name -> make(logits) -> call``: the call writes the top-k of
    ``logits[:, :L]`` (any row stride) into the returned dict's ``"out"`` buffer."""
    B, L = inp.B, inp.L
    out = torch.full((B, TOPK), -1, dtype=torch.int32, device=DEV)
    lens = inp.lens.to(torch.int32).clone()
    makers: dict = {"out": out}
    if vt is not None:
        ws = torch.empty(1024 * 1024, dtype=torch.uint8, device=DEV)
        for name in ("persistent", "cooperative"):
            op = getattr(vt, f"{name}_topk")
            makers[f"vllm_{name}"] = lambda x, op=op: lambda: op(x, lens, out, ws, TOPK, L)
    if fi is not None:
        offsets = torch.zeros(B, dtype=torch.int32, device=DEV)
        states = torch.zeros(1 << 20, dtype=torch.uint8, device=DEV)  # zeroed once, as FlashInfer does
        makers["fi_auto"] = lambda x: fi_call(fi, x, out, offsets, lens, states, FI_ALGOS["auto"])
    if sgl is not None:
        makers["sgl"] = lambda x: lambda: sgl(x, lens, out)
    return makers


def deepgemm_logits(dg, inp: Inputs):
    """``logits(i)``: DeepGEMM's paged logits of input copy ``i`` (exact width L), as a call."""
    B, L = inp.B, inp.L
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    q4 = inp.q.view(B, 1, H, D)
    lens2 = inp.lens.view(B, 1)
    sched = dg.get_paged_mqa_logits_metadata(lens2, PAGE, nsm)

    def logits(i):
        _, _, cache, table, _ = inp.args(i)
        kv = cache.view(cache.shape[0], PAGE, 1, D + 4)
        return dg.fp8_fp4_paged_mqa_logits((q4, None), kv, inp.w, lens2, table, sched, L)

    return logits


def bench_peer_stack(peers, inp: Inputs, ncalls: int, res: dict) -> None:
    """The peer stack as it runs: DeepGEMM's logits, then each peer top-k on them, in one graph
    (``stack_<name>_us``; the top-k reads what DeepGEMM just wrote, as our step's top-k reads the
    scorer's logits). Each stack's selection is checked on DeepGEMM's own logits
    (``stack_<name>_check``)."""
    from vllm_sparse_sync.kernels.verify import topk_violations

    dg, vt, fi, sgl = peers
    B = inp.B
    logits = deepgemm_logits(dg, inp)
    try:
        makers = peer_topk_makers(vt, fi, sgl, inp)
    except Exception as exc:  # a peer's setup failing must not cost the round the other benches
        res["stack_err"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return
    out = makers.pop("out")
    for name in STACK_TOPKS:
        if name not in makers:
            continue
        make = makers[name]
        try:
            res[f"stack_{name}_us"] = timeit(lambda i, make=make: lambda: make(logits(i))(), ncalls)
            out.fill_(-1)
            dense = logits(0)
            make(dense)()
            bad = topk_violations(out[: min(B, 2)], dense[: min(B, 2)], inp.lens[: min(B, 2)], TOPK)
            res[f"stack_{name}_check"] = "ok" if not bad else bad[0][:120]
        except Exception as exc:  # e.g. vLLM's cooperative top-k serves <= 64 rows only
            res[f"stack_{name}_err"] = str(exc).splitlines()[0][:120]
            torch.cuda.synchronize()


def bench_interleaved(peers, inp: Inputs, ncalls: int, config, res: dict, iters: int = 15) -> None:
    """Our exact and fp8 steps and every peer stack, each its own graph, replayed in turn
    (``graph_timer.interleaved_replay_us``): ``il_step_us``, ``il_step_fp8_us``,
    ``il_stack_<name>_us``. Timed in separate slots, a later slot can meet a lower clock (the
    H200 holds 700 W by lowering it: docs/performance.md); interleaved, every graph
    meets the same drift, so their ratios are the fair ones."""

    dg, vt, fi, sgl = peers
    B, L = inp.B, inp.L
    ws, ws8 = step_workspaces(B, L, config)
    out = torch.empty(B, TOPK, dtype=torch.int32, device=DEV)
    step, step8 = step_calls(inp, ws, out)["step"], step_calls(inp, ws8, out)["step"]
    named = {"il_step_us": [lambda i=i: step(i) for i in range(ncalls)],
             "il_step_fp8_us": [lambda i=i: step8(i) for i in range(ncalls)]}
    logits = deepgemm_logits(dg, inp)
    makers = peer_topk_makers(vt, fi, sgl, inp)
    makers.pop("out")
    for name in STACK_TOPKS:
        if name not in makers:
            continue
        calls = [lambda i=i, make=makers[name]: make(logits(i))() for i in range(ncalls)]
        try:  # a top-k that refuses the shape (vLLM's cooperative: <= 64 rows) stays out
            calls[0]()
            torch.cuda.synchronize()
        except Exception as exc:
            torch.cuda.synchronize()
            res[f"il_stack_{name}_err"] = str(exc).splitlines()[0][:120]
            continue
        named[f"il_stack_{name}_us"] = calls
    try:  # a failure here must not cost the round its other slots
        res.update(interleaved_replay_us(named, iters))
    except Exception as exc:
        torch.cuda.synchronize()
        res["il_err"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


PEER_TOPK_KEYS = ("vllm_persistent_topk_us", "vllm_cooperative_topk_us", "fi_auto_topk_us",
                  "fi_filtered_topk_us", "fi_multi_cta_topk_us", "sgl_topk_us")
"""every peer top-k time; the best of those measured is the one ours is compared with"""


def derive(res: dict, bw: float) -> dict:
    """Bandwidth, bound ratio and peer comparison fields from the raw times."""
    B, L = res["B"], res["L"]
    kbytes = B * L * 132
    if "scorer_us" in res:
        res["scorer_tbs"] = kbytes / (res["scorer_us"] * 1e-6) / 1e12
        res["scorer_pct_copy"] = 100 * res["scorer_tbs"] / bw
        res["scorer_fp8_tbs"] = kbytes / (res["scorer_fp8_us"] * 1e-6) / 1e12
        res["wide_over_exact"] = max(res["step_wide_host_us"], res["step_wide_active_us"]) / res["step_us"]
    topks = [res[k] for k in PEER_TOPK_KEYS if k in res and res.get(k.replace("_us", "_check"), "ok") == "ok"]
    if topks and "topk_us" in res:
        res["topk_over_best_peer"] = res["topk_us"] / min(topks)
    if "deepgemm_us" in res and topks:
        res["best_peer_step_us"] = res["deepgemm_us"] + min(topks)
        if "step_us" in res:
            res["ours_over_best_peer"] = res["step_us"] / res["best_peer_step_us"]
            res["ours_fp8_over_best_peer"] = res["step_fp8_us"] / res["best_peer_step_us"]
    stacks = {n: res[f"stack_{n}_us"] for n in STACK_TOPKS
              if f"stack_{n}_us" in res and res.get(f"stack_{n}_check") == "ok"}
    if stacks:
        best = min(stacks, key=stacks.get)
        res["peer_stack_us"], res["peer_stack_topk"] = stacks[best], best
        if "step_us" in res:
            res["ours_over_peer_stack"] = res["step_us"] / stacks[best]
            res["ours_fp8_over_peer_stack"] = res["step_fp8_us"] / stacks[best]
        fused = res.get("step_us") if res.get("route") == "fused" else res.get("step_fused_us")
        if B <= FUSED_TARGET_ROWS and fused is not None:
            res["fused_over_peer_stack"] = fused / stacks[best]
    il_stacks = {n: res[f"il_stack_{n}_us"] for n in STACK_TOPKS
                 if f"il_stack_{n}_us" in res and res.get(f"stack_{n}_check") == "ok"}
    if il_stacks and "il_step_us" in res:
        best = min(il_stacks, key=il_stacks.get)
        res["il_peer_stack_topk"] = best
        res["il_ours_over_peer_stack"] = res["il_step_us"] / il_stacks[best]
        res["il_ours_fp8_over_peer_stack"] = res["il_step_fp8_us"] / il_stacks[best]
    return res


FUSED_TARGET_ROWS = 8
"""the rows up to which the fused route has its own target (issue 13: <= 0.8x the peer stack)"""
TARGETS = (("topk_over_best_peer", 1.0, "top-k / best peer top-k"),
           ("ours_over_peer_stack", 1.0, "exact step / peer stack"),
           ("ours_fp8_over_peer_stack", 0.9, "fp8 step / peer stack"),
           ("il_ours_over_peer_stack", 1.0, "exact step / peer stack, interleaved"),
           ("il_ours_fp8_over_peer_stack", 0.9, "fp8 step / peer stack, interleaved"),
           ("fused_over_peer_stack", 0.8, f"fused step / peer stack (rows <= {FUSED_TARGET_ROWS})"))
"""the speed targets: ratio field, the most it may be, its heading"""


def targets_table(rows: list[dict]) -> str:
    """Each shape's ratio for every target of ``TARGETS`` (marked where it misses), then how many
    shapes met each target of those that measured it (a ratio not measured is not a pass)."""
    lines = ["| B | L | " + " | ".join(f"{h} <= {t}" for _, t, h in TARGETS) + " |",
             "|---:|---:|" + "---:|" * len(TARGETS)]
    met = {name: [0, 0] for name, _, _ in TARGETS}
    for r in rows:
        cells = []
        for name, target, _ in TARGETS:
            v = r.get(name)
            if v is None:
                cells.append("-")
                continue
            met[name][1] += 1
            met[name][0] += v <= target
            cells.append(f"{v:.3f}" + ("" if v <= target else " (miss)"))
        lines.append(f"| {r['B']} | {r['L']} | " + " | ".join(cells) + " |")
    lines.append("met: " + ", ".join(f"{h} {met[n][0]}/{met[n][1]}" for n, _, h in TARGETS))
    return "\n".join(lines)


COLS = [("B", "{}"), ("L", "{}"), ("route", "{}"), ("scorer_us", "{:.1f}"), ("topk_us", "{:.1f}"),
        ("step_us", "{:.1f}"), ("step_unfused_us", "{:.1f}"), ("step_fused_us", "{:.1f}"),
        ("scorer_tbs", "{:.2f}"), ("scorer_pct_copy", "{:.0f}"), ("wide_over_exact", "{:.3f}"),
        ("scorer_fp8_us", "{:.1f}"), ("step_fp8_us", "{:.1f}"), ("scorer_triton_us", "{:.1f}"),
        ("scorer_cuda_fp8_us", "{:.1f}"), ("step_triton_us", "{:.1f}"), ("topk_sample_us", "{:.1f}"),
        ("topk_cuda_us", "{:.1f}"),
        ("step_sample_us", "{:.1f}"), ("topk_radix_us", "{:.1f}"), ("step_radix_us", "{:.1f}"),
        ("torch_topk_us", "{:.1f}"), ("deepgemm_us", "{:.1f}"), ("vllm_persistent_topk_us", "{:.1f}"),
        ("vllm_cooperative_topk_us", "{:.1f}"), ("fi_auto_topk_us", "{:.1f}"),
        ("fi_filtered_topk_us", "{:.1f}"), ("fi_multi_cta_topk_us", "{:.1f}"), ("sgl_topk_us", "{:.1f}"),
        ("topk_over_best_peer", "{:.2f}"), ("best_peer_step_us", "{:.1f}"),
        ("ours_over_best_peer", "{:.2f}"), ("ours_fp8_over_best_peer", "{:.2f}"),
        ("peer_stack_us", "{:.1f}"), ("ours_over_peer_stack", "{:.2f}"),
        ("ours_fp8_over_peer_stack", "{:.2f}"), ("il_step_us", "{:.1f}"), ("il_step_fp8_us", "{:.1f}"),
        ("il_ours_over_peer_stack", "{:.3f}"), ("il_ours_fp8_over_peer_stack", "{:.3f}")]


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(c for c, _ in COLS) + " |"
    lines = [head, "|" + "---:|" * len(COLS)]
    for r in rows:
        cells = [f.format(r[c]) if c in r and r[c] is not None else "-" for c, f in COLS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def combine(paths: list[str]) -> dict:
    """Merge runs: ours from the first run that has it; each peer's figures from the run that has them."""
    runs = [json.load(open(p)) for p in paths]
    bw = runs[0]["copy_tbs"]
    merged: dict[tuple, dict] = {}
    for run in runs:
        for r in run["shapes"]:
            m = merged.setdefault((r["B"], r["L"]), {})
            for key, v in r.items():
                m.setdefault(key, v)
    shapes = [derive(m, bw) for m in merged.values()]
    return dict(runs=[r.get("meta", {}) for r in runs], copy_tbs=bw, shapes=shapes)


def merge_rounds(rounds: list[dict]) -> dict:
    """One shape's rounds as one result: each numeric field the median of the rounds that have it
    (the upper one of an even count), others from the first round that has them."""
    if not rounds:
        raise ValueError("merge_rounds: needs at least one round")
    out: dict = {}
    for key in dict.fromkeys(k for r in rounds for k in r):
        vals = [r[key] for r in rounds if key in r]
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out[key] = sorted(nums)[len(nums) // 2] if len(nums) == len(vals) else vals[0]
    return out


SPREAD_RATIOS = (("topk_over_best_peer", 1.0), ("ours_over_best_peer", 1.0), ("ours_fp8_over_best_peer", 0.9),
                 ("ours_over_peer_stack", 1.0), ("ours_fp8_over_peer_stack", 0.9),
                 ("il_ours_over_peer_stack", 1.0), ("il_ours_fp8_over_peer_stack", 0.9),
                 ("fused_over_peer_stack", 0.8))
"""the ratios ``spread`` reports, each with the target it counts runs against"""


def spread(runs: list[dict]) -> list[dict]:
    """Per shape (in the first run's order), each ratio of ``SPREAD_RATIOS`` across the runs that
    have it: median, min, max, runs, and runs at or under its target. A shape missing from a run,
    or a ratio missing from a shape, is left out of that ratio's count (not read as a pass)."""
    if not runs:
        raise ValueError("spread: needs at least one run")
    order = [(r["B"], r["L"]) for r in runs[0]["shapes"]]
    by_shape = [{(r["B"], r["L"]): r for r in run["shapes"]} for run in runs]
    out = []
    for key in order:
        row = dict(B=key[0], L=key[1])
        for name, target in SPREAD_RATIOS:
            vals = sorted(s[key][name] for s in by_shape if key in s and s[key].get(name) is not None)
            if not vals:
                continue
            mid = len(vals) // 2
            median = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
            row[name] = dict(median=median, min=vals[0], max=vals[-1], runs=len(vals),
                             met=sum(v <= target for v in vals))
        out.append(row)
    return out


def spread_table(rows: list[dict]) -> str:
    """``spread``'s rows as a table: median [min, max] met/runs for each ratio."""
    lines = ["| B | L | " + " | ".join(n for n, _ in SPREAD_RATIOS) + " |",
             "|---:|---:|" + "---|" * len(SPREAD_RATIOS)]
    for r in rows:
        cells = []
        for name, target in SPREAD_RATIOS:
            v = r.get(name)
            cells.append("-" if v is None else f"{v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}] "
                         f"{v['met']}/{v['runs']} <= {target}")
        lines.append(f"| {r['B']} | {r['L']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_config(text: str) -> KernelConfig:
    """``"topk=radix,precise=false"`` over the defaults."""
    return parse_kernel_config(text) if text else DEFAULT_CONFIG


def compare(rows: list[dict], baseline_path: str) -> str:
    """Each shape's step time over the baseline run's (``step_us`` and ``step_wide_*``)."""
    base = {(r["B"], r["L"]): r for r in json.load(open(baseline_path))["shapes"]}
    lines = ["| B | L | route | step_us | baseline | ratio | wide/exact |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get((r["B"], r["L"]), {})
        if "step_us" not in r or "step_us" not in b:
            continue
        lines.append(f"| {r['B']} | {r['L']} | {r.get('route', '-')} | {r['step_us']:.1f} | "
                     f"{b['step_us']:.1f} | {r['step_us'] / b['step_us']:.2f} | {r['wide_over_exact']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--peers-only", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--config", default="")
    ap.add_argument("--config-file", default="", help="a KernelConfig as JSON (KernelConfig.to_dict); overrides --config")
    ap.add_argument("--topk-algos", default="radix,sample,cuda",
                    help="top-k algorithms to time besides the config's (topk_<algo>_us, step_<algo>_us)")
    ap.add_argument("--combine", nargs="*")
    ap.add_argument("--spread", nargs="*", help="runs of one build: each shape's ratios across them")
    ap.add_argument("--rounds", type=int, default=1, help="ours and each peer timed this many times a shape")
    ap.add_argument("--baseline", default="", help="a committed run to compare each shape's step time with")
    ap.add_argument("--build-flashinfer", metavar="ARCH", default="",
                    help="build FlashInfer's top-k for sm_ARCH (e.g. 90a) into .peers_fi/ with this host's "
                         "nvcc ($NVCC or on PATH), no GPU needed, then exit")
    a = ap.parse_args()
    if a.build_flashinfer:
        sys.exit(build_flashinfer_cli(a.build_flashinfer, os.environ.get("NVCC", "")))
    if a.rounds < 1:
        ap.error(f"--rounds: must be >= 1, got {a.rounds}")
    if a.spread:
        runs = [json.load(open(p)) for p in a.spread]
        for run in (r for r in runs if "copy_tbs" in r):  # today's ratios from each run's times
            for shape in run["shapes"]:  # (a run older than a ratio gains it)
                derive(shape, run["copy_tbs"])
        rows = spread(runs)
        print(spread_table(rows))
        if a.out:
            json.dump(dict(runs=a.spread, shapes=rows), open(a.out, "w"), indent=1)
        return
    if not torch.cuda.is_available() and not a.combine:
        print("error: benchmarks/indexer.py times CUDA kernels and needs a CUDA device "
              f"(torch {torch.__version__}: {'no device visible' if torch.version.cuda else 'a CPU build'})",
              file=sys.stderr)
        sys.exit(2)
    if a.combine:
        data = combine(a.combine)
        print(table(data["shapes"]))
        print(targets_table(data["shapes"]))
        if a.out:
            json.dump(data, open(a.out, "w"), indent=1)
        return
    shapes = SHAPES
    if a.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    config = parse_config(a.config)
    if a.config_file and os.path.exists(a.config_file):
        config = KernelConfig.from_dict(json.load(open(a.config_file)))
    dg = None if a.no_peers else load_deepgemm()
    vt = None if a.no_peers else load_vllm_topk()
    fi, fi_error = None, None
    if not a.no_peers:
        try:
            fi = load_flashinfer_topk()
        except Exception as exc:  # a peer that does not build must not stop our run
            fi_error = f"{type(exc).__name__}: {str(exc)[-600:]}"
            print(f"FlashInfer peer unavailable: {fi_error}", flush=True)
    sgl, sgl_error = None, None
    if not a.no_peers:
        try:
            sgl = load_sglang_topk()
        except Exception as exc:
            sgl_error = f"{type(exc).__name__}: {str(exc)[-600:]}"
            print(f"SGLang peer unavailable: {sgl_error}", flush=True)
    bw = copy_tbs()
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                config=config.to_dict(), serving_rows=SERVING_ROWS, deepgemm=dg is not None,
                vllm_topk=vt is not None, flashinfer_topk=fi is not None, flashinfer_error=fi_error,
                sglang_topk=sgl is not None, sglang_error=sgl_error,
                ours=not a.peers_only)
    print(json.dumps(dict(copy_tbs=round(bw, 3), **meta)), flush=True)
    rows = []
    for B, L in shapes:
        copies, ncalls = graph_sizes(B, L)
        inp = Inputs(B, L, copies)
        algos = tuple(x for x in a.topk_algos.split(",") if x)
        # each (name, bench(res, inputs, calls)): ours, then every peer that loaded
        benches = [] if a.peers_only else [
            ("ours", lambda r, i, n, algos=algos: bench_ours(i, n, config, r, algos))]
        for fn, peer in ((bench_deepgemm, dg), (bench_vllm_topk, vt), (bench_flashinfer_topk, fi),
                         (bench_sglang_topk, sgl)):
            if peer is not None:
                benches.append((fn.__name__[6:], lambda r, i, n, fn=fn, peer=peer: fn(peer, i, n, r)))
        if dg is not None and (vt, fi, sgl) != (None, None, None):
            benches.append(("peer_stack", lambda r, i, n: bench_peer_stack((dg, vt, fi, sgl), i, n, r)))
            if not a.peers_only:
                benches.append(("interleaved", lambda r, i, n: bench_interleaved((dg, vt, fi, sgl), i, n,
                                                                                 config, r)))
        rounds = []
        for k in range(a.rounds):
            one = dict(B=B, L=L, copies=copies, calls_per_graph=ncalls)
            try:
                for i in range(len(benches)):  # round k starts with the k-th bench
                    name, bench = benches[(k + i) % len(benches)]
                    t0 = time.perf_counter()
                    bench(one, inp, ncalls)
                    print(f"  {B}x{L} round {k + 1}/{a.rounds}: {name} {time.perf_counter() - t0:.1f} s",
                          file=sys.stderr, flush=True)
            except Exception as exc:
                one["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rounds.append(one)
        res = merge_rounds(rounds)
        if a.rounds > 1:
            res["rounds"] = [derive(dict(r), bw) for r in rounds]
        derive(res, bw)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}),
              flush=True)
        rows.append(res)
        del inp
        torch.cuda.empty_cache()
        if a.out:  # after every shape, so a run cut short keeps what it measured
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            json.dump(dict(meta=meta, copy_tbs=bw, shapes=rows), open(a.out, "w"), indent=1)
    print(table(rows))
    print(targets_table(rows))
    if a.baseline:
        print(compare(rows, a.baseline))
    failed = our_failures(rows)
    if failed:
        print(f"error: a check failed or a round raised: {'; '.join(failed)}", file=sys.stderr)
        sys.exit(1)


def our_failures(rows: list[dict]) -> list[str]:
    """``"BxL: what"`` of every shape where our step selected wrongly (``step_check``), a top-k
    algorithm selected otherwise than the route's (``topk_<algo>_check``: "differs"), or a round
    raised (``error``). A peer's failed check only drops that peer from the ratios."""
    out = []
    for r in rows:
        shape = f"{r['B']}x{r['L']}"
        if "error" in r:
            out.append(f"{shape}: {r['error']}")
        if r.get("step_check", "ok") != "ok":
            out.append(f"{shape}: step {r['step_check']}")
        out += [f"{shape}: {k} differs" for k, v in r.items()
                if k.startswith("topk_") and k.endswith("_check") and v == "differs"]
    return out


if __name__ == "__main__":
    main()
