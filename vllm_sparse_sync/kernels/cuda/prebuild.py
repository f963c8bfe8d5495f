"""Compile the CUDA modules into the NVRTC cubin cache ahead of time (``vllm-sparse-sync prebuild``),
on any host with NVRTC, GPU or not: an image built this way starts serving without the compile."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from . import scorer as cuda_scorer
from . import topk as cuda_topk
from . import nvrtc_cache


@dataclass(frozen=True)
class Build:
    """One module the device of ``arch`` compiles on first use."""

    label: str
    make: Callable[[Mapping[str, str] | None], tuple[bytes, str]]  # environ -> (cubin, origin)


def parse_arch(text: str) -> tuple[int, int]:
    """``"sm_90"`` (or ``"sm_90a"``) -> ``(9, 0)``; a ValueError for anything else or an arch the
    top-k does not serve."""
    m = re.fullmatch(r"sm_(\d+)(\d)a?", text.strip())
    if not m:
        raise ValueError(f"{text!r} is not an arch like sm_90 (compute capability 9.0)")
    cap = (int(m.group(1)), int(m.group(2)))
    if cap < cuda_topk.MIN_CAPABILITY:
        need = ".".join(map(str, cuda_topk.MIN_CAPABILITY))
        raise ValueError(f"{text}: the CUDA kernels need compute capability {need} or newer")
    return cap


def builds_for(capability: tuple[int, int]) -> list[Build]:
    """The modules a device of ``capability`` compiles: the top-k for its arch (and from 9.0 its
    slots module) and, on 9.0, the scorer (sm_90a)."""
    arch = f"sm_{capability[0]}{capability[1]}"
    out = [Build(f"CUDA top-k ({arch})", lambda env: cuda_topk.module_cubin(arch, environ=env))]
    if capability >= cuda_topk.CLUSTER_MIN_CAPABILITY:
        out.append(Build(f"CUDA top-k slots ({arch})", lambda env: cuda_topk.module_cubin(
            arch, extra_options=cuda_topk.SLOTS_OPTIONS, environ=env)))
    if capability == cuda_scorer.CAPABILITY:
        out.append(Build(f"CUDA scorer ({cuda_scorer.ARCH})", lambda env: cuda_scorer.build_cubin(environ=env)))
    return out


def prebuild(capability: tuple[int, int], environ: Mapping[str, str] | None = None,
             progress: Callable[[str], None] = print) -> list[dict]:
    """Compile (or find) every module of ``builds_for(capability)`` in the cache ``environ`` names;
    one progress line a module. Raises RuntimeError when NVRTC is missing or the cache is off."""
    ok, why = cuda_topk.compiler_status()
    if not ok:
        raise RuntimeError(f"cannot compile here: {why}")
    folder = nvrtc_cache.cache_dir(environ)
    if folder is None:
        raise RuntimeError(f"the NVRTC cubin cache is off ({nvrtc_cache.SWITCH_ENV}=0): "
                           "nothing would be kept")
    if not cuda_topk.compiles_for(capability):
        raise RuntimeError(f"{why} does not compile for sm_{capability[0]}{capability[1]}")
    progress(f"cubin cache: {folder} ({why})")
    rows = []
    for b in builds_for(capability):
        progress(f"{b.label}: ...")
        t0 = time.perf_counter()
        cubin, origin = b.make(environ)
        secs = time.perf_counter() - t0
        progress(f"{b.label}: {'already cached' if origin == 'cache' else 'compiled'} "
                 f"({len(cubin) / 1024:.0f} KiB, {secs:.1f} s)")
        rows.append(dict(module=b.label, origin=origin, bytes=len(cubin), seconds=round(secs, 2)))
    return rows
