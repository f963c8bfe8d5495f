"""The planner: which kernels a call of so many rows takes, decided on the host, once.

``plan_route`` is one pure function of a call's static shape (rows, width bound, page size), the
device's properties and the user's ``KernelConfig``. It never looks at a capacity larger than the
call, nor at live lengths (those stay on the device): a captured graph replays the schedule it
was captured with. ``plan_step`` runs it for every row count (and width band) a step can see and
keeps the answers as a frozen, printable ``StepPlan``; a step's ``run()`` looks its route up and
launches. The measured thresholds are the constants below; ``docs/kernels.md`` says how they
were chosen and ``docs/performance.md`` holds the measurements.

Routes: ``fused`` (score and select in one cooperative Triton launch: devices without the
cluster top-k), ``radix`` and ``sample`` (a scorer into a logits buffer, then that Triton top-k),
``cuda_radix`` (the same with the NVRTC-compiled CUDA top-k: on sm_90+ a thread-block cluster
of ``topk_cluster`` CTAs a row, for every call; before that one CTA a row, from
``CUDA_TOPK_MIN_ROWS`` rows). Every route selects the same set of positions per row.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .. import checks
from ..table import text_table
from .config import DEFAULT_CONFIG, KernelConfig

FUSED, RADIX, SAMPLE, CUDA_RADIX = "fused", "radix", "sample", "cuda_radix"
CUDA, TRITON = "cuda", "triton"
"""the unfused route's scorer kernel: the CUDA wgmma kernel (``cuda.scorer``) or Triton's"""

# --- measured thresholds (docs/kernels.md: "How the planner chooses") ---------------------------
CUDA_SCORER_MIN_ROWS = 8
"""exact scores: calls of at least this many rows take the CUDA scorer"""
CUDA_SCORER_MIN_WIDTH = 4096
"""exact scores: calls of a width bound of at least this take the CUDA scorer, whatever their rows"""
CUDA_FP8_SCORER_MIN_TOKENS = 4096
"""e4m3 scores: calls of at least this many rows x width-bound tokens take the CUDA scorer"""
TRITON_SCORER_CTAS_PER_SM = 4
"""Triton scorer programs per SM, split over the call's rows"""
CUDA_SCORER_CTAS_PER_SM = 1
"""CUDA scorer programs per SM (one CTA holds more than half an SM's registers)"""
SAMPLE_MIN_ROWS = 32
"""Triton top-k: calls of at least this many rows take the sampled top-k, fewer the radix one"""
CUDA_TOPK_MIN_ROWS = 32
"""before sm_90 (no cluster route): calls of at least this many rows take the one-CTA CUDA top-k"""
TOPK_CTAS_PER_SM = 4
"""Triton top-k programs per SM, split over the call's rows"""
TOPK_MAX_CHUNKS = 512
"""most Triton top-k programs a row"""
FUSED_MAX_ROWS = 8
"""calls of at most this many rows take the fused step (where it runs)"""
FUSED_CTAS_PER_SM = 2
"""fused programs per SM (all resident at once); the device may accept fewer"""
FUSED_MAX_PARTS = 128
"""most fused programs a row: more make each row barrier slower"""
FUSED_MAX_KEYS = 2048
"""most keys a fused program holds in registers; a wider call takes the unfused route"""


@dataclass(frozen=True)
class DeviceInfo:
    """What a plan needs of the device (host queries, made once: ``kernels.device.device_info``)."""

    num_sms: int
    cooperative: bool = True
    """a cooperative launch can make every program of a grid resident (or the interpreter runs)"""
    fused_ctas_per_sm: int | None = None
    """fused programs per SM the device accepted (lowered when a cooperative launch was refused)"""
    cuda_topk: bool = False
    """the NVRTC-compiled CUDA top-k can run (CUDA device of 7.0+, cuda-bindings and NVRTC)"""
    cluster_smem: int = 0
    """shared memory bytes a CTA of the cluster top-k may use (0: no cluster route, before sm_90)"""
    smem_per_sm: int = 0
    """shared memory bytes of one SM (the cluster launch's one-CTA-an-SM size)"""
    cluster16: bool = False
    """16-CTA clusters can be resident (else a plan of 16 runs as 8)"""
    cuda_scorer: bool = False
    """the CUDA wgmma scorer can run (compute capability 9.0, NVRTC present)"""


@dataclass(frozen=True)
class Route:
    """One call's kernels and grids."""

    kind: str
    rows: int
    score_splits: int = 0
    """unfused: scorer programs a row"""
    topk_chunks: int = 0
    """unfused: top-k programs a row"""
    fused_parts: int = 0
    """fused: programs a row"""
    fused_tiles: int = 0
    """fused: most page tiles a program (a power of two); a row's programs take contiguous chunks
    of ``cdiv(live tiles, fused_parts)`` tiles"""
    topk_cluster: int = 0
    """``cuda_radix``: CTAs a row of the cluster top-k (0: one CTA a row, no cluster)"""
    topk_cap: int = 0
    """cluster top-k: keys a CTA keeps in shared memory"""
    topk_threads: int = 0
    """cluster top-k: threads a CTA"""
    topk_smem: int = 0
    """cluster top-k: dynamic shared memory a CTA asks for at launch"""
    scorer: str = TRITON
    """unfused: the scorer kernel, ``CUDA`` or ``TRITON``"""

    @property
    def fused(self) -> bool:
        return self.kind == FUSED

    def describe(self) -> str:
        """The route in words: its kernels (module entries) and their grids."""
        if self.fused:
            return f"fused triton step ({self.fused_parts} a row, {self.fused_tiles} tiles a program)"
        head = f"{self.scorer} scorer ({self.score_splits} a row)" if self.score_splits else "top-k only"
        if self.kind == CUDA_RADIX and self.topk_cluster:
            ctas = f"{self.topk_cluster} CTA{'s' if self.topk_cluster > 1 else ''}"
            topk = (f"cuda top-k topk_cluster_c{self.topk_cluster}_t{self.topk_threads}: {ctas} a row, "
                    f"{self.topk_cap} keys a CTA in shared memory")
        elif self.kind == CUDA_RADIX:
            topk = "cuda top-k topk_radix_t1024_v4: one CTA a row"
        else:
            topk = f"triton {self.kind} top-k ({self.topk_chunks} a row)"
        return f"{head}, {topk}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fused_grid(rows: int, width: int, page: int, slots: int, max_keys: int | None = None,
               max_parts: int | None = None) -> tuple[int, int] | None:
    """``(programs a row, tiles a program)`` of the fused step, or None where it does not fit.

    ``slots``: programs that can be resident at once. ``programs * tiles`` covers the width's
    tiles, so a row of any live length up to the width splits into contiguous chunks of
    ``cdiv(live tiles, programs) <= tiles`` tiles, one a program.
    """
    max_keys = FUSED_MAX_KEYS if max_keys is None else max_keys
    max_parts = FUSED_MAX_PARTS if max_parts is None else max_parts
    if rows <= 0 or width <= 0 or page <= 0 or page & (page - 1) or rows > slots:
        return None
    tiles = _cdiv(width, page)
    per_part = _next_pow2(_cdiv(tiles, max(1, min(max_parts, slots // rows))))
    if per_part * page > max_keys:
        return None
    return _cdiv(tiles, per_part), per_part


def score_splits(rows: int, num_sms: int, scorer: str = TRITON) -> int:
    """Programs a row of the ``scorer`` kernel for a call of ``rows`` rows."""
    per_sm = CUDA_SCORER_CTAS_PER_SM if scorer == CUDA else TRITON_SCORER_CTAS_PER_SM
    return max(1, num_sms * per_sm // max(rows, 1))


def scorer_for(rows: int, page: int, device: DeviceInfo, config: KernelConfig = DEFAULT_CONFIG,
               width: int = 0, fits: bool = True) -> str:
    """The unfused scorer of a call: ``CUDA`` where the device runs it, ``config.cuda`` allows it,
    the call's tensors fit it (``fits``: 64-token pages, head dim 128, 32 or 64 heads) and the call
    is big enough (exact: ``CUDA_SCORER_MIN_ROWS`` rows or a bound of ``CUDA_SCORER_MIN_WIDTH``;
    e4m3: ``CUDA_FP8_SCORER_MIN_TOKENS`` rows x width); else ``TRITON``."""
    if config.precise:
        big = rows >= CUDA_SCORER_MIN_ROWS or width >= CUDA_SCORER_MIN_WIDTH
    else:
        big = rows * width >= CUDA_FP8_SCORER_MIN_TOKENS
    ok = device.cuda_scorer and config.cuda and fits and page == 64 and big
    return CUDA if ok else TRITON


def cluster_route(device: DeviceInfo, config: KernelConfig) -> bool:
    """Whether calls take the CUDA top-k's cluster route here (sm_90+, the CUDA top-k allowed)."""
    return (config.cuda and device.cuda_topk and device.cluster_smem > 0
            and config.topk in ("auto", "cuda"))


def topk_algo_for(rows: int, config: KernelConfig = DEFAULT_CONFIG, device: DeviceInfo | None = None) -> str:
    """The unfused top-k of a call of ``rows`` rows: the CUDA top-k where it may run (every call
    with the cluster route, else from ``CUDA_TOPK_MIN_ROWS`` rows; ``config.topk="cuda"``: every
    call), a pinned Triton algorithm, else sampled from ``SAMPLE_MIN_ROWS`` rows, radix below."""
    cuda_ok = device is not None and device.cuda_topk and config.cuda
    if cuda_ok and (config.topk == "cuda" or (config.topk == "auto" and (
            cluster_route(device, config) or CUDA_TOPK_MIN_ROWS <= rows))):
        return CUDA_RADIX
    if config.topk in (RADIX, SAMPLE):
        return config.topk
    return SAMPLE if rows >= SAMPLE_MIN_ROWS else RADIX


def _cluster_fields(rows: int, width: int, device: DeviceInfo, pdl: bool) -> dict | None:
    """The cluster top-k's launch for ``rows`` rows of at most ``width`` keys on ``device`` (a
    16-CTA plan as 8 where 16 cannot be resident), or None where it cannot take them."""
    from .cuda.topk import PORTABLE_CLUSTER, ClusterPlan, cluster_smem_bytes, launch_smem, plan_cluster

    plan = plan_cluster(rows, width, device.num_sms, device.cluster_smem)
    if plan is None:
        return None
    if plan.cluster > PORTABLE_CLUSTER and not device.cluster16:
        narrow = plan_cluster(rows, width, device.num_sms, device.cluster_smem, cluster=PORTABLE_CLUSTER,
                              threads=plan.threads)
        cap = min(plan.cap, narrow.cap)
        plan = ClusterPlan(PORTABLE_CLUSTER, cap, cluster_smem_bytes(cap, PORTABLE_CLUSTER, plan.threads),
                           plan.threads)
    smem = launch_smem(plan, rows, device.num_sms, device.smem_per_sm,
                       device.cluster_smem, pdl)
    return dict(topk_chunks=plan.cluster, topk_cluster=plan.cluster, topk_cap=plan.cap,
                topk_threads=plan.threads, topk_smem=smem)


def plan_route(rows: int, width: int, page: int, device: DeviceInfo, config: KernelConfig = DEFAULT_CONFIG,
               *, score: bool = True, scorer_fits: bool = True) -> Route:
    """The route of one call: ``rows`` rows, logits width bound ``width`` (kernel rows), K-cache
    pages of ``page`` rows. ``score=False``: a top-k of given logits (never fused).
    ``scorer_fits``: the call's tensors fit the CUDA scorer (``cuda.scorer.takes``)."""
    rows, width = checks.host_int("rows", rows, low=0), checks.host_int("width", width, low=0)
    page = checks.host_int("page", page, low=1)
    if page & (page - 1):
        raise ValueError(f"page: must be a power of two, got {page}")
    sms = device.num_sms
    if (score and config.fused and device.cooperative and 0 < rows <= FUSED_MAX_ROWS
            and not cluster_route(device, config)):
        grid = fused_grid(rows, width, page, sms * (device.fused_ctas_per_sm or FUSED_CTAS_PER_SM))
        if grid is not None:
            return Route(FUSED, rows, fused_parts=grid[0], fused_tiles=grid[1])
    scorer = scorer_for(rows, page, device, config, width, scorer_fits) if score else TRITON
    splits = score_splits(rows, sms, scorer) if score else 0
    algo = topk_algo_for(rows, config, device)
    if algo == CUDA_RADIX:
        cluster = _cluster_fields(max(rows, 1), width, device, config.pdl) if device.cluster_smem > 0 else None
        if cluster is None:  # one CTA a row
            return Route(CUDA_RADIX, rows, score_splits=splits, topk_chunks=1, scorer=scorer)
        return Route(CUDA_RADIX, rows, score_splits=splits, scorer=scorer, **cluster)
    chunks = max(1, min(TOPK_MAX_CHUNKS, sms * TOPK_CTAS_PER_SM // max(rows, 1)))
    return Route(algo, rows, score_splits=splits, topk_chunks=chunks, scorer=scorer)


def width_bands(capacity: int, floor: int = 64) -> tuple[int, ...]:
    """The width bands of a step whose calls name their own width bound up to ``capacity``: powers
    of two from ``floor``, then ``capacity``. A call plans at its band's upper edge (a plan for a
    wider bound serves a narrower one: the kernels split rows by their live lengths)."""
    edges = []
    w = max(1, floor)
    while w < capacity:
        edges.append(w)
        w *= 2
    return (*edges, capacity)


@dataclass(frozen=True)
class StepPlan:
    """Every route a step can take, decided when the step is made: ``route(rows, width)`` is a look-up."""

    device: DeviceInfo
    config: KernelConfig
    page: int
    widths: tuple[int, ...]
    """band edges, ascending: a call of width ``w`` takes the first edge ``>= w``"""
    routes: tuple[tuple[Route, ...], ...]
    """``routes[rows - 1][band]``"""

    @property
    def max_rows(self) -> int:
        return len(self.routes)

    @property
    def max_width(self) -> int:
        return self.widths[-1]

    def route(self, rows: int, width: int) -> Route:
        """The planned route of a call of ``rows`` (>= 1) rows and width bound ``width``."""
        band = bisect.bisect_left(self.widths, width)
        if not 0 < rows <= len(self.routes) or band == len(self.widths):
            raise ValueError(f"plan: a call of {rows} rows and width {width} is outside this plan "
                             f"(1-{len(self.routes)} rows, width <= {self.widths[-1]})")
        return self.routes[rows - 1][band]

    def table(self) -> str:
        """The plan as a table: one line for each run of row counts that take the same kernels."""
        lines = []
        for b, width in enumerate(self.widths):
            start = 0
            for r in range(1, len(self.routes) + 1):
                route = self.routes[r - 1][b]
                nxt = self.routes[r][b] if r < len(self.routes) else None
                if nxt is not None and _same_kernels(route, nxt):
                    continue
                first = self.routes[start][b]
                rows = f"{start + 1}" if start + 1 == r else f"{start + 1}-{r}"
                lines.append([str(width), rows, _kernels(first, route)])
                start = r
        head = f"StepPlan: {self.device.num_sms} SMs, page {self.page}, {self.config}"
        return "\n".join([head, *text_table(("width <=", "rows", "kernels"), lines)])

    def __repr__(self) -> str:
        return self.table()


def _same_kernels(a: Route, b: Route) -> bool:
    return (a.kind, a.scorer, a.topk_cluster, a.topk_threads, a.topk_cap) == \
        (b.kind, b.scorer, b.topk_cluster, b.topk_threads, b.topk_cap)


def _kernels(first: Route, last: Route) -> str:
    """The kernels of a run of routes, their per-row grids from the first to the last."""
    text = first.describe()
    if first != last:
        for field in ("score_splits", "topk_chunks", "fused_parts"):
            a, b = getattr(first, field), getattr(last, field)
            if a != b:
                text = text.replace(f"({a} a row", f"({a}-{b} a row", 1)
    return text


def plan_step(max_rows: int, widths: tuple[int, ...], page: int, device: DeviceInfo,
              config: KernelConfig = DEFAULT_CONFIG, *, score: bool = True,
              scorer_fits: bool = True) -> StepPlan:
    """The routes of every call of 1..``max_rows`` rows at each width band (``widths``, ascending)."""
    max_rows = checks.host_int("max_rows", max_rows, low=1)
    if not widths or list(widths) != sorted(set(widths)) or widths[0] < 0:
        raise ValueError(f"widths: ascending band edges >= 0, got {widths!r}")
    routes = tuple(tuple(plan_route(rows, w, page, device, config, score=score, scorer_fits=scorer_fits)
                         for w in widths) for rows in range(1, max_rows + 1))
    return StepPlan(device, config, page, tuple(widths), routes)
