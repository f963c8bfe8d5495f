"""The decode indexer step across DCP ranks: an exact global top-k over torch.distributed.

Decode context parallelism shards each request's cached kernel rows over ``W`` ranks (row
``g`` on rank ``(g // I) % W``). Each rank runs :class:`DcpIndexerStep` on its own shard, in
its own process, with the metadata of its own ``IndexerMetadataBuilder`` (DCP-local lengths):

1. score its DCP-local rows and select its local top-``k`` with their scores;
2. map local positions to global ones and pack each candidate into one int64 key that orders
   as (score descending, global position ascending) (``dcp.candidate_keys``);
3. all-gather the keys (``k`` per row and rank: static sizes) into a preallocated buffer;
4. merge: the top-``k`` of the ``W * k`` keys of each row is the exact global top-``k``, ties to
   the lowest global position (``dcp.merge_candidate_keys``);
5. map back: global positions, and this rank's local indices with a mask of the selected
   tokens that live here.

Nothing is read from the device on the host and every shape is static for a row count, so with
NCCL the whole step (builder output, scorer, local top-k, all-gather, merge, remap) captures in
one CUDA graph. On CUDA the local stage is the planner's scorer and unfused top-k
(the CUDA top-k where it can run; unfused, so that the scores of the selected positions can be
read from the workspace); elsewhere a sync-free torch
version of the reference (dense, for small shapes: tests and gloo on CPUs).

Around the all-gather, on CUDA (``merge_route``), kernels replace the chains of small torch
ops: a Triton kernel (``kernels.triton.dcp_merge.dcp_send_keys``) writes the send buffer (step
2, the scores read from the scorer's logits at the selected positions), and a merge kernel does
steps 4 and 5 for each row (a radix select over its ``W * k`` keys) into the persistent output
buffers: the CUDA one (``kernels.cuda.dcp_merge``, rows of up to 16384 keys: world 8 at k 2048)
where NVRTC is available, else the Triton one (up to 4096 keys), else torch. All write exactly
what the torch ops write; those stay the route on CPU tensors and the reference.

Contract: every rank of the group calls ``run`` with the same number of rows (the same decode
batch; only the lengths differ by rank), as vLLM's DCP ranks do. Construction checks the
layouts of all ranks against each other and the group (one host collective, outside the
decode loop) and raises the same error on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import checks, dcp
from .bounds import capture_stable_bound
from .kernels import reference as ref
from .kernels.config import DEFAULT_CONFIG, KernelConfig
from .layout import IndexerLayout
from .metadata import IndexerDecodeMetadata
from .step import IndexerStep, StepHealth

LOCAL_ROUTES = ("auto", "triton", "torch")
MERGE_ROUTES = ("auto", "cuda", "triton", "torch")


@dataclass(frozen=True)
class DcpTopk:
    """A DCP step's result for ``rows`` decode rows; views of the step's persistent buffers.

    ``global_idx``: ``int32 [rows, k]`` global kernel-row positions of the exact global top-k
    in the gathered order (by rank, then each rank's candidate order), ``-1`` padded (equal as
    a set, row by row, to a single-process top-k over the whole row: the set is the contract).
    ``local_idx``: ``int32 [rows, k]`` this rank's local position of each selected token, ``-1``
    where another rank owns it (and for padding).
    ``local_mask``: ``bool [rows, k]``, ``local_idx >= 0``.
    """

    global_idx: torch.Tensor
    local_idx: torch.Tensor
    local_mask: torch.Tensor


def _all_gather():
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def torch_logits(q_fp8: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 block_table: torch.Tensor, row_lens: torch.Tensor, width: int, *,
                 active_width: torch.Tensor | None = None) -> torch.Tensor:
    """Indexer scores ``fp32 [rows, min(width, pages * page)]``, ``-inf`` on dead positions.

    ``reference.paged_indexer_logits``'s formula with static shapes and no host reads (dense:
    every position is scored; small shapes only). Each score is a fixed function of its own
    row's inputs and token, whatever the shapes around it: the fp8 dot products are exact in
    fp64 and the heads are summed in a fixed order, so a token scores the same on its DCP rank
    as in the whole row, and a DCP run can be compared exactly with a single-process one.
    """
    _, heads, head_dim = q_fp8.shape
    page = ref.page_size_of(k_cache, head_dim)
    values, scales = ref.split_index_k_cache(k_cache, head_dim)
    num_pages = k_cache.shape[0]
    span = min(int(width), block_table.shape[1] * page)
    t = torch.arange(span, device=q_fp8.device)
    pages = block_table[:, t // page].long()
    ok = (pages >= 0) & (pages < num_pages)
    safe = pages.clamp(0, max(num_pages - 1, 0))
    kv = values[safe, t % page].double()  # [rows, span, D]
    dots = torch.matmul(q_fp8.double(), kv.transpose(1, 2)).float()  # exact, then one rounding
    relu = torch.where(torch.isnan(dots), torch.zeros_like(dots), dots).clamp_min(0)  # maxNum
    w = weights.float()
    logit = w[:, 0, None] * relu[:, 0]
    for h in range(1, heads):
        logit = logit + w[:, h, None] * relu[:, h]
    logit = logit * scales[safe, t % page]
    live = t[None, :] < ref.effective_lengths(row_lens, span, active_width)[:, None]
    return torch.where(ok & live, logit, torch.full_like(logit, float("-inf")))


def torch_local_candidates(q_fp8: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                           block_table: torch.Tensor, row_lens: torch.Tensor, k: int, width: int, *,
                           active_width: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local top-``k`` positions ``int32 [rows, k]`` and their scores ``fp32 [rows, k]`` over
    :func:`torch_logits`, with ``reference.topk_indices``'s semantics (the live positions; ties
    to the lower position), static shapes and no host reads. Padding: ``-1`` / ``-inf``."""
    logit = torch_logits(q_fp8, weights, k_cache, block_table, row_lens, width,
                         active_width=active_width)
    rows, span = logit.shape
    dev = logit.device
    t = torch.arange(span, device=dev)
    live = t[None, :] < ref.effective_lengths(row_lens, span, active_width)[:, None]
    pos = torch.where(live, t[None, :].expand(rows, span), torch.full_like(logit, -1, dtype=torch.long))
    take = min(k, span)
    top = torch.topk(dcp.candidate_keys(logit, pos), take, dim=1, sorted=True).values
    idx = dcp.key_ids(top)
    scores = torch.where(idx >= 0, logit.gather(1, idx.clamp_min(0).long()),
                         torch.full(idx.shape, float("-inf"), device=dev))
    if take < k:
        idx = torch.cat([idx, torch.full((rows, k - take), -1, dtype=idx.dtype, device=dev)], 1)
        scores = torch.cat([scores, torch.full((rows, k - take), float("-inf"), device=dev)], 1)
    return idx, scores


def _merge_route(asked: str, device: torch.device, world: int, k: int) -> str:
    """The merge + remap route that runs: ``asked``, or for ``"auto"`` the CUDA kernel where it
    can run and takes rows of ``world * k`` keys, else the Triton kernel where it fits, else
    torch; on a CPU device ``"auto"`` is torch. A kernel route that cannot take the rows falls
    back to torch; ``"cuda"`` on a device where the CUDA merge cannot run is an error. Nothing is
    imported for a CPU device's ``"auto"`` or ``"torch"``: that route needs neither Triton nor
    cuda-bindings."""
    if asked == "torch" or (asked == "auto" and device.type != "cuda"):
        return "torch"
    from .kernels.triton.dcp_merge import merge_fits

    if asked in ("auto", "cuda"):
        from .kernels.cuda import dcp_merge as cuda_dcp_merge

        ok, why = cuda_dcp_merge.status(device) if device.type == "cuda" else (False, f"device {device}")
        if ok and cuda_dcp_merge.merge_fits(world, k):
            return "cuda"
        if asked == "cuda" and not ok:
            raise ValueError(f"merge_route='cuda': the CUDA merge cannot run here ({why})")
        if asked == "cuda":
            return "torch"
        asked = "triton"
    if asked == "triton" and not merge_fits(world, k, k):  # too many keys for one program
        return "torch"
    return asked


def _group_info(group) -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("DcpIndexerStep: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first, on every rank)")
    return dist.get_world_size(group), dist.get_rank(group)


def rank_layout(layout: IndexerLayout, group=None) -> IndexerLayout:
    """``layout`` with ``dcp_world_size`` and ``dcp_rank`` taken from ``group`` (default: the
    world group): the layout of this rank's builder and step, with no rank to get wrong."""
    if not isinstance(layout, IndexerLayout):
        raise TypeError(f"layout: must be an IndexerLayout, got {type(layout).__name__}")
    world, rank = _group_info(group)
    return replace(layout, dcp_world_size=world, dcp_rank=rank)


class DcpIndexerStep:
    """The decode indexer step of one DCP rank: an exact global top-k across the ranks of
    ``group`` (default: the world group), planned for up to ``max_rows`` rows.

    Construct it on every rank of the group with that rank's layout (``dcp_world_size`` = the
    group's size, ``dcp_rank`` = the rank in the group; ``topk``, interleave, ratio, page size,
    backend and ``max_rows`` equal on every rank): it checks all ranks' settings against each
    other in one host collective and raises the same ``ValueError`` on every rank when any is
    wrong, so no rank is left waiting in a later collective.

    ``local_route``: the local scorer and top-k, ``"triton"`` or ``"torch"``; ``merge_route``:
    the merge + remap, ``"cuda"`` (the NVRTC kernel), ``"triton"`` or ``"torch"`` (the
    reference ops; the same output, element for element). ``"auto"``: on CUDA devices the CUDA
    merge where NVRTC is available, else Triton; torch elsewhere (``"triton"`` on CPU tensors
    needs ``TRITON_INTERPRET=1``). A kernel that cannot take rows of ``world * k`` keys (Triton:
    4096, CUDA: 16384) leaves the merge to torch (``merge_route`` then reads ``"torch"``); the
    send keys stay on the Triton kernel (``send_route``) unless ``"torch"`` was asked.
    """

    def __init__(self, layout: IndexerLayout, group=None, *, max_rows: int, max_pages_per_req: int,
                 device: torch.device | str, config: KernelConfig | None = None,
                 local_route: str = "auto", merge_route: str = "auto") -> None:
        world, rank = _group_info(group)
        self.group = group
        problems = self._local_problems(layout, world, rank, max_rows, max_pages_per_req, config,
                                        local_route, merge_route)
        settings = resolved_merge = None
        if not problems:
            try:
                resolved_merge = _merge_route(merge_route, checks.device("device", device), world,
                                              layout.topk)
            except (TypeError, ValueError) as exc:
                problems.append(str(exc))
        if not problems:
            settings = (layout.topk, layout.cp_interleave, layout.compress_ratio, layout.page_size,
                        str(layout.backend.value), max_rows)
        self._agree(world, rank, layout if not problems else None, settings, problems)
        self.layout = layout
        self.world_size, self.rank = world, rank
        self.max_rows = max_rows = int(max_rows)
        max_pages_per_req = int(max_pages_per_req)
        self.device = torch.device(device)
        self.k = layout.topk
        config = DEFAULT_CONFIG if config is None else config
        # unfused: the scorer leaves its scores in the workspace, where the merge reads them
        self.inner = IndexerStep(layout, max_rows=max_rows, max_pages_per_req=max_pages_per_req,
                                 device=self.device, config=config.with_values(fused=False))
        if local_route == "auto":
            local_route = "triton" if self.device.type == "cuda" else "torch"
        self.local_route = local_route
        self.merge_route = resolved_merge
        # the send-key kernel takes any world and k: Triton wherever a merge kernel may run
        torch_send = merge_route == "torch" or (merge_route == "auto" and self.device.type != "cuda")
        self.send_route = "torch" if torch_send else "triton"
        k = self.k
        i32 = dict(dtype=torch.int32, device=self.device)
        self.local_topk = torch.full((max_rows, k), -1, **i32)
        self.send = torch.empty(max_rows * k, dtype=torch.int64, device=self.device)
        self.gathered = torch.empty(world * max_rows * k, dtype=torch.int64, device=self.device)
        self.global_idx = torch.full((max_rows, k), -1, **i32)
        self.local_idx = torch.full((max_rows, k), -1, **i32)
        self.local_mask = torch.zeros(max_rows, k, dtype=torch.bool, device=self.device)
        self._gather = _all_gather()

    # ------------------------------------------------------------------ checks (host)
    @staticmethod
    def _local_problems(layout, world, rank, max_rows, max_pages_per_req, config, local_route,
                        merge_route="auto") -> list[str]:
        out = []
        if not isinstance(layout, IndexerLayout):
            return [f"layout: must be an IndexerLayout, got {type(layout).__name__}"]
        if layout.dcp_world_size != world:
            out.append(f"layout.dcp_world_size={layout.dcp_world_size} does not match the process "
                       f"group's size {world}")
        if layout.dcp_rank != rank:
            out.append(f"layout.dcp_rank={layout.dcp_rank} is not this process's rank {rank} in the "
                       f"group (of size {world})")
        for name, v in (("max_rows", max_rows), ("max_pages_per_req", max_pages_per_req)):
            try:
                checks.host_int(name, v, low=1)
            except (TypeError, ValueError) as exc:
                out.append(str(exc))
        if config is not None and not isinstance(config, KernelConfig):
            out.append(f"config: must be a KernelConfig, got {type(config).__name__}")
        if local_route not in LOCAL_ROUTES:
            out.append(f"local_route: must be one of {', '.join(LOCAL_ROUTES)}, got {local_route!r}")
        if merge_route not in MERGE_ROUTES:
            out.append(f"merge_route: must be one of {', '.join(MERGE_ROUTES)}, got {merge_route!r}")
        return out

    def _agree(self, world, rank, layout, settings, problems) -> None:
        """Every rank's problems and settings, exchanged; the same error on every rank."""
        import torch.distributed as dist

        mine = {"rank": rank, "problems": problems, "settings": settings,
                "dcp_rank": getattr(layout, "dcp_rank", None)}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine, group=self.group)
        lines = [f"rank {e['rank']}: {p}" for e in everyone for p in e["problems"]]
        if not lines:
            names = ("topk", "cp_interleave", "compress_ratio", "page_size", "backend", "max_rows")
            first = everyone[0]["settings"]
            for e in everyone[1:]:
                for name, a, b in zip(names, first, e["settings"]):
                    if a != b:
                        lines.append(f"rank {e['rank']}: {name}={b!r} differs from rank "
                                     f"{everyone[0]['rank']}'s {a!r}")
        if lines:
            raise ValueError("DcpIndexerStep: the ranks disagree or are misconfigured:\n  "
                             + "\n  ".join(lines))

    def _check_rows(self, rows: int) -> None:
        if rows > self.max_rows:
            raise ValueError(f"meta: {rows} rows exceed the step's max_rows={self.max_rows}")

    # -------------------------------------------------------------------------- run
    def local_candidates(self, meta: IndexerDecodeMetadata, q_fp8: torch.Tensor, weights: torch.Tensor,
                         k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's local top-``k`` over its shard: ``(int32 positions, fp32 scores)``,
        ``[meta.num_rows, k]`` each, ``-1`` / ``-inf`` padded. Sync-free."""
        idx, scores, _ = self._local(meta, q_fp8, weights, k_cache, want_scores=True)
        return idx, scores

    def _local(self, meta, q_fp8, weights, k_cache, *, want_scores: bool):
        """``(idx, scores, False)``; or, on the Triton route without ``want_scores``,
        ``(idx, logits, True)``: the scorer's logits rows, which the send kernel reads at each
        slot's local position (no score gather of its own)."""
        if not isinstance(meta, IndexerDecodeMetadata):
            raise TypeError(f"meta: must be IndexerDecodeMetadata (from the builder), got "
                            f"{type(meta).__name__}")
        rows = meta.num_rows
        self._check_rows(rows)
        self.inner.check_inputs(meta, q_fp8, weights, k_cache)
        active, width = self.inner.contract(meta)
        if self.local_route == "torch":
            idx, scores = torch_local_candidates(q_fp8, weights, k_cache, meta.block_table,
                                                 meta.row_lens, self.k, width, active_width=active)
            return idx, scores, False
        from .kernels import ops

        idx = self.local_topk[:rows]
        ws = self.inner.workspace
        if ws is None:  # the Triton interpreter on CPU tensors (tests)
            from .kernels.workspace import IndexerTopkWorkspace

            ws = self.inner.workspace = IndexerTopkWorkspace(
                self.max_rows, self.k, self.inner.width_capacity, self.device, config=self.inner.config)
        plan = self.inner.plan
        ops.indexer_topk(q_fp8, weights, k_cache, meta.block_table, meta.row_lens, self.k, active_width=active,
                         width=width, workspace=ws, out=idx,
                         route=None if plan is None or rows == 0 else plan.route(rows, width))
        # unfused route: the scores of every live column are in the workspace's logits
        logits = ws.logits[:rows]
        if not want_scores:
            return idx, logits, True
        scores = logits.gather(1, idx.clamp_min(0).long())
        return idx, torch.where(idx >= 0, scores, torch.full_like(scores, float("-inf"))), False

    def merge(self, local_idx: torch.Tensor, local_scores: torch.Tensor) -> DcpTopk:
        """Gather every rank's candidates and merge them into the exact global top-``k``.

        ``local_idx`` int ``[rows, k]`` local positions (``-1`` padding), ``local_scores`` fp32
        ``[rows, k]``; every rank must call it with the same ``rows``. Shapes are checked before
        the collective. Sync-free, static shapes: capturable with NCCL. A position outside this
        rank's rows (at or past its share of ``max_model_len``'s kernel rows) or below ``-1`` has
        no global index: it is dropped as padding, counted in ``health().unmapped_slots`` and, with
        ``VLLM_SPARSE_SYNC_DEVICE_CHECKS=1``, trips a device-side assertion.
        """
        for name, t in (("local_idx", local_idx), ("local_scores", local_scores)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: must be a tensor, got {type(t).__name__}")
        rows = local_idx.shape[0] if local_idx.dim() == 2 else -1
        if local_idx.dim() != 2 or local_idx.shape[1] != self.k or rows > self.max_rows:
            raise ValueError(f"local_idx: must be [rows <= max_rows={self.max_rows}, k={self.k}] "
                             f"candidates, got {tuple(local_idx.shape)}")
        if local_scores.shape != local_idx.shape:
            raise ValueError(f"local_scores: must match local_idx's shape {tuple(local_idx.shape)}, "
                             f"got {tuple(local_scores.shape)}")
        if local_idx.device != self.device and not (local_idx.device.type == self.device.type
                                                    and self.device.index is None):
            raise ValueError(f"local_idx: must live on the step's device {self.device}, got "
                             f"{local_idx.device}")
        if local_idx.dtype not in (torch.int32, torch.int64) or local_scores.dtype != torch.float32:
            raise ValueError(f"local_idx/local_scores: must be int32 or int64 / float32, got "
                             f"{local_idx.dtype} / {local_scores.dtype}")
        checks.same_device("local_scores", local_scores, local_idx.device)
        return self._merge(self._own_positions(local_idx), local_scores, from_logits=False)

    def _own_positions(self, local_idx: torch.Tensor) -> torch.Tensor:
        """``local_idx`` with every position outside this rank's rows as ``-1``, counted (device
        ops, no host read)."""
        cap = capture_stable_bound(self.layout)
        bad = (local_idx >= cap) | (local_idx < -1)
        self.inner.unmapped.add_(bad.sum().to(torch.int32))
        ref.assert_mapped(self.inner.unmapped)
        return torch.where(bad, torch.full_like(local_idx, -1), local_idx)

    def health(self) -> StepHealth:
        """The local step's health (``IndexerStep.health``), with the candidates ``merge`` dropped
        as ``unmapped_slots``; a host read, then cleared."""
        return self.inner.health()

    def _merge(self, local_idx: torch.Tensor, scores: torch.Tensor, *, from_logits: bool) -> DcpTopk:
        """Send keys, all-gather, merge, remap. ``from_logits``: ``scores`` are the scorer's
        logits rows (``[rows, >= width]``), read at each slot's local position; only on the
        Triton send route (``_local`` returns them only then)."""
        k, world, rows = self.k, self.world_size, local_idx.shape[0]
        out = DcpTopk(self.global_idx[:rows], self.local_idx[:rows], self.local_mask[:rows])
        if rows == 0:
            return out
        inter = self.layout.cp_interleave
        send = self.send[:rows * k]
        if self.send_route == "triton":
            from .kernels.triton.dcp_merge import dcp_send_keys

            if local_idx.stride(1) != 1:
                local_idx = local_idx.contiguous()
            if scores.stride(1) != 1:
                scores = scores.contiguous()
            dcp_send_keys(local_idx, scores, send, world=world, rank=self.rank, interleave=inter,
                          gather=from_logits)
        else:
            assert not from_logits, "the torch send route takes per-slot scores"
            gids = dcp.local_to_global(local_idx, world, self.rank, inter)
            send.view(rows, k).copy_(dcp.candidate_keys(scores, gids))
        gathered = self.gathered[:world * rows * k]
        self._gather(gathered, send, group=self.group)
        if self.merge_route == "cuda":
            from .kernels.cuda.dcp_merge import cuda_dcp_merge

            cuda_dcp_merge(gathered.view(world, rows, k), k, out.global_idx, out.local_idx,
                           out.local_mask, world=world, rank=self.rank, interleave=inter)
            return out
        if self.merge_route == "triton":
            from .kernels.triton.dcp_merge import dcp_merge

            dcp_merge(gathered.view(world, rows, k), k, out.global_idx, out.local_idx,
                      out.local_mask, world=world, rank=self.rank, interleave=inter)
            return out
        merged = dcp.merge_candidate_keys(gathered.view(world, rows, k), k)
        out.global_idx.copy_(merged)
        out.local_idx.copy_(dcp.global_to_local(merged, world, self.rank, inter))
        torch.ge(out.local_idx, 0, out=out.local_mask)
        return out

    def run(self, meta: IndexerDecodeMetadata, q_fp8: torch.Tensor, weights: torch.Tensor,
            k_cache: torch.Tensor) -> DcpTopk:
        """The whole DCP step on this rank's shard: local scorer and top-k, all-gather, merge,
        remap. Every rank must call it with the same ``meta.num_rows``. Sync-free."""
        idx, scores, from_logits = self._local(meta, q_fp8, weights, k_cache,
                                               want_scores=self.send_route != "triton")
        return self._merge(idx, scores, from_logits=from_logits)
