"""The CUDA paged scorer for sm_90 (``scorer.cu``, wgmma), compiled at run time by NVRTC.

Same contract and grid as the Triton scorer (``triton.scorer.launch_score``): it scores what the
reference ``paged_indexer_logits`` does, the exact path (``KernelConfig.precise``: e4m3 -> f16,
fp32 sums) and the e4m3 tensor-core path alike. It takes calls the kernel is built for (``takes``:
64-token pages, head dim 128, 32 or 64 heads, 16-byte aligned pages) on a device of compute
capability 9.0 (the sm_90a code runs there only); the planner sends the rest to Triton. Compiled
on first use (the cubin kept on disk for later processes, ``nvrtc_cache``) and cached per device;
launched on torch's current stream, so it is captured when the stream captures. Call ``warmup``
(or one eager call) before capturing.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache
from pathlib import Path

import torch

from . import topk as cuda_topk

SOURCE_PATH = Path(__file__).with_name("scorer.cu")
ARCH = "sm_90a"
CAPABILITY = (9, 0)
PAGE = 64
HEAD_DIM = 128
HEADS = (32, 64)
STAGES_SHORT = 12
"""pages in flight per CTA (the source's ``STAGES_SHORT``): the ring of shared-memory slots every
call runs with by default"""
STAGES_DEEP = 24
"""the deep ring (the source's ``STAGES_DEEP``): a kernel of this many slots runs all of them in
a program of at least ``DEEP_TILES`` live tiles, else the first ``STAGES_SHORT``"""
DEEP_TILES: int | None = None
"""live tiles (the device length's, not the host bound's) from which a program of the deep-ring
kernel runs every slot; None: the short-ring kernel for every call, which measured as fast or
faster on every shape (docs/performance.md)"""
NEVER_DEEP = 2**31 - 1
"""the kernel's ``deep_tiles`` where no program is to run the deep ring"""
CONSUMERS = 4
"""consumer warpgroups per CTA (the source's ``CONSUMERS``), each scoring every CONSUMERS-th tile"""


def threads_for(consumers: int) -> int:
    """A CTA's threads: ``consumers`` warpgroups, then the producer warp that copies pages into
    the ring."""
    return consumers * 128 + 32


THREADS = threads_for(CONSUMERS)
"""the default build's threads"""
CTAS_PER_SM = 1
"""CTAs one SM holds (registers: 544 threads of 91 each take more than half of them; the deep
ring's shared memory, nearly all); ``planner.CUDA_SCORER_CTAS_PER_SM`` sizes the grid"""
SLOT_BYTES = PAGE * (HEAD_DIM + 4)


def source() -> str:
    """The kernel source, ``scorer.cu``."""
    return SOURCE_PATH.read_text()


def kernel_name(heads: int, precise: bool, stages: int = STAGES_SHORT) -> str:
    if heads not in HEADS:
        raise ValueError(f"cuda scorer: heads must be one of {HEADS}, got {heads!r}")
    if stages not in (STAGES_DEEP, STAGES_SHORT):
        raise ValueError(f"cuda scorer: stages must be {STAGES_DEEP} or {STAGES_SHORT}, got {stages!r}")
    return f"score_h{heads}_p{int(bool(precise))}_s{stages}"


def ring() -> tuple[int, int]:
    """(the kernel's slots, its ``deep_tiles``) for every launch: the deep-ring kernel choosing
    per program from ``DEEP_TILES``, or the short-ring kernel where that is None. Host constants
    only: no launch depends on the call's bound."""
    if DEEP_TILES is None:
        return STAGES_SHORT, NEVER_DEEP
    if isinstance(DEEP_TILES, bool) or not isinstance(DEEP_TILES, int) or not 0 <= DEEP_TILES <= NEVER_DEEP:
        raise ValueError(f"cuda_scorer.DEEP_TILES: must be None or an int in [0, 2**31 - 1], "
                         f"got {DEEP_TILES!r}")
    return STAGES_DEEP, DEEP_TILES


def smem_bytes(heads: int, precise: bool, stages: int = STAGES_SHORT) -> int:
    """Dynamic shared memory of one CTA: the query as the wgmma B operand, the page ring, its
    full and empty barriers, the slots' validity flags and the row's head weights."""
    qbytes = heads * HEAD_DIM * (2 if precise else 1)
    return qbytes + stages * SLOT_BYTES + stages * (8 + 8 + 4) + heads * 4


@cache
def status(index: int) -> tuple[bool, str]:
    """Whether the CUDA scorer can run on CUDA device ``index``, and why not."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    cap = torch.cuda.get_device_capability(index)
    if cap != CAPABILITY:
        return False, f"compute capability {cap}: the wgmma scorer is built for {CAPABILITY} (sm_90a)"
    return cuda_topk.compiler_status()


def takes(q_fp8: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, page_size: int,
          splits: int) -> bool:
    """Whether the kernel is built for this call's tensors (checked host metadata only)."""
    rows, heads, head_dim = q_fp8.shape
    return (
        page_size == PAGE and head_dim == HEAD_DIM and heads in HEADS and q_fp8.is_contiguous()
        and k_cache.dim() == 2 and k_cache.shape[1] == SLOT_BYTES and k_cache.stride(1) == 1
        and k_cache.stride(0) % 16 == 0 and k_cache.data_ptr() % 16 == 0
        and block_table.dtype in (torch.int32, torch.int64) and block_table.stride(1) == 1
        and 0 < rows < 2**31 and 0 < splits <= 65535 and k_cache.shape[0] < 2**31
    )


def build_cubin(defines: tuple[tuple[str, int], ...] = (), environ=None) -> tuple[bytes, str]:
    """``(cubin, origin)`` of the build with ``defines`` (``cuda_topk.module_cubin``: from the
    on-disk cache, else compiled by NVRTC and stored); needs no GPU."""
    text = "".join(f"#define {k} {int(v)}\n" for k, v in defines) + source()
    return cuda_topk.module_cubin(ARCH, text=text, name="scorer.cu", environ=environ)


class _Module:
    """The compiled scorer of one device (``defines``: macros defined before the source, as the
    tests' ``RING_STRESS_NS``)."""

    def __init__(self, index: int, defines: tuple[tuple[str, int], ...] = ()) -> None:
        driver, _ = cuda_topk._bindings()
        self.driver = driver
        _check = cuda_topk._check
        _check(driver.cuInit(0), "cuInit")
        cu_dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        self.ctx = _check(driver.cuDevicePrimaryCtxRetain(cu_dev), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.threads = threads_for(dict(defines).get("CONSUMERS", CONSUMERS))
        cubin, self.origin = build_cubin(defines)
        self.module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.functions: dict[str, object] = {}
        self.pdl_attribute = cuda_topk.pdl_launch_attribute(driver)  # KernelConfig.pdl's launches

    def function(self, heads: int, precise: bool, stages: int = STAGES_SHORT):
        name = kernel_name(heads, precise, stages)
        fn = self.functions.get(name)
        if fn is None:
            _check = cuda_topk._check
            fn = _check(self.driver.cuModuleGetFunction(self.module, name.encode()),
                        f"cuModuleGetFunction({name})")
            attr = self.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(self.driver.cuFuncSetAttribute(fn, attr, smem_bytes(heads, precise, stages)),
                   "cuFuncSetAttribute(max dynamic smem)")
            self.functions[name] = fn
        return fn


_MODULES: dict[tuple, _Module] = {}
_LOCK = threading.Lock()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def module_for(index: int, defines: tuple[tuple[str, int], ...] = ()) -> _Module:
    """The scorer compiled for device ``index`` (with ``defines``), compiled on first use."""
    key = (index, tuple(defines))
    mod = _MODULES.get(key)
    if mod is None:
        with _LOCK:
            mod = _MODULES.get(key)
            if mod is None:
                ok, why = status(index)
                if not ok:
                    raise RuntimeError(f"cuda scorer unavailable: {why}")
                mod = _Module(index, tuple(defines))
                _MODULES[key] = mod
    return mod


def warmup(device: torch.device | str = "cuda") -> None:
    """Compile, load and fetch every kernel outside capture."""
    mod = module_for(_index(torch.device(device)))
    for heads in HEADS:
        for precise in (True, False):
            for stages in (STAGES_DEEP, STAGES_SHORT):
                mod.function(heads, precise, stages)


def launch_cuda_score(
    q_fp8, weights, k_cache, block_table, row_lens, active, out, *, page_size, sel_width, fill_width,
    splits, precise: bool = True, pdl: bool = True, module: _Module | None = None,
) -> None:
    """The scorer's launch on a call ``takes`` accepts; arguments as ``triton.scorer.launch_score``
    (``precise``: exact or e4m3 scores; ``pdl``: a programmatic dependent launch that also lets the
    next kernel launch early; ``module``: a ``module_for`` build, default the device's)."""
    rows, heads, _ = q_fp8.shape
    mod = module if module is not None else module_for(_index(q_fp8.device))
    stages, deep_tiles = ring()
    fn = mod.function(heads, precise, stages)
    values = score_values(q_fp8, weights, k_cache, block_table, row_lens, active, out, page_size=page_size,
                          sel_width=sel_width, fill_width=fill_width, launch_dependents=pdl,
                          deep_tiles=deep_tiles)
    smem = smem_bytes(heads, precise, stages)
    cuda_topk.launch_values(mod, fn, (rows, splits, 1), mod.threads, smem, values, q_fp8.device, pdl=pdl)


def score_values(q_fp8, weights, k_cache, block_table, row_lens, active, out, *, page_size, sel_width,
                 fill_width, launch_dependents: bool = True, deep_tiles: int = NEVER_DEEP) -> tuple:
    """The kernel's parameters (ctypes values) for a call ``takes`` accepts (``deep_tiles``: live
    tiles from which a program of the deep-ring kernel runs all its slots)."""
    for name, t in (("row_lens", row_lens), ("active_width", active)):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cuda scorer: {name} must be int32 or int64, got {t.dtype}")
    return (
        ctypes.c_void_p(q_fp8.data_ptr()),
        ctypes.c_void_p(weights.data_ptr()),
        ctypes.c_void_p(k_cache.data_ptr()),
        ctypes.c_void_p(block_table.data_ptr()),
        ctypes.c_int(int(block_table.dtype == torch.int64)),
        ctypes.c_longlong(block_table.stride(0)),
        ctypes.c_void_p(row_lens.data_ptr()),
        ctypes.c_int(int(row_lens.dtype == torch.int64)),
        ctypes.c_void_p(active.data_ptr() if active is not None else 0),
        ctypes.c_int(int(active is not None and active.dtype == torch.int64)),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_longlong(out.stride(0)),
        ctypes.c_int(k_cache.shape[0]),
        ctypes.c_longlong(k_cache.stride(0)),
        ctypes.c_int(sel_width),
        ctypes.c_int(block_table.shape[1] * page_size),
        ctypes.c_int(fill_width),
        ctypes.c_int(int(launch_dependents)),
        ctypes.c_int(deep_tiles),
    )
