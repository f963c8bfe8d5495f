"""The CUDA top-k route (``cuda_radix``): ``topk.cu`` compiled at run time by NVRTC.

Two kernels, one output: ``launch_cuda_topk`` (one CTA per row, any CUDA GPU from sm_70) and,
on sm_90+, ``launch_cuda_topk_cluster`` (a thread-block cluster of 1-16 CTAs per row holding the
row's keys in shared memory and summing histograms over distributed shared memory; sized by
the pure ``plan_cluster``). Both write the positions ``topk_emu.topk_row`` specifies.

Compiled on first use and cached per (device index, arch), the cubin on disk too for later
processes (``nvrtc_cache``: a cold process otherwise spends tens of seconds in NVRTC); launched
with ``cuLaunchKernel`` on torch's current stream, so a call made while a torch CUDA graph
captures is captured. No host sync, no allocation per call (the kernel needs no global scratch:
its histograms and candidate list live in shared memory). Call ``warmup(device)`` (or make one
eager call) before capturing: compiling and loading the module are not stream work.

It uses ``cuda.bindings`` (``nvrtc`` and ``driver``), the layer ``cuda.core`` and CuPy sit on:
``cuda.core``'s compile step queries the driver (so it cannot compile on a host without one, as
the CPU test does) and its public names moved between ``cuda.core.experimental`` and
``cuda.core`` across releases; ``cuda.bindings`` has kept these calls since CUDA 12.0.
``status()`` says why the route is unavailable when it is (no CUDA, an old GPU, no
``cuda-bindings``, no NVRTC library); the planner then falls back to the Triton top-k.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from ..reference import MAX_PAGE_BITS, check_page_table, check_unmapped

SOURCE_PATH = Path(__file__).with_name("topk.cu")
# (threads, float4 vectors per thread and tile) compiled in topk.cu
VARIANTS = ((1024, 4), (1024, 2), (512, 4), (512, 8))
MIN_CAPABILITY = (7, 0)
_STATIC_SMEM_LIMIT = 48 * 1024
HIST_BINS = 2048
# the cluster route (sm_90+): CTAs per row compiled in topk.cu, threads per CTA
CLUSTER_SIZES = (1, 2, 4, 8, 16)
CLUSTER_THREADS = (1024, 512)
CLUSTER_MIN_CAPABILITY = (9, 0)
SLOTS_OPTIONS = ("-DTOPK_SLOTS_MODULE=1",)
"""the NVRTC options of the slots module: the cluster kernels' entries that write KV-cache slots
through a page table, compiled on a page table's first use (the library's module stays as fast to
compile as without them)"""
PORTABLE_CLUSTER = 8
"""the largest cluster every sm_90+ device launches; 16 needs the non-portable opt-in and a device
that can hold 16 such CTAs in one GPC (``_Module.cluster16``)"""
WIDE_CLUSTER_MIN_KEYS = 8 * 8192
"""a bound above this many keys (more than 8192 keys per CTA of 8) takes 16 CTAs a row where the
rows fit (``plan_cluster``), which split only a row of more than this many live keys (a shorter
one runs on the first 8: ``topk_emu.split_ctas``): the measurements are in docs/performance.md"""
STATIC_SMEM_RESERVE = 1536
"""bytes of the opt-in shared memory left to a cluster kernel's static share"""


def source() -> str:
    """The kernel source, ``topk.cu``."""
    return SOURCE_PATH.read_text()


def kernel_name(threads: int, vec: int, aligned: bool) -> str:
    if (threads, vec) not in VARIANTS:
        raise ValueError(f"cuda top-k: (threads, vec) must be one of {VARIANTS}, got {(threads, vec)}")
    return f"topk_radix_t{threads}_v{vec}_a{int(bool(aligned))}"


def cluster_kernel_name(cluster: int, aligned: bool, threads: int = 1024, slots: bool = False) -> str:
    """The cluster kernel's entry; ``slots``: the one that writes slots through a page table."""
    if cluster not in CLUSTER_SIZES:
        raise ValueError(f"cuda top-k: cluster size must be one of {CLUSTER_SIZES}, got {cluster!r}")
    if threads not in CLUSTER_THREADS:
        raise ValueError(f"cuda top-k: cluster threads must be one of {CLUSTER_THREADS}, got {threads!r}")
    return f"topk_cluster_c{cluster}_t{threads}_a{int(bool(aligned))}{'_slots' if slots else ''}"


def cluster_chunk_cap(sel_width: int, cluster: int) -> int:
    """Keys one CTA of a ``cluster``-CTA row owns in the longest row ``sel_width`` allows: the
    device's chunk, ``ceil(sel_width / cluster)`` rounded up to 4."""
    return max(4, (-(-sel_width // cluster) + 3) & ~3)


RANGE_PAD = 4
"""words after each thread's range of keys in a cluster-route CTA (``topk_emu.RANGE_PAD``)"""


CLUSTER_PASS_WORDS = 2 * HIST_BINS + 1024
"""the counts of a cluster CTA's three passes, local and totals alike (``PASS_WORDS`` in the source)"""
SOLO_PASS_WORDS = 4096 + 2 * HIST_BINS
"""the counts of a one-CTA row's passes: 4096 bins of pass A, two refine passes (``SOLO_WORDS``)"""


def cluster_smem_bytes(cap: int, cluster: int, threads: int = 1024) -> int:
    """Dynamic shared memory of one cluster-route CTA of ``threads`` threads holding ``cap`` keys:
    the counts of the passes (for ``cluster > 1`` local counts and the cluster's totals), and the
    keys with a pad after each thread's range."""
    passes = SOLO_PASS_WORDS if cluster == 1 else 2 * CLUSTER_PASS_WORDS
    return 4 * (passes + cap + RANGE_PAD * threads)


SOLO_MAX = 16384
"""a row of at most this many live keys runs on one CTA (``topk_emu.SOLO_MAX``): the planner
takes one CTA per row for such a bound, and a cluster's first CTA takes such a row alone"""


def _keys_fitting(smem: int, cluster: int, threads: int) -> int:
    return max(0, (smem // 4 - (cluster_smem_bytes(0, cluster, threads) // 4)) & ~3)


@dataclass(frozen=True)
class ClusterPlan:
    cluster: int
    """CTAs per row"""
    cap: int
    """keys each CTA keeps in shared memory (a longer chunk reads the rest from global memory)"""
    smem: int
    """dynamic shared memory bytes per CTA"""
    threads: int = 1024


SMALL_ROW_KEYS = 4 * 4 * 512
"""the longest row 512 threads hold in registers (``4 * CLUSTER_UNROLL * 512``): a one-CTA plan for
a bound of at most this many keys launches 512 threads per CTA (``plan_cluster``)"""


def plan_cluster(rows: int, sel_width: int, sm_count: int, smem_optin: int,
                 cluster: int | None = None, threads: int | None = None) -> ClusterPlan | None:
    """The cluster route's launch for ``rows`` rows of at most ``sel_width`` live keys (pure host
    logic), or None where it cannot take them (no rows, more than 65535 rows, no shared memory).

    CTAs per row (unless forced by ``cluster``): the largest size whose ``rows x size`` CTAs fit
    one wave, counted as the SMs for clusters of 1 or 2 and half the SMs for 4, 8 or 16 (larger
    clusters pack less densely into the GPU's processing clusters), 16 only for a bound above
    ``WIDE_CLUSTER_MIN_KEYS``; 1 past that, and 1 for a bound of at most ``SOLO_MAX`` keys (a
    wider bound's cluster runs such rows on its first CTA, whose capacity covers them). A device
    that cannot launch 16 runs such a plan with 8 (``launch_cuda_topk_cluster``). Keys per CTA:
    the chunk of ``sel_width``, at most what fits the shared memory of one CTA per SM. Threads per
    CTA (unless forced by ``threads``): 512 for one CTA per row and a bound of at most
    ``SMALL_ROW_KEYS`` (the row fits their registers, and fewer warps finish it sooner), else 1024.
    The size, capacity and threads follow the rows and the host bound, never live lengths: the
    device splits each row by its live length.
    """
    if rows < 1 or rows > 65535 or sm_count < 1:
        return None
    if cluster is None:
        fits = [c for c in CLUSTER_SIZES if rows * c <= (sm_count if c <= 2 else sm_count // 2)
                and (c <= PORTABLE_CLUSTER or sel_width > WIDE_CLUSTER_MIN_KEYS)]
        cluster = fits[-1] if fits and sel_width > SOLO_MAX else 1
    elif cluster not in CLUSTER_SIZES:
        raise ValueError(f"cuda top-k: cluster size must be one of {CLUSTER_SIZES}, got {cluster!r}")
    if threads is None:
        threads = 512 if cluster == 1 and sel_width <= SMALL_ROW_KEYS else 1024
    if threads not in CLUSTER_THREADS:
        raise ValueError(f"cuda top-k: cluster threads must be one of {CLUSTER_THREADS}, got {threads!r}")
    per_sm = 1 if rows * cluster <= sm_count else 1024 // threads  # what the registers allow
    chunk = cluster_chunk_cap(sel_width, cluster)
    if cluster > PORTABLE_CLUSTER:  # its first CTA still takes a short row whole (as 8 CTAs' would)
        chunk = max(chunk, SOLO_MAX)
    cap = min(chunk, _keys_fitting(smem_optin // per_sm, cluster, threads))
    if cap < 4:
        return None
    return ClusterPlan(cluster, cap, cluster_smem_bytes(cap, cluster, threads), threads)


def launch_smem(plan: ClusterPlan, rows: int, sm_count: int, smem_per_sm: int, smem_optin: int,
                pdl: bool) -> int:
    """Dynamic shared memory a cluster-route launch of ``plan`` asks for (pure host logic): for a
    programmatic dependent launch of one wave (``rows x cluster`` CTAs on ``sm_count`` SMs), enough
    that an SM holds one CTA (at most the opt-in ``smem_optin``), so the CTAs launched early wait
    one an SM on the SMs the previous kernel leaves idle instead of packing there (several on one
    SM run slower once released: 128 rows of 8K, docs/performance.md); the plan's
    otherwise."""
    if not pdl or rows * plan.cluster > sm_count:
        return plan.smem
    lone = smem_per_sm // 2 - STATIC_SMEM_RESERVE + 1  # two CTAs with their reserve no longer fit
    return max(plan.smem, min(lone, smem_optin))


def _bindings():
    """``(driver, nvrtc)`` from cuda-bindings (>= 12: ``cuda.bindings``; older: ``cuda``)."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        from cuda import cuda as driver  # type: ignore[no-redef]
        from cuda import nvrtc  # type: ignore[no-redef]
    return driver, nvrtc


@cache
def compiler_status() -> tuple[bool, str]:
    """Whether NVRTC can be used here (no GPU needed), and why not."""
    try:
        _, nvrtc = _bindings()
    except ImportError as exc:
        return False, f"cuda-bindings is not installed ({exc}); pip install 'vllm-sparse-sync[cuda]'"
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the NVRTC shared library is missing or broken
        return False, f"NVRTC could not be loaded ({type(exc).__name__}: {exc})"
    if int(err) != 0:
        return False, f"nvrtcVersion failed ({err})"
    return True, f"NVRTC {major}.{minor}"


def status(device: torch.device | str | int | None = None) -> tuple[bool, str]:
    """Whether the CUDA top-k can run on ``device`` (a CUDA device), and the reason if not."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return False, f"device {dev} is not a CUDA device"
    cap = torch.cuda.get_device_capability(dev)
    if cap < MIN_CAPABILITY:
        return False, f"compute capability {cap} < {MIN_CAPABILITY}"
    ok, why = compiler_status()
    if ok and not compiles_for(cap):
        return False, f"{why} does not compile for sm_{cap[0]}{cap[1]}"
    return ok, why


@cache
def supported_archs() -> tuple[int, ...]:
    """The archs this NVRTC compiles for, as ``major * 10 + minor`` (e.g. 75, 80, 90)."""
    _, nvrtc = _bindings()
    return tuple(int(a) for a in _check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def compiles_for(capability: tuple[int, int]) -> bool:
    """Whether this NVRTC compiles for a device of ``capability`` (newer NVRTCs drop old archs)."""
    return capability[0] * 10 + capability[1] in supported_archs()


@cache
def cluster_smem_limit(index: int) -> int:
    """Dynamic shared memory bytes a cluster-route CTA may use on CUDA device ``index`` (the
    opt-in limit less the kernel's static share), or 0 where the route cannot run (before sm_90,
    or the CUDA top-k unavailable). Queries the driver; compiles nothing."""
    ok, _ = status(torch.device("cuda", index))
    if not ok or torch.cuda.get_device_capability(index) < CLUSTER_MIN_CAPABILITY:
        return 0
    driver, _ = _bindings()
    _check(driver.cuInit(0), "cuInit")
    cu_dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    optin = int(_check(driver.cuDeviceGetAttribute(attr, cu_dev), "cuDeviceGetAttribute"))
    return optin - STATIC_SMEM_RESERVE


@cache
def smem_per_sm(index: int) -> int:
    """Shared memory bytes of one SM of CUDA device ``index`` (a driver query)."""
    driver, _ = _bindings()
    _check(driver.cuInit(0), "cuInit")
    cu_dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    return int(_check(driver.cuDeviceGetAttribute(attr, cu_dev), "cuDeviceGetAttribute"))


class CompileError(RuntimeError):
    pass


def _check(result, what: str):
    """Unwrap a cuda-bindings ``(err, *values)`` result; raise on an error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"cuda top-k: {what} failed: {err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def compile_source(
    arch: str, *, output: str = "cubin", extra_options: tuple[str, ...] = (), text: str | None = None,
    name: str = "topk.cu",
) -> tuple[bytes, str]:
    """NVRTC-compile ``topk.cu`` (or ``text``, called ``name`` in messages) for ``arch``
    (e.g. ``"sm_90"``, ``"sm_90a"``): ``(ptx or cubin bytes, log)``.

    Needs no GPU. ``output="ptx"`` compiles for the virtual ``compute_XX`` arch.
    """
    _, nvrtc = _bindings()
    if output not in ("ptx", "cubin"):
        raise ValueError(f"output: 'ptx' or 'cubin', got {output!r}")
    num = arch.split("_", 1)[1]
    target = f"compute_{num}" if output == "ptx" else f"sm_{num}"
    prog = _check(
        nvrtc.nvrtcCreateProgram((source() if text is None else text).encode(), name.encode(),
                                 0, [], []),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={target}".encode(), b"-std=c++17", *(o.encode() for o in extra_options)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.decode(errors="replace").rstrip("\x00 \n")
        if int(err) != 0:
            raise CompileError(f"NVRTC failed to compile {name} for {arch}:\n{log_text}")
        if output == "ptx":
            size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            buf = b" " * size
            _check(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        else:
            size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            buf = b" " * size
            _check(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return buf, log_text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compiler_identity() -> str:
    """What the key of a cached cubin records of the compiler: NVRTC's version (the bindings that
    call it compile nothing)."""
    _, nvrtc = _bindings()
    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"NVRTC {major}.{minor}"


def module_cubin(arch: str, *, text: str | None = None, name: str = "topk.cu",
                 extra_options: tuple[str, ...] = (), environ=None) -> tuple[bytes, str]:
    """``(cubin, origin)`` for a module to load: from the on-disk cache (``nvrtc_cache``; its
    folder from ``environ``, default the process's) when it holds this source compiled by this
    compiler, else compiled by ``compile_source`` and stored."""
    from . import nvrtc_cache

    body = source() if text is None else text
    return nvrtc_cache.cached(
        lambda: compile_source(arch, text=body, name=name, extra_options=extra_options)[0],
        text=body, name=name, target=arch, options=extra_options, compiler=compiler_identity(),
        environ=environ)


MODULE_OPTIONS = {"positions": (), "slots": SLOTS_OPTIONS}
"""each module of the source by its kind: the library's (the positions entries and the rest), the
slots entries'"""


class _Module:
    """The compiled module of one device (``kind``: a ``MODULE_OPTIONS`` key): its context and
    kernel handles."""

    def __init__(self, index: int, kind: str = "positions") -> None:
        driver, _ = _bindings()
        self.driver = driver
        self.index = index
        major, minor = torch.cuda.get_device_capability(index)
        self.arch = f"sm_{major}{minor}"
        _check(driver.cuInit(0), "cuInit")
        cu_dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        # torch's runtime uses the device's primary context: the same one
        self.ctx = _check(driver.cuDevicePrimaryCtxRetain(cu_dev), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.kind = kind
        self.slots = kind == "slots"
        cubin, self.origin = module_cubin(self.arch, extra_options=MODULE_OPTIONS[kind])
        self.module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.functions: dict[str, object] = {}
        self.smem_set: dict[str, int] = {}
        self.sm_count = torch.cuda.get_device_properties(index).multi_processor_count
        self.smem_optin = cluster_smem_limit(index)
        self.smem_per_sm = smem_per_sm(index)
        self.cluster_ok = self.smem_optin > 0
        self.cluster16 = self.cluster_ok and self._can_launch_cluster16()
        self.pdl_attribute = pdl_launch_attribute(driver)

    def _can_launch_cluster16(self) -> bool:
        """Whether 16-CTA clusters of the widest plan (1024 threads, all the opt-in shared memory)
        can be resident at once on this device (the non-portable size; not on every GPC layout)."""
        try:
            fn = self.function(cluster_kernel_name(16, True, slots=self.slots), self.smem_optin)
            config = self.driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = 16, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = 1024, 1, 1
            config.sharedMemBytes = self.smem_optin
            err, clusters = self.driver.cuOccupancyMaxActiveClusters(fn, config)
            return int(err) == 0 and clusters >= 1
        except Exception:  # a driver without the query or the opt-in: the portable sizes only
            return False

    def function(self, name: str, smem: int):
        fn = self.functions.get(name)
        if fn is None:
            fn = _check(
                self.driver.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})"
            )
            allow_cluster_size(self.driver, fn, name)
            self.functions[name] = fn
        # past 48 KB less the kernel's static share (at most STATIC_SMEM_RESERVE) the launch needs the opt-in
        if smem > _STATIC_SMEM_LIMIT - STATIC_SMEM_RESERVE and self.smem_set.get(name, 0) < smem:
            attr = self.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(self.driver.cuFuncSetAttribute(fn, attr, smem), "cuFuncSetAttribute(max dynamic smem)")
            self.smem_set[name] = smem
        return fn


def pdl_launch_attribute(driver):
    """The launch attribute that makes a launch a programmatic dependent one (``launch_values``'s
    ``pdl``): it may start before the stream's previous kernel completes."""
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return attr


def allow_cluster_size(driver, fn, name: str) -> None:
    """Let kernel ``name`` (``fn``) launch its cluster size: a 16-CTA kernel needs the non-portable
    size allowed before its first launch."""
    if name.startswith("topk_cluster_c16_"):
        allow = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        _check(driver.cuFuncSetAttribute(fn, allow, 1), "cuFuncSetAttribute(non-portable)")


def load_cluster_function(driver, module, name: str, smem: int):
    """Kernel ``name`` of a loaded experiment ``module`` (a benchmark tool's copy of the source),
    ready to launch a cluster with ``smem`` bytes of dynamic shared memory."""
    fn = _check(driver.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
    allow_cluster_size(driver, fn, name)
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check(driver.cuFuncSetAttribute(fn, attr, smem), "cuFuncSetAttribute(max dynamic smem)")
    return fn


_MODULES: dict[tuple[int, str], _Module] = {}
_LOCK = threading.Lock()


def module_for(device: torch.device | str | int, slots: bool = False) -> _Module:
    """The compiled module of a CUDA device (compiles and loads on first use); ``slots``: the
    slots module (``SLOTS_OPTIONS``)."""
    index = torch.device(device).index if not isinstance(device, int) else device
    if index is None:
        index = torch.cuda.current_device()
    kind = "slots" if slots else "positions"
    key = (index, kind)
    mod = _MODULES.get(key)
    if mod is None:
        with _LOCK:
            mod = _MODULES.get(key)
            if mod is None:
                ok, why = status(torch.device("cuda", index))
                if not ok:
                    raise RuntimeError(f"cuda top-k unavailable: {why}")
                mod = _Module(index, kind)
                _MODULES[key] = mod
    return mod


def warmup(
    device: torch.device | str | int = "cuda", threads: int = 1024, vec: int = 4, cap: int = 8192
) -> None:
    """Compile, load and fetch the kernels outside capture."""
    mod = module_for(device)
    smem = smem_bytes(cap)
    for aligned in (True, False):
        mod.function(kernel_name(threads, vec, aligned), smem)


def smem_bytes(cap: int) -> int:
    """Dynamic shared memory of one CTA: the 2048-bin histogram and ``cap`` candidate keys."""
    return 4 * (HIST_BINS + cap)


def _check_launch_args(x, row_lens, active, out, k, sel_width) -> int:
    """Shared argument checks; the device index of ``x``."""
    if not (0 <= sel_width < 2**31) or not (0 < k < 2**31):
        raise ValueError(f"cuda top-k: sel_width {sel_width} and k {k} must fit int32")
    if (
        row_lens.device != x.device
        or out.device != x.device
        or (active is not None and active.device != x.device)
    ):
        raise ValueError("cuda top-k: logits, row_lens, active_width and out must share one device")
    if row_lens.dim() != 1 or (row_lens.numel() > 1 and row_lens.stride(0) != 1):
        raise ValueError("cuda top-k: row_lens must be 1-D and contiguous")
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


def _int_dtype_flag(t: torch.Tensor, name: str) -> int:
    if t.dtype == torch.int64:
        return 1
    if t.dtype == torch.int32:
        return 0
    raise ValueError(f"{name}: must be int32 or int64 for the CUDA top-k, got {t.dtype}")


def launch_cuda_topk(
    x: torch.Tensor,
    stride_r: int,
    row_lens: torch.Tensor,
    active: torch.Tensor | None,
    out: torch.Tensor,
    k: int,
    sel_width: int,
    *,
    nan_low: bool = True,
    threads: int = 1024,
    vec: int = 4,
    cap: int = 8192,
) -> None:
    """One CTA per row of ``out``: the top-``k`` positions of ``x[r, :len_r]`` into ``out[r]``.

    ``len_r = min(row_lens[r], sel_width, active[0])`` is read on the device. Host work: pointer
    and stride arithmetic and one driver launch on torch's current stream.
    """
    rows = out.shape[0]
    if rows == 0:
        return
    mod = module_for(_check_launch_args(x, row_lens, active, out, k, sel_width))
    aligned = x.data_ptr() % 16 == 0 and stride_r % 4 == 0
    smem = smem_bytes(cap)
    fn = mod.function(kernel_name(threads, vec, aligned), smem)
    _launch(mod, fn, (rows, 1, 1), threads, smem, x, stride_r, row_lens, active, out, k, sel_width,
            nan_low, (ctypes.c_int(cap),))


def cluster_plan_for(x: torch.Tensor, rows: int, sel_width: int, cluster: int | None = None,
                     ) -> ClusterPlan | None:
    """What ``launch_cuda_topk_cluster`` would launch on ``x``'s device (None: it cannot)."""
    mod = module_for(x.device.index if x.device.index is not None else torch.cuda.current_device())
    if not mod.cluster_ok:
        return None
    return plan_cluster(rows, sel_width, mod.sm_count, mod.smem_optin, cluster=cluster)


def launch_cuda_topk_cluster(
    x: torch.Tensor,
    stride_r: int,
    row_lens: torch.Tensor,
    active: torch.Tensor | None,
    out: torch.Tensor,
    k: int,
    sel_width: int,
    *,
    nan_low: bool = True,
    plan: ClusterPlan | None = None,
    smem: int | None = None,
    cluster: int | None = None,
    cap: int | None = None,
    threads: int | None = None,
    pdl: bool = True,
    lens_early: bool = False,
    page_table: torch.Tensor | None = None,
    page_bits: int = 0,
    unmapped: torch.Tensor | None = None,
) -> ClusterPlan:
    """A cluster of CTAs per row: the output of ``launch_cuda_topk``, element for element.

    ``plan`` and ``smem``: the planner's launch (``planner.plan_route``), taken as is. Without
    them the launch is planned here (``plan_cluster``; ``cluster`` forces the CTAs a row, ``cap``
    the keys kept in shared memory, a multiple of 4 at most the plan's, ``threads`` the CTAs'
    threads, 512 or 1024). ``pdl``: a programmatic dependent launch, whose shared-memory setup
    overlaps the end of the stream's previous kernel (the scorer, in a step); the kernel reads
    nothing global before that kernel has completed, except with ``lens_early``: ``row_lens`` and
    ``active`` are read before, so only where the stream's previous kernel does not write them and
    lets this one launch only once every write of them has completed (a step's scorer).
    ``page_table`` (int32 ``[>= rows, pages]``, contiguous rows; pages of ``2 ** page_bits``
    slots): the output holds each position's KV-cache slot (``reference.page_table_slots``),
    written by the same launch; each selected position written as ``-1`` (no slot) adds one to
    ``unmapped`` (int32 ``[1]``, optional). Returns the plan launched.

    ``x`` must hold at least ``sel_width`` columns: the kernel may read any of them before it
    knows a row's live length (a ``ValueError`` names the shape otherwise).

    Raises ``ValueError`` where the route cannot take the call (before sm_90, more than 65535
    rows).
    """
    rows = out.shape[0]
    if x.dim() != 2 or x.shape[1] < sel_width:
        raise ValueError(f"cuda top-k: logits must be 2-D with at least sel_width={sel_width} columns "
                         f"(the cluster route may read them all), got shape {tuple(x.shape)}")
    if page_table is not None:  # (before anything compiles)
        if not 0 <= page_bits <= MAX_PAGE_BITS:
            raise ValueError(f"page_bits: must be in [0, {MAX_PAGE_BITS}], got {page_bits}")
        check_page_table(page_table, 1 << page_bits, rows, x.device)
        check_unmapped(unmapped, x.device)
    elif unmapped is not None:
        raise ValueError("unmapped: counts positions without a slot; pass it with a page_table")
    mod = module_for(_check_launch_args(x, row_lens, active, out, k, sel_width), slots=page_table is not None)
    if not mod.cluster_ok:
        raise ValueError(
            f"cuda top-k: the cluster route needs compute capability >= {CLUSTER_MIN_CAPABILITY}")
    if plan is None:
        plan = _plan_here(mod, rows, sel_width, cluster, cap, threads)
        smem = None
    if plan.cluster > PORTABLE_CLUSTER and not mod.cluster16:  # 8 CTAs, at most the cap planned for 16
        narrow = plan_cluster(max(rows, 1), sel_width, mod.sm_count, mod.smem_optin,
                              cluster=PORTABLE_CLUSTER, threads=plan.threads)
        kept = min(plan.cap, narrow.cap)
        plan = ClusterPlan(PORTABLE_CLUSTER, kept, cluster_smem_bytes(kept, PORTABLE_CLUSTER, plan.threads),
                           plan.threads)
        smem = None
    if rows == 0:
        return plan
    if smem is None:
        smem = launch_smem(plan, rows, mod.sm_count, mod.smem_per_sm, mod.smem_optin, pdl)
    aligned = x.data_ptr() % 16 == 0 and stride_r % 4 == 0
    fn = mod.function(cluster_kernel_name(plan.cluster, aligned, plan.threads, page_table is not None), smem)
    tail = cluster_tail(plan.cap, lens_early, page_table, page_bits, unmapped)
    _launch(mod, fn, (plan.cluster, rows, 1), plan.threads, smem, x, stride_r, row_lens, active,
            out, k, sel_width, nan_low, tail, pdl=pdl)
    return plan


def _plan_here(mod, rows: int, sel_width: int, cluster: int | None, cap: int | None,
               threads: int | None) -> ClusterPlan:
    """``plan_cluster``'s launch on ``mod``'s device, with the caller's forced size, cap or threads."""
    plan = plan_cluster(max(rows, 1), sel_width, mod.sm_count, mod.smem_optin, cluster=cluster,
                        threads=threads)
    if plan is None:
        raise ValueError(f"cuda top-k: the cluster route cannot take rows={rows} sel_width={sel_width}")
    if cap is not None:
        if cap < 4 or cap % 4 or cap > plan.cap:
            raise ValueError(f"cuda top-k: cap must be a multiple of 4 in [4, {plan.cap}], got {cap}")
        plan = ClusterPlan(plan.cluster, cap, cluster_smem_bytes(cap, plan.cluster, plan.threads), plan.threads)
    return plan


def cluster_tail(cap: int, lens_early: bool = False, page_table: torch.Tensor | None = None,
                 page_bits: int = 0, unmapped: torch.Tensor | None = None) -> tuple:
    """The cluster kernels' parameters after ``nan_low``: the keys kept in shared memory,
    whether the live lengths are read before the dependency wait, and the page table that turns
    positions into slots (none: a null pointer) with its row stride, page bits and width; with a
    table (a slots entry) then the counter of positions without a slot (``unmapped``; null: not
    counted) (``launch_cuda_topk_cluster``)."""
    if page_table is None:
        table = (ctypes.c_void_p(0), ctypes.c_longlong(0), ctypes.c_int(0), ctypes.c_int(0))
    else:  # (a table of no pages is never read: its pointer may be null)
        table = (ctypes.c_void_p(page_table.data_ptr()), ctypes.c_longlong(page_table.stride(0)),
                 ctypes.c_int(page_bits), ctypes.c_int(page_table.shape[1]),
                 ctypes.c_void_p(0 if unmapped is None else unmapped.data_ptr()))
    return (ctypes.c_int(cap), ctypes.c_int(1 if lens_early else 0), *table)


def _launch(mod, fn, grid, threads, smem, x, stride_r, row_lens, active, out, k, sel_width, nan_low,
            extra: tuple, pdl: bool = False) -> None:
    lens64 = _int_dtype_flag(row_lens, "row_lens")
    if active is not None:
        active64 = _int_dtype_flag(active, "active_width")
        active_ptr = active.data_ptr()
    else:
        active64, active_ptr = 0, 0
    values = (
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_longlong(stride_r),
        ctypes.c_void_p(row_lens.data_ptr()),
        ctypes.c_int(lens64),
        ctypes.c_void_p(active_ptr),
        ctypes.c_int(active64),
        ctypes.c_int(sel_width),
        ctypes.c_int(k),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_longlong(out.stride(0)),
        ctypes.c_int(1 if nan_low else 0),
        *extra,
    )
    launch_values(mod, fn, grid, threads, smem, values, x.device, pdl=pdl)


def launch_values(mod, fn, grid, threads: int, smem: int, values: tuple, device: torch.device, *,
                  pdl: bool = False) -> None:
    """Launch ``fn`` of ``mod`` with ctypes ``values`` as its parameters on torch's current
    stream of ``device`` (captured when that stream captures). ``pdl``: as a programmatic
    dependent launch (sm_90+): the kernel may start while the stream's previous kernel finishes
    and must wait for it (``griddepcontrol.wait``) before touching global memory."""
    driver = mod.driver
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    _check(driver.cuCtxSetCurrent(mod.ctx), "cuCtxSetCurrent")
    what = f"grid={grid}, threads={threads}, smem={smem}"
    if not pdl:
        _check(driver.cuLaunchKernel(fn, *grid, threads, 1, 1, smem, stream, ctypes.addressof(params), 0),
               f"cuLaunchKernel({what})")
        return
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = smem
    config.hStream = stream
    config.attrs = [mod.pdl_attribute]
    config.numAttrs = 1
    _check(driver.cuLaunchKernelEx(config, fn, ctypes.addressof(params), 0), f"cuLaunchKernelEx({what}, pdl)")
