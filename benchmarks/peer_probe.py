"""Which loaded peer makes our one-row CUDA scorer stop finishing: each probe a fresh process.

    python benchmarks/peer_probe.py [--limit 60] [--json FILE]            # every probe of PROBES
    python benchmarks/peer_probe.py --probe deepgemm,vllm --narrow 1      # one probe, this process
    python benchmarks/peer_probe.py --probes 'all:1:on deepgemm+vllm:1:off' [--pad-mb 1024]

A probe loads the named peers as ``indexer.py`` does (``deepgemm``: DeepGEMM's import;
``vllm``: vLLM's kernel library; ``topk_module``: our CUDA top-k module alone, which SGLang's
loader compiles; ``sgl``: SGLang's cubin on it; ``all``: every one), then times the one-row
scorer the indexer benchmark times first (1 x 4096, ``scorer.cuda_narrow_rows`` = ``--narrow``):
an eager launch, then a CUDA-graph capture and replays. Each phase prints its time as it ends;
a probe still running ``--limit`` seconds after its peers loaded dumps its threads' stacks
(faulthandler) and is reported as stopped. Peers come from the folders ``indexer.py`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ("deepgemm", "vllm", "topk_module", "sgl")
PROBES = [
    ("", 1, "on"), ("all", 1, "off"), ("all", 1, "on"), ("all", 0, "on"),
    ("deepgemm", 1, "on"), ("vllm", 1, "on"), ("topk_module", 1, "on"), ("sgl", 1, "on"),
]
"""(peers, scorer.cuda_narrow_rows, NVRTC cubin cache): the control, the reproduction with every
cubin compiled in the peers' process, the same from the cache, the 4-consumer build, one peer
at a time"""


def parse_peers(text: str) -> tuple[str, ...]:
    """``"deepgemm,vllm"`` -> the peers, in ``PEERS`` order; ``"all"`` every one; ``""`` none."""
    names = [p for p in text.split(",") if p]
    if names == ["all"]:
        return PEERS
    bad = [p for p in names if p not in PEERS]
    if bad:
        raise ValueError(f"--probe: unknown peer(s) {bad}; choose from {', '.join(PEERS)} or 'all'")
    return tuple(p for p in PEERS if p in names)


def parse_probes(text: str) -> list[tuple[str, int, str]]:
    """``"all:1:on deepgemm+vllm:1:off"`` -> ``[("all", 1, "on"), ("deepgemm,vllm", 1, "off")]``
    (peers joined by ``+``, ``none`` for none; narrow rows; cubin cache ``on`` or ``off``)."""
    out = []
    for part in text.split():
        try:
            peers, narrow, cache = part.split(":")
            n = int(narrow)
        except ValueError:
            raise ValueError(f"--probes: {part!r} is not PEERS:NARROW:CACHE (e.g. all:1:on)") from None
        if cache not in ("on", "off"):
            raise ValueError(f"--probes: {part!r}: the cache is 'on' or 'off'")
        names = "" if peers == "none" else peers.replace("+", ",")
        parse_peers(names)
        out.append((names, n, cache))
    if not out:
        raise ValueError("--probes: give at least one PEERS:NARROW:CACHE")
    return out


def probe(peers: tuple[str, ...], narrow: int, limit: float, pad_mb: int = 0) -> None:
    """Load ``peers``, then run the one-row scorer eagerly and in a graph, printing each phase
    (``pad_mb``: device memory allocated before the inputs, to move their addresses)."""
    import faulthandler

    import torch

    sys.path.insert(0, HERE)
    import indexer as ix

    from vllm_sparse_sync.kernels import DEFAULT_CONFIG, cuda_topk
    from vllm_sparse_sync.kernels.scorer import launch_score

    def phase(name, fn):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        print(f"  {name}: {time.perf_counter() - t0:.2f} s", flush=True)
        return out

    torch.cuda.init()
    loaders = dict(deepgemm=ix.load_deepgemm, vllm=ix.load_vllm_topk,
                   topk_module=lambda: cuda_topk.module_for(torch.cuda.current_device()),
                   sgl=ix.load_sglang_topk)
    for p in peers:
        if phase(f"load {p}", loaders[p]) is None:
            raise SystemExit(f"peer {p} is not in this checkout (see benchmarks/indexer.py)")
    faulthandler.dump_traceback_later(limit, exit=True)
    B, L = 1, 4096
    config = DEFAULT_CONFIG.with_values(**{"scorer.cuda_narrow_rows": narrow})
    pad = torch.empty(pad_mb * 2**20, dtype=torch.uint8, device="cuda") if pad_mb else None
    inp = ix.Inputs(B, L, copies=12)
    logits = torch.empty(B, L, device="cuda")
    kind = "cuda"
    q, w, kc, table, lens = inp.args(0)
    free, total = torch.cuda.mem_get_info()
    print(f"  pad {pad_mb} MB at {pad.data_ptr() if pad is not None else 0:#x}; q {q.data_ptr():#x}, "
          f"w {w.data_ptr():#x}, k cache {kc.data_ptr():#x} {tuple(kc.shape)}, table {table.data_ptr():#x}, "
          f"lens {lens.data_ptr():#x}, logits {logits.data_ptr():#x}; splits "
          f"{ix.unfused_splits(B, L, config, kind)}; device memory used {(total - free) / 2**20:.0f} MB",
          flush=True)

    def call(i):
        return lambda: launch_score(*inp.args(i), None, logits, page_size=ix.PAGE, sel_width=L, fill_width=0,
                                    splits=ix.unfused_splits(B, L, config, kind), config=config.scorer,
                                    kind=kind)

    phase("first eager launch (compiles the scorer build)", call(0))
    phase("second eager launch", call(1))
    us = phase("graph capture and replays", lambda: ix.timeit(call, 12))
    print(f"  one-row scorer: {us:.2f} us a call", flush=True)
    faulthandler.cancel_dump_traceback_later()


def run_all(limit: float, json_path: str, probes=PROBES, pad_mb: int = 0) -> int:
    rows = []
    for peers, narrow, cache in probes:
        label = f"peers={peers or 'none'} narrow={narrow} cubin cache={cache}"
        print(f"== {label}", flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cache == "off":
            env["VLLM_SPARSE_SYNC_NVRTC_CACHE"] = "0"
        cmd = [sys.executable, os.path.abspath(__file__), "--probe", peers or "none", "--narrow", str(narrow),
               "--limit", str(limit), "--pad-mb", str(pad_mb)]
        t0 = time.perf_counter()
        try:  # the probe's own limit covers its launches; this one its loads and compiles too
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit + 180)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as exc:
            rc, text = "killed", (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
        secs = time.perf_counter() - t0
        finished = rc == 0 and "one-row scorer:" in text
        print(text.rstrip(), flush=True)
        print(f"== {label}: {'finished' if finished else 'STOPPED'} (rc {rc}, {secs:.0f} s)\n", flush=True)
        rows.append(dict(peers=peers, narrow=narrow, cache=cache, finished=finished, rc=str(rc),
                         seconds=round(secs, 1), tail=text[-3000:]))
        if json_path:
            json.dump(rows, open(json_path, "w"), indent=1)
    print("| peers | narrow | cubin cache | finished | s |\n| --- | ---: | --- | --- | ---: |")
    for r in rows:
        print(f"| {r['peers'] or 'none'} | {r['narrow']} | {r['cache']} | {r['finished']} | {r['seconds']} |")
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", default=None, help="run one probe here: peers, comma-separated, or 'none'")
    ap.add_argument("--narrow", type=int, default=1, help="scorer.cuda_narrow_rows of the probe")
    ap.add_argument("--limit", type=float, default=60.0, help="seconds a probe's launches may take")
    ap.add_argument("--json", default="")
    ap.add_argument("--probes", default="", help="instead of PROBES: 'PEERS:NARROW:CACHE ...', "
                                                 "e.g. 'all:1:on deepgemm+vllm:1:on'")
    ap.add_argument("--pad-mb", type=int, default=0, help="device memory allocated before the inputs")
    a = ap.parse_args()
    if a.limit <= 0:
        ap.error(f"--limit: must be > 0, got {a.limit}")
    peers = ()
    probes = PROBES
    if a.probes:
        try:
            probes = parse_probes(a.probes)
        except ValueError as exc:
            ap.error(str(exc))
    if a.probe is not None:
        try:
            peers = parse_peers("" if a.probe == "none" else a.probe)
        except ValueError as exc:
            ap.error(str(exc))
    import torch

    if not torch.cuda.is_available():
        print("error: benchmarks/peer_probe.py launches CUDA kernels and needs a CUDA device",
              file=sys.stderr)
        sys.exit(2)
    if a.probe is not None:
        probe(peers, a.narrow, a.limit, a.pad_mb)
        return
    sys.exit(run_all(a.limit, a.json, probes, a.pad_mb))


if __name__ == "__main__":
    main()
