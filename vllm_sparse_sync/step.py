"""The decode indexer step: planned once from the layout and capacities, run on each step's
metadata. With ``IndexerMetadataBuilder`` it is the public way to run a decode indexer step.

Plan (``IndexerStep(...)``, outside capture): the workspace for the largest call and
``step.plan``, the kernels of every row count the step can see (``kernels.planner.StepPlan``;
``print(step.plan)``). Bind and run (``run(meta, ...)``, every step): the host contract follows
the backend (B12X: the device ``active_width`` clamp over the block table's width; DeepGEMM-style:
the host bound as the logits width), the route is looked up by the call's row count; nothing is
read from the device, nothing is allocated when ``out=`` is given, so a step captures in a CUDA
graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import checks, kernels
from .bounds import capture_stable_bound
from .kernels import reference as ref
from .kernels.config import DEFAULT_CONFIG, KernelConfig
from .kernels import ops
from .kernels.launch import CooperativeLaunchRefused
from .kernels.planner import CUDA, DeviceInfo, Route, StepPlan, plan_step, width_bands
from .layout import IndexerBackend, IndexerLayout
from .metadata import IndexerDecodeMetadata, IndexerMetadataBuilder


@dataclass(frozen=True)
class StepHealth:
    """What the device reported about past steps (read on the host: not in the decode loop)."""

    stalled_rows: int
    """Rows whose fused row barrier gave up; their output rows were written as all ``-1``."""
    unmapped_slots: int = 0
    """Selected positions that had no KV-cache slot (``run(slots=...)``: a page-table entry that
    is negative or whose slot would pass ``2**31 - 1``, a page past the table; a DCP candidate
    outside its rank's rows): each was written as ``-1``, never as another slot."""

    @property
    def ok(self) -> bool:
        return self.stalled_rows == 0 and self.unmapped_slots == 0


def step_plan(layout: IndexerLayout, max_rows: int, max_pages_per_req: int, device: DeviceInfo,
              config: KernelConfig = DEFAULT_CONFIG) -> StepPlan:
    """The plan of a step of ``layout``: every row count up to ``max_rows`` at the widths its calls
    name (B12X: the block table's; DeepGEMM-style: bands of the host bound up to the capacity)."""
    width = max_pages_per_req * layout.page_size
    if layout.backend is IndexerBackend.B12X:
        widths: tuple[int, ...] = (width,)
    else:
        widths = width_bands(max(width, capture_stable_bound(layout)), layout.page_size)
    fits = layout.page_size == 64 and layout.head_dim == 128 and layout.num_heads in (32, 64)
    return plan_step(max_rows, widths, layout.page_size, device, config, scorer_fits=fits)


def _positive(name: str, v: object, high: int | None = None) -> int:
    return checks.host_int(name, v, low=1, high=high)


class IndexerStep:
    """The decode indexer step (scorer + top-k) of one layout, planned for up to ``max_rows``
    rows and block tables of ``max_pages_per_req`` pages."""

    def __init__(self, layout: IndexerLayout, *, max_rows: int, max_pages_per_req: int,
                 device: torch.device | str, config: KernelConfig | None = None) -> None:
        if not isinstance(layout, IndexerLayout):
            raise TypeError(f"layout: must be an IndexerLayout, got {type(layout).__name__}")
        config = DEFAULT_CONFIG if config is None else config
        if not isinstance(config, KernelConfig):
            raise TypeError(f"config: must be a KernelConfig, got {type(config).__name__}")
        self.layout = layout
        self.max_rows = _positive("max_rows", max_rows, checks.MAX_ROWS)
        self.max_pages_per_req = _positive("max_pages_per_req", max_pages_per_req)
        if self.max_pages_per_req * layout.page_size > checks.MAX_KERNEL_ROWS:
            raise ValueError(
                f"max_pages_per_req: {self.max_pages_per_req} pages of {layout.page_size} rows exceed the "
                f"kernels' limit of {checks.MAX_KERNEL_ROWS} positions a row")
        self.device = checks.device("device", device)
        self.config = config
        self.width_capacity = max(self.max_pages_per_req * layout.page_size, capture_stable_bound(layout))
        """Widest logits a call may ask for: the block table's rows, or the capture bound."""
        self.workspace = kernels.make_workspace(self.max_rows, layout.topk, self.width_capacity,
                                                self.device, config)
        self.unmapped = (self.workspace.unmapped if self.workspace is not None
                         else torch.zeros(1, dtype=torch.int32, device=self.device))
        """Selected positions written as ``-1`` for want of a slot, since the last ``health()``."""
        self._checked: set[tuple] = set()  # input signatures check_inputs has passed
        self.plan: StepPlan | None = self._plan()
        """The kernels of every call this step can see (None: the torch reference, off CUDA)."""

    def _plan(self) -> StepPlan | None:
        if self.workspace is None:
            return None
        plan = step_plan(self.layout, self.max_rows, self.max_pages_per_req, self.workspace.device_info(),
                         self.config)
        self._cuda_scorer = any(r.scorer == CUDA for row in plan.routes for r in row)
        return plan

    def __repr__(self) -> str:
        head = (f"IndexerStep({self.layout.backend.value}, max_rows={self.max_rows}, "
                f"max_pages_per_req={self.max_pages_per_req}, device={self.device})")
        return f"{head}\n{self.plan!r}" if self.plan is not None else f"{head}: the torch reference"

    @classmethod
    def for_builder(cls, builder: IndexerMetadataBuilder, config: KernelConfig | None = None
                    ) -> IndexerStep:
        """The step that runs on ``builder``'s metadata (same layout, capacities and device)."""
        if not isinstance(builder, IndexerMetadataBuilder):
            raise TypeError(f"builder: must be an IndexerMetadataBuilder, got {type(builder).__name__}")
        return cls(builder.layout, max_rows=builder.max_num_tokens,
                   max_pages_per_req=builder.max_pages_per_req, device=builder.device, config=config)

    # ------------------------------------------------------------------ host decisions
    def contract(self, meta: IndexerDecodeMetadata) -> tuple[torch.Tensor | None, int]:
        """``(active_width, width)`` of a call on ``meta``: B12X clamps on the device within the
        block table's width; DeepGEMM-style takes the host bound as the width."""
        if not isinstance(meta, IndexerDecodeMetadata):
            raise TypeError(f"meta: must be IndexerDecodeMetadata (from the builder), got {type(meta).__name__}")
        if self.layout.backend is IndexerBackend.B12X:
            return meta.active_width, meta.block_table.shape[1] * self.layout.page_size
        return None, meta.bound.value

    def route(self, rows: int, width: int | None = None) -> Route | None:
        """The planned kernels of a call of ``rows`` (>= 1) rows and width bound ``width`` (default:
        the widest), a look-up in ``plan`` (None: the torch reference, off CUDA)."""
        rows = checks.host_int("rows", rows, low=1, high=self.max_rows)
        if self.plan is None:
            return None
        width = self.plan.max_width if width is None else checks.host_int("width", width, low=0)
        return self.plan.route(rows, width)

    # -------------------------------------------------------------------------- run
    def run(self, meta: IndexerDecodeMetadata, q_fp8: torch.Tensor, weights: torch.Tensor,
            k_cache: torch.Tensor, *, out: torch.Tensor | None = None,
            slots: bool | torch.Tensor = False) -> torch.Tensor:
        """Top-``k`` positions of each decode row, ``int32 [meta.num_rows, k]`` (a set per row,
        ``-1`` padded). Sync-free; capturable once each row count has run eagerly.

        ``slots``: the output holds KV-cache slots instead (``kernels.page_table_slots``, the
        index sparse attention reads), through ``meta.block_table`` (``True``) or the given int32
        ``[rows, pages]`` table of the layout's page size (the attention's own); on the CUDA
        cluster top-k in the same launch."""
        if not isinstance(meta, IndexerDecodeMetadata):
            raise TypeError(f"meta: must be IndexerDecodeMetadata (from the builder), got "
                            f"{type(meta).__name__}")
        self.check_inputs(meta, q_fp8, weights, k_cache)
        active, width = self.contract(meta)
        if slots is not False and self.layout.dcp_world_size > 1:
            raise ValueError("slots: a DCP rank's positions are rank-local and meet the other ranks' in "
                             "the global merge first; map the merged ids with kernels.page_table_slots")
        if isinstance(slots, bool):
            table = meta.block_table if slots else None
        elif isinstance(slots, torch.Tensor):
            table = slots
        else:
            raise TypeError(f"slots: must be a bool or an int32 page table, got {type(slots).__name__}")
        unmapped = None if table is None else self.unmapped
        if self.plan is None or meta.num_rows == 0:
            return kernels.indexer_topk(q_fp8, weights, k_cache, meta.block_table, meta.row_lens,
                                        self.layout.topk, active_width=active, width=width,
                                        workspace=self.workspace, out=out, page_table=table,
                                        page_size=self.layout.page_size, unmapped=unmapped)
        while True:
            try:
                return ops.indexer_topk(q_fp8, weights, k_cache, meta.block_table, meta.row_lens,
                                        self.layout.topk, active_width=active, width=width,
                                        workspace=self.workspace, out=out, page_table=table,
                                        page_size=self.layout.page_size, unmapped=unmapped,
                                        route=self.plan.route(meta.num_rows, width))
            except CooperativeLaunchRefused:  # (the eager warm-up call): fewer fused programs an SM
                self.workspace.fused_ctas_per_sm //= 2
                self.plan = self._plan()

    def check_inputs(self, meta: IndexerDecodeMetadata, q_fp8: object, weights: object,
                     k_cache: object) -> None:
        """Host checks of a call's tensors against the layout and this step (metadata only): the
        rows, heads and head dim of ``q_fp8``, the device of every tensor, and a K cache of the
        layout's page size. Each signature (shapes, dtypes, devices) is checked once."""
        try:
            key = (meta.num_rows, meta.row_lens.device, q_fp8.shape, q_fp8.dtype, q_fp8.device, weights.shape,
                   weights.device, k_cache.shape, k_cache.dtype, k_cache.device, k_cache.stride(),
                   k_cache.data_ptr() % 16)
        except AttributeError:
            key = None
        if key is not None and key in self._checked:
            return
        self._check_inputs(meta, q_fp8, weights, k_cache)
        if key is not None:
            if len(self._checked) > 256:
                self._checked.clear()
            self._checked.add(key)

    def _check_inputs(self, meta, q_fp8, weights, k_cache) -> None:
        lay = self.layout
        rows = meta.num_rows
        if not isinstance(q_fp8, torch.Tensor):
            raise TypeError(f"q_fp8: must be a torch.Tensor, got {type(q_fp8).__name__}")
        if q_fp8.dim() != 3 or tuple(q_fp8.shape) != (rows, lay.num_heads, lay.head_dim):
            raise ValueError(f"q_fp8: must be [num_rows={rows}, num_heads={lay.num_heads}, "
                             f"head_dim={lay.head_dim}], got {tuple(q_fp8.shape)}")
        if rows > self.max_rows:
            raise ValueError(f"meta: {rows} rows exceed the step's max_rows={self.max_rows}")
        checks.same_device("q_fp8", q_fp8, self.device)
        checks.same_device("meta.row_lens", meta.row_lens, self.device)
        for name, t in (("weights", weights), ("k_cache", k_cache)):
            checks.same_device(name, checks.tensor(name, t), self.device)
        page = ref.page_size_of(k_cache, lay.head_dim)
        if page != lay.page_size:
            raise ValueError(f"k_cache: rows of {k_cache.shape[1]} bytes hold pages of {page} rows, "
                             f"the layout's page_size is {lay.page_size}")
        if self.plan is not None and self._cuda_scorer and not ops_scorer_fits(q_fp8, k_cache, meta.block_table,
                                                                               page):
            raise ValueError("k_cache: the plan's CUDA scorer reads 16-byte aligned pages (a contiguous "
                             f"[pages, {page * (lay.head_dim + 4)}] uint8 cache whose rows start 16 bytes "
                             "apart); pass such a cache, or plan with KernelConfig(cuda=False)")

    def health(self) -> StepHealth:
        """Stalled rows and unmapped slots since the last call (reads device memory: a host sync;
        call it outside the decode loop, e.g. after a benchmark or in a test), then clears them."""
        unmapped = int(self.unmapped.item())
        self.unmapped.zero_()
        if self.workspace is None:
            return StepHealth(0, unmapped)
        stalled = self.workspace.stalled_rows()
        self.workspace.clear_stalls()
        return StepHealth(stalled, unmapped)


def ops_scorer_fits(q_fp8, k_cache, block_table, page: int) -> bool:
    """Whether the CUDA scorer is built for these tensors (``kernels.ops.scorer_fits``)."""
    from .kernels.ops import scorer_fits

    return scorer_fits(q_fp8, k_cache, block_table, page)
