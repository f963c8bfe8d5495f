"""The host side of the decode loop: what a serving runner does around the indexer each step.

Per step ``t`` the runner advances the requests' lengths (the CPU shadow), spends a stated
amount of other host work (half before the metadata build, half after: scheduling before;
other metadata, sampling prep after), copies the lengths to the device from pinned memory,
builds the indexer metadata with the project's builder, replays the step's CUDA graph, and
only then waits for the tokens of step ``t - 1`` (async scheduling: one step late). A host
sync inside the build makes the host wait for step ``t - 1``'s GPU work before it can finish
preparing step ``t``; everything after the sync is then serial with the GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import kernels
from ..bounds import SeqLenShadow
from ..layout import IndexerLayout
from ..metadata import DecodeBatch, IndexerDecodeMetadata, IndexerMetadataBuilder
from ..step import IndexerStep
from .model import ModelShape, SyntheticModel


@dataclass(frozen=True)
class Variant:
    """How one variant builds its metadata and runs its indexer."""

    name: str
    doc: str
    builds: bool = True
    """False: no metadata build at all; the kernels read the device lengths directly."""
    legacy_sync: bool = False
    """The builder's ``legacy_device_sync=True``: ``int(seq_lens.max().item())`` per step."""
    exact_shadow: bool = True
    """An authoritative CPU shadow (exact bound); else no shadow and ``max_model_len`` as the
    scheduler's bound (the graph-stable broad bound)."""
    bound_sensitive: bool = False
    """Kernels whose cost follows the host bound: every row scored and selected over the bound."""


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "legacy",
        "builder with legacy_device_sync=True: int(seq_lens.max().item()) per step",
        legacy_sync=True,
    ),
    Variant(
        "broad",
        "sync-free, graph-stable broad bound (max_model_len), our live-length kernels",
        exact_shadow=False,
    ),
    Variant(
        "broad-sensitive",
        "sync-free, broad bound, kernels forced to the bound width "
        "(cost follows the host bound, as the seed's B12X scorer)",
        exact_shadow=False,
        bound_sensitive=True,
    ),
    Variant("exact", "sync-free, exact bound from the CPU shadow (the seed's fix)"),
    Variant("ideal", "no indexer metadata work: the kernels read the device lengths (ceiling)", builds=False),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def variant_named(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANT_NAMES)}")


def spin(us: float) -> None:
    """Busy host work for ``us`` microseconds (holds the interpreter, as host code does)."""
    if us <= 0:
        return
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


@dataclass
class RunStats:
    """One run of ``steps`` decode steps of one variant."""

    variant: str
    batch: int
    steps: int
    host_us_setting: float
    wall_s: float
    step_ms: list[float]
    host_us: list[float]
    build_us: list[float]
    wait_us: list[float]
    gpu_ms: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    """Sampled token ids, ``[steps][batch]``."""

    @property
    def tok_per_s(self) -> float:
        return self.batch * self.steps / self.wall_s

    @property
    def tok_per_s_per_req(self) -> float:
        return self.steps / self.wall_s

    def summary(self) -> dict:
        med = lambda xs: statistics.median(xs) if xs else float("nan")
        return dict(
            variant=self.variant,
            batch=self.batch,
            steps=self.steps,
            host_work_us=self.host_us_setting,
            wall_s=self.wall_s,
            tok_s=self.tok_per_s,
            tok_s_per_req=self.tok_per_s_per_req,
            step_ms=med(self.step_ms),
            gpu_ms=med(self.gpu_ms),
            host_us=med(self.host_us),
            build_us=med(self.build_us),
            wait_us=med(self.wait_us),
        )


class DecodeLoop:
    """A batch of ``batch`` requests at ``context`` tokens decoding up to ``max_steps`` tokens
    each, under every variant (graphs captured per variant on CUDA; eager elsewhere)."""

    def __init__(
        self,
        layout: IndexerLayout,
        shape: ModelShape,
        *,
        batch: int,
        context: int,
        max_steps: int,
        device: torch.device | str,
        variants: Sequence[Variant] = VARIANTS,
        seed: int = 0,
    ) -> None:
        for name, v in (("batch", batch), ("context", context), ("max_steps", max_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: must be a positive int, got {v!r}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.layout, self.batch, self.context, self.max_steps = layout, batch, context, max_steps
        max_len = context + max_steps
        if max_len > layout.max_model_len:
            raise ValueError(f"context + max_steps = {max_len} exceeds max_model_len={layout.max_model_len}")
        # request i starts a little shorter than the context, so rows differ
        self.start_lens = np.array(
            [context - (i * 97) % max(1, min(512, context // 2)) for i in range(batch)], dtype=np.int32
        )
        self.model = SyntheticModel(
            layout,
            shape,
            start_lens=self.start_lens.tolist(),
            max_steps=max_steps,
            device=self.device,
            seed=seed,
        )
        self.qsl_cpu = torch.arange(batch + 1, dtype=torch.int32)
        self.qsl = self.qsl_cpu.to(self.device, copy=True)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self._pinned = [torch.zeros(batch, dtype=torch.int32, pin_memory=self.cuda) for _ in range(2)]
        self._tok_host = [torch.zeros(batch, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self._tok_ready = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.variants = {v.name: v for v in variants}
        self._builders: dict[str, IndexerMetadataBuilder] = {}
        self._steps: dict[str, IndexerStep] = {}
        self._metas: dict[str, IndexerDecodeMetadata] = {}
        self._outs: dict[str, torch.Tensor] = {}
        self._graphs: dict[str, object] = {}
        self._static_width = torch.full(
            (1,), self.model.table_pages * layout.page_size, dtype=torch.int32, device=self.device
        )

    # ------------------------------------------------------------------ host side
    def _variant(self, name: str) -> Variant:
        """The variant ``name`` of this loop; a ValueError naming the known ones otherwise."""
        v = self.variants.get(name)
        if v is None:
            raise ValueError(f"variant: {name!r} is not one of this loop's: {', '.join(self.variants)}")
        return v

    def _shadow_batch(self, v: Variant, lens: np.ndarray) -> DecodeBatch:
        """The runner's decode batch for this step (host data from ``lens``, the CPU shadow)."""
        if v.exact_shadow:
            shadow = SeqLenShadow(torch.from_numpy(lens))
            max_seq_len = int(lens.max())
        else:
            shadow, max_seq_len = None, self.layout.max_model_len
        return DecodeBatch(self.qsl, self.qsl_cpu, self.seq_lens, shadow, self.model.block_table, max_seq_len)

    def _builder(self, v: Variant) -> IndexerMetadataBuilder:
        if v.name not in self._builders:
            self._builders[v.name] = IndexerMetadataBuilder(
                self.layout,
                max_num_reqs=self.batch,
                max_num_tokens=self.batch,
                max_pages_per_req=self.model.table_pages,
                device=self.device,
                legacy_device_sync=v.legacy_sync,
            )
        return self._builders[v.name]

    def _step(self, v: Variant) -> IndexerStep:
        if v.name not in self._steps:
            self._steps[v.name] = IndexerStep(
                self.layout, max_rows=self.batch, max_pages_per_req=self.model.table_pages, device=self.device
            )
            self._outs[v.name] = torch.empty(
                self.batch, self.layout.topk, dtype=torch.int32, device=self.device
            )
        return self._steps[v.name]

    def _prepare_inputs(self, v: Variant, lens: np.ndarray, slot: int) -> float:
        """Lengths to the device (pinned, async) and the metadata build; returns the build's us."""
        pinned = self._pinned[slot]
        pinned.numpy()[:] = lens
        self.seq_lens.copy_(pinned, non_blocking=True)
        if not v.builds:
            return 0.0
        t = time.perf_counter()
        self._metas[v.name] = self._builder(v).build(self._shadow_batch(v, lens))
        return (time.perf_counter() - t) * 1e6

    # ---------------------------------------------------------------- device side
    def indexer(self, v: Variant) -> Callable:
        """The per-layer indexer call of ``v`` (reads only persistent buffers: capturable)."""
        step, out, lay = self._step(v), self._outs[v.name], self.layout
        bt = self.model.block_table
        width = self.model.table_pages * lay.page_size
        if not v.builds:

            def run(layer, q, w):
                return kernels.indexer_topk(
                    q,
                    w,
                    self.model.k_caches[layer],
                    bt,
                    self.seq_lens,
                    lay.topk,
                    active_width=self._static_width,
                    width=width,
                    workspace=step.workspace,
                    out=out,
                )

            return run
        meta = self._metas[v.name]
        if not v.bound_sensitive:

            def run(layer, q, w):
                return step.run(meta, q, w, self.model.k_caches[layer], out=out)

            return run

        def run(layer, q, w):
            # every row as long as the host bound: the cost follows the bound, not the rows
            wide = meta.active_width.expand(self.batch).contiguous()
            kernels.indexer_topk(
                q,
                w,
                self.model.k_caches[layer],
                meta.block_table,
                wide,
                lay.topk,
                active_width=meta.active_width,
                width=width,
                workspace=step.workspace,
                out=out,
            )
            return out.masked_fill_(out >= meta.row_lens.unsqueeze(1), -1)  # rows shorter than k

        return run

    def prepare(self, name: str) -> None:
        """Build once, run the step eagerly, then (CUDA) capture it in a graph."""
        v = self._variant(name)
        if name in self._graphs:
            return
        self.model.reset()
        self._prepare_inputs(v, self.start_lens + 1, 0)
        fn = self.indexer(v)
        self.model.forward(fn, self.seq_lens)  # eager warm-up: every kernel compiled and its route settled
        if self.cuda:
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.model.forward(fn, self.seq_lens)
            self._graphs[name] = graph
        else:
            self._graphs[name] = lambda: self.model.forward(fn, self.seq_lens)
        self.model.reset()

    def _launch(self, name: str, check) -> None:
        g = self._graphs[name]
        if self.cuda:
            g.replay()
        elif check is not None:  # the torch reference stands in for the GPU: its reads are not ours
            with check.unchecked():
                g()
            check.mark(self.model.tokens)
        else:
            g()

    # --------------------------------------------------------------------- the loop
    def run(
        self,
        name: str,
        steps: int,
        host_us: float = 0.0,
        *,
        before: float = 0.5,
        check=None,
        timed: bool = True,
    ) -> RunStats:
        """``steps`` decode steps of variant ``name`` with ``host_us`` of other host work per
        step (``before`` of it ahead of the build). ``check``: a running ``SyncCheck`` (CPU:
        the reference kernels run unchecked, their outputs marked). ``timed=False``: no GPU
        timing events and no device syncs around the loop (for counting syncs)."""
        if not 0 < steps <= self.max_steps:
            raise ValueError(f"steps: must lie in (0, max_steps={self.max_steps}], got {steps}")
        if not 0.0 <= before <= 1.0:
            raise ValueError(f"before: must lie in [0, 1], got {before}")
        v = self._variant(name)
        self.prepare(name)
        self.model.reset()
        lens = self.start_lens.copy()
        timing = (
            [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(steps)
            ]
            if self.cuda and timed
            else []
        )
        step_ms, host, build, wait, tokens = [], [], [], [], []
        if timing:
            torch.cuda.synchronize(self.device)
        t_start = prev = time.perf_counter()
        for t in range(steps):
            t0 = time.perf_counter()
            if t:
                step_ms.append((t0 - prev) * 1e3)
            prev = t0
            slot = t % 2
            lens += 1  # the scheduler: one new token per request
            spin(host_us * before)
            build.append(self._prepare_inputs(v, lens, slot))
            spin(host_us * (1.0 - before))
            if timing:
                timing[t][0].record()
            self._launch(name, check)
            if timing:
                timing[t][1].record()
            self._tok_host[slot].copy_(self.model.tokens, non_blocking=self.cuda)
            if self.cuda:
                self._tok_ready[slot].record()
            host.append((time.perf_counter() - t0) * 1e6)
            if t:
                tokens.append(self._read_tokens(1 - slot, wait))
        tokens.append(self._read_tokens((steps - 1) % 2, wait))
        wall = time.perf_counter() - t_start
        gpu = []
        if timing:
            torch.cuda.synchronize(self.device)
            gpu = [a.elapsed_time(b) for a, b in timing]
        return RunStats(name, self.batch, steps, host_us, wall, step_ms, host, build, wait, gpu, tokens)

    def _read_tokens(self, slot: int, wait: list[float]) -> list[int]:
        """The sampled tokens of an earlier step (waits for that step's event alone)."""
        t = time.perf_counter()
        if self.cuda:
            self._tok_ready[slot].synchronize()
        ids = self._tok_host[slot].tolist()
        wait.append((time.perf_counter() - t) * 1e6)
        return ids

    # ------------------------------------------------------------------- syncs
    def watch(self) -> list[torch.Tensor]:
        """Tensors that stand for device data (for the sentinel on a CPU host)."""
        out = [self.qsl, self.seq_lens, self.model.tokens, self.model.block_table]
        for b in self._builders.values():
            out += [b.row_lens_buffer, b.block_table_buffer, b.active_width_buffer]
        return out

    def count_syncs(self, name: str, steps: int = 8) -> dict[str, float]:
        """Host syncs per step by kind over ``steps`` steps: the runtime-API layer on CUDA (the
        calls nsys counts), the sentinel on a CPU host."""
        from ..testing.guard import sync_recorder

        self.prepare(name)
        layers = "runtime_api" if self.cuda else "sentinel"
        with sync_recorder(
            watch=() if self.cuda else self.watch(), layers=layers, where=f"decode loop: {name}"
        ) as rec:
            self.run(name, steps, check=None if self.cuda else rec, timed=False)
        per_step = {kind: n / steps for kind, n in rec.counts.items()}
        per_step["total"] = sum(rec.counts.values()) / steps
        return per_step
