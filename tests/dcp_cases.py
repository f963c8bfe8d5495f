"""DCP exactness cases, run on every rank of a process group (CPU/gloo and GPU/NCCL tests).

Every rank builds the same global batch from the case's seed (a global paged K cache, block
tables, q, weights), keeps its own shard (``shard_k_cache``), builds DCP-local metadata with
its own builder and runs ``DcpIndexerStep``; the oracle is the single-process reference over
the whole rows (``IndexerStep`` with world 1 on the CPU: ``reference.indexer_topk``).

Checks, per rank: the global top-k equals the reference's as a set per row (ties to the lowest
position; the merge writes in gathered order, so the set is the contract); the local
indices address the very same K bytes as the global ones; the mask marks exactly the selected
tokens this rank owns. Across ranks (in the test): every rank has the same global top-k and
the masks partition it. ``plant`` puts a known bug in place on the ranks, to show the checks
catch it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_sparse_sync import (
    DcpIndexerStep,
    DecodeBatch,
    IndexerLayout,
    IndexerMetadataBuilder,
    IndexerStep,
    SeqLenShadow,
    dcp,
)
from vllm_sparse_sync.distributed import torch_logits
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.synth import random_k_cache, shard_k_cache
from vllm_sparse_sync.lengths import compress_ceil

HEADS, HEAD_DIM, PAGE = 16, 128, 64


@dataclass(frozen=True)
class Case:
    world: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    k: int
    interleave: int = 1
    ratio: int = 1
    backend: str = "b12x"
    max_model_len: int = 2048
    ties: bool = False
    seed: int = 0
    authoritative: bool = True
    plant: str = ""
    local_route: str = "auto"
    merge_route: str = "auto"


def layout_of(case: Case, world: int = 1, rank: int = 0) -> IndexerLayout:
    return IndexerLayout(backend=case.backend, compress_ratio=case.ratio, dcp_world_size=world,
                         dcp_rank=rank, cp_interleave=case.interleave, page_size=PAGE, topk=case.k,
                         num_heads=HEADS, head_dim=HEAD_DIM, max_model_len=case.max_model_len)


def global_batch(case: Case, device="cpu"):
    """(cache, table, q, w, qsl_cpu, seq_cpu) of the whole batch; the same on every rank."""
    g = torch.Generator().manual_seed(case.seed)
    n = len(case.seq_lens)
    pages = math.ceil(compress_ceil(case.max_model_len, case.ratio) / PAGE)
    cache = random_k_cache(n * pages + 1, PAGE, HEAD_DIM, ties=case.ties, generator=g)
    table = torch.randperm(n * pages + 1, generator=g)[: n * pages].view(n, pages).int()
    rows = sum(case.query_lens)
    if case.ties:  # small integers everywhere: exact sums, many equal scores
        q = torch.randint(-1, 2, (rows, HEADS, HEAD_DIM), generator=g).float()
        w = torch.randint(-2, 3, (rows, HEADS), generator=g).float()
    else:
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=g) * 0.7
        w = torch.randn(rows, HEADS, generator=g)
    starts = [0]
    for ql in case.query_lens:
        starts.append(starts[-1] + ql)
    qsl = torch.tensor(starts, dtype=torch.int32)
    seq = torch.tensor(case.seq_lens, dtype=torch.int32)
    return (cache.to(device), table.to(device), q.to(ref.FP8_DTYPE).to(device), w.to(device), qsl, seq)


def _batch(qsl, seq, table, case: Case, device) -> DecodeBatch:
    shadow = SeqLenShadow(seq.clone(), authoritative=case.authoritative)
    return DecodeBatch(qsl.clone().to(device), qsl, seq.clone().to(device), shadow, table,
                       max(case.seq_lens, default=0))


def reference_topk(case: Case, cache, table, q, w, qsl, seq):
    """Single-process top-k over the whole rows, on the CPU: ``reference.topk_indices`` over
    ``torch_logits`` (the CPU route's scores, which are shape-independent); with ``ties`` data
    (exact arithmetic everywhere) also the full ``reference.indexer_topk`` via ``IndexerStep``.
    Returns (top-k, the rows' live lengths, the global metadata)."""
    lay = layout_of(case)
    n, rows = len(case.seq_lens), sum(case.query_lens)
    builder = IndexerMetadataBuilder(lay, max_num_reqs=max(n, 1), max_num_tokens=max(rows, 1),
                                     max_pages_per_req=table.shape[1], device="cpu")
    meta = builder.build(_batch(qsl, seq, table.cpu(), case, "cpu"))
    step = IndexerStep(lay, max_rows=max(rows, 1), max_pages_per_req=table.shape[1], device="cpu")
    active, width = step.contract(meta)
    args = (q.cpu(), w.cpu(), cache.cpu(), meta.block_table, meta.row_lens)
    logits = torch_logits(*args, width, active_width=active)
    want = ref.topk_indices(logits, meta.row_lens, case.k, active_width=active)
    if case.ties:
        full = step.run(meta, *args[:3])
        if not torch.equal(full, want):
            raise AssertionError(f"{case}: reference.indexer_topk and torch_logits disagree on exact data")
    eff = ref.effective_lengths(meta.row_lens, min(width, table.shape[1] * PAGE), active)
    return want, eff, meta


def _plant(kind: str):
    """Monkeypatch a known bug into this process; returns the undo."""
    saved = {name: getattr(dcp, name) for name in ("candidate_keys", "local_to_global", "global_to_local")}
    if kind == "tiebreak":  # ties go to the highest global position
        def keys(scores, ids):
            key = (ref.sortable_keys(scores).long() << 32) + ids.long().clamp_min(0)
            return torch.where(ids >= 0, key, torch.full_like(key, dcp.PAD_KEY))
        dcp.candidate_keys = keys
    elif kind == "map":  # local -> global ignoring the interleave
        def l2g(lp, world, rank, interleave=1):
            g = lp.long() * world + rank
            return torch.where(lp >= 0, g, torch.full_like(g, -1)).to(lp.dtype)
        dcp.local_to_global = l2g
    elif kind == "remap":  # global -> local off by one
        orig = saved["global_to_local"]
        dcp.global_to_local = lambda gp, *a: torch.where(orig(gp, *a) > 0, orig(gp, *a) - 1, orig(gp, *a))
    elif kind:
        raise ValueError(f"unknown plant {kind!r}")

    def undo():
        for name, fn in saved.items():
            setattr(dcp, name, fn)
    return undo


def _token_bytes(split, table_row, pos):
    """The K bytes (values and scale) of kernel row ``pos`` of a request, via its block table."""
    values, scales = split
    page = values.shape[1]
    p = table_row[pos // page].long()
    scale = scales[p, pos % page].reshape(1).view(torch.uint8)
    return torch.cat([values.view(torch.uint8)[p, pos % page], scale])


def run_case(ctx, case: Case, *, sentinel: bool) -> dict:
    """One case on this rank: ``{"errors": [...], "global": int32 [rows, k], "mask": bool}``."""
    from vllm_sparse_sync.testing import check_step, device_tensors

    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    undo = _plant(case.plant)
    try:
        cache, table, q, w, qsl, seq = global_batch(case, dev)
        want, eff, meta_g = reference_topk(case, cache, table, q, w, qsl, seq)
        lay = layout_of(case, world, rank)
        cache_l, table_l = shard_k_cache(cache, table, world, rank, case.interleave)
        n, rows = len(case.seq_lens), sum(case.query_lens)
        builder = IndexerMetadataBuilder(lay, max_num_reqs=max(n, 1), max_num_tokens=max(rows, 1),
                                         max_pages_per_req=table_l.shape[1], device=dev)
        step = DcpIndexerStep(lay, max_rows=max(rows, 1), max_pages_per_req=table_l.shape[1], device=dev,
                              local_route=case.local_route, merge_route=case.merge_route)
        batch = _batch(qsl, seq, table_l, case, dev)
        got = []

        def step_fn():
            got.append(step.run(builder.build(batch), q, w, cache_l))

        errors = []
        if sentinel:
            watch = device_tensors(builder, step, batch, q, w, cache_l)
            check = check_step(step_fn, watch=watch, layers="sentinel", raise_on_sync=False)
            if check.records or not check.touched:
                errors.append(f"sentinel: records={check.records} touched={check.touched}")
        else:
            step_fn()
        res = got[-1]
        errors += compare(case, res, want, eff, rank, world, cache, meta_g, cache_l, builder)
        return {"errors": errors, "global": res.global_idx.cpu().clone(),
                "mask": res.local_mask.cpu().clone()}
    finally:
        undo()


def compare(case, res, want, eff, rank, world, cache, meta_g, cache_l, builder) -> list[str]:
    errors = []
    gi, li, mask = res.global_idx.cpu(), res.local_idx.cpu(), res.local_mask.cpu()
    inter = case.interleave
    split_g = ref.split_index_k_cache(cache.cpu(), HEAD_DIM)
    split_l = ref.split_index_k_cache(cache_l.cpu(), HEAD_DIM)
    for r in range(gi.shape[0]):
        n = int(eff[r])
        g_row, w_row = gi[r], want[r]
        where = f"{case} row {r} (len {n})"
        if sorted(g_row.tolist()) != sorted(w_row.tolist()):  # the set is the contract
            errors.append(f"{where}: global top-k set {sorted(g_row.tolist())} != {sorted(w_row.tolist())}")
            continue
        valid = g_row >= 0
        if valid.any() and not bool(valid[: int(valid.sum())].all()):
            errors.append(f"{where}: -1 padding before valid entries: {g_row.tolist()}")
        owned = valid & ((g_row // inter) % world == rank)
        if not torch.equal(mask[r], owned):
            errors.append(f"{where}: mask {mask[r].tolist()} != owned {owned.tolist()}")
            continue
        if not torch.equal(li[r] >= 0, owned):
            errors.append(f"{where}: local_idx {li[r].tolist()} where owned is {owned.tolist()}")
            continue
        table_l = builder.block_table_buffer[r].cpu()
        for j in owned.nonzero().flatten().tolist():
            a = _token_bytes(split_g, meta_g.block_table[r], int(g_row[j]))
            b = _token_bytes(split_l, table_l, int(li[r, j]))
            if not torch.equal(a, b):
                errors.append(f"{where}: local index {int(li[r, j])} does not address global "
                              f"position {int(g_row[j])}'s K row")
                break
    return errors


def run_cases(ctx, cases: list[Case], *, sentinel: bool = True) -> list[dict]:
    return [run_case(ctx, c, sentinel=sentinel) for c in cases]


def cross_rank_errors(per_rank: list[list[dict]]) -> list[str]:
    """Every rank's own errors, plus: same global top-k on every rank; masks partition it."""
    errors = []
    for rank, results in enumerate(per_rank):
        for i, res in enumerate(results):
            errors += [f"rank {rank} case {i}: {e}" for e in res["errors"]]
    for i, first in enumerate(per_rank[0]):
        valid = first["global"] >= 0
        owners = torch.zeros_like(valid, dtype=torch.int64)
        for rank, results in enumerate(per_rank):
            if not torch.equal(results[i]["global"], first["global"]):
                errors.append(f"case {i}: rank {rank}'s global top-k differs from rank 0's")
            owners += results[i]["mask"].long()
        if not torch.equal(owners, valid.long()):
            errors.append(f"case {i}: the ranks' masks do not cover each selected token exactly once")
    return errors
