"""Decode scenarios: one per bound path, each a layout plus how its batch's host shadow looks,
and a generator of random batches for it. The audit and the test scenarios both draw from here.

Batches are random but honest: device lengths are exact, the shadow follows the path
(authoritative, optimistic under async speculative decode, DCP-local, or none at all),
``max_seq_len`` bounds every request, and CPU stand-ins for device tensors are copies, never their host twins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import kernels
from .bounds import BoundSource, SeqLenShadow
from .layout import IndexerBackend, IndexerLayout
from .lengths import dcp_localize, kernel_lengths, per_token_lengths_host
from .metadata import DecodeBatch


@dataclass(frozen=True)
class DecodePath:
    """One decode path: a layout plus how the batch's host shadow looks (``shadow=False``: the
    batch has none, only ``max_seq_len``)."""

    name: str
    layout: IndexerLayout
    query_lens: tuple[int, ...]
    authoritative: bool = True
    dcp_local_shadow: bool = False
    capture: bool = False
    expected_source: BoundSource = BoundSource.CPU_EXACT
    shadow: bool = True


def _layout(backend: IndexerBackend, *, ratio: int = 1, world: int = 1, rank: int = 0,
            topk: int = 256) -> IndexerLayout:
    return IndexerLayout(backend=backend, compress_ratio=ratio, dcp_world_size=world, dcp_rank=rank,
                         page_size=64, topk=topk, num_heads=64, head_dim=128, max_model_len=8192)


B12X, DG = IndexerBackend.B12X, IndexerBackend.DEEPGEMM
S = BoundSource

PATHS: tuple[DecodePath, ...] = (
    DecodePath("b12x-compressed", _layout(B12X, ratio=4, topk=128), (1, 1, 1, 1),
               expected_source=S.ACTIVE_WIDTH),
    DecodePath("b12x-uncompressed", _layout(B12X), (1, 1, 1, 1), expected_source=S.CPU_EXACT),
    DecodePath("b12x-uncompressed-dcp2", _layout(B12X, world=2, rank=1), (1, 1, 1),
               dcp_local_shadow=True, expected_source=S.CPU_DCP_LOCAL),
    DecodePath("b12x-uncompressed-async-spec", _layout(B12X), (3, 3, 3), authoritative=False,
               expected_source=S.ACTIVE_WIDTH),
    DecodePath("deepgemm-compressed", _layout(DG, ratio=4, topk=128), (1, 1, 1, 1),
               expected_source=S.METADATA_UPPER_BOUND),
    DecodePath("deepgemm-uncompressed", _layout(DG), (1, 1, 1, 1), expected_source=S.CPU_EXACT),
    DecodePath("deepgemm-uncompressed-async-spec", _layout(DG), (2, 2, 2), authoritative=False,
               expected_source=S.METADATA_UPPER_BOUND),
    DecodePath("deepgemm-uncompressed-no-shadow", _layout(DG), (1, 1, 1), shadow=False,
               expected_source=S.METADATA_UPPER_BOUND),
    DecodePath("mtp-ragged", _layout(B12X), (1, 4, 2, 3), expected_source=S.CPU_EXACT),
    DecodePath("capture", _layout(DG), (1, 1, 1, 1), capture=True,
               expected_source=S.CAPTURE_STABLE),
)

@dataclass
class Case:
    batch: DecodeBatch
    true_lens: list[int]
    kernel_rows: list[int]


def make_case(path: DecodePath, device: torch.device | str, gen: torch.Generator) -> Case:
    """A random decode batch for ``path``; device lengths exact, the shadow per the path."""
    lay = path.layout
    n = len(path.query_lens)
    max_seq_len = int(torch.randint(lay.max_model_len // 4, lay.max_model_len // 2, (1,), generator=gen))
    true_lens = [int(torch.randint(max(q, max_seq_len // 8), max_seq_len + 1, (1,), generator=gen))
                 for q in path.query_lens]
    if path.authoritative:
        true_lens[0] = max_seq_len  # the scheduler's bound is the exact max when exact
    shadow_lens = list(true_lens)
    if not path.authoritative:  # optimistic: every draft accepted
        shadow_lens = [min(t + q - 1, max_seq_len) for t, q in zip(true_lens, path.query_lens)]
        true_lens = [max(s - (q - 1) * (i % 2), q) for i, (s, q)
                     in enumerate(zip(shadow_lens, path.query_lens))]
    starts = [0]
    for q in path.query_lens:
        starts.append(starts[-1] + q)
    qsl_cpu = torch.tensor(starts, dtype=torch.int32)
    per_token = per_token_lengths_host(true_lens, list(path.query_lens))
    rows = [kernel_lengths(t, lay.compress_ratio, lay.dcp_world_size, lay.dcp_rank, lay.cp_interleave)
            for t in per_token]
    bound_rows = kernel_lengths(max_seq_len, lay.compress_ratio, lay.dcp_world_size, lay.dcp_rank,
                                lay.cp_interleave) + 1
    pages = math.ceil(bound_rows / lay.page_size) + 1
    block_table = torch.full((n, pages), -1, dtype=torch.int32)
    perm = torch.randperm(n * pages, generator=gen).to(torch.int32)
    for i, length in enumerate(true_lens):
        live = math.ceil(kernel_lengths(length, lay.compress_ratio, lay.dcp_world_size, lay.dcp_rank,
                                        lay.cp_interleave) / lay.page_size)
        block_table[i, :live] = perm[i * pages: i * pages + live]
    local = None
    if path.dcp_local_shadow:
        local = torch.tensor([dcp_localize(s, lay.dcp_world_size, lay.dcp_rank, lay.cp_interleave)
                              for s in shadow_lens], dtype=torch.int32)
    shadow = (SeqLenShadow(torch.tensor(shadow_lens, dtype=torch.int32), path.authoritative, local)
              if path.shadow else None)
    # copy=True: a CPU stand-in for a device tensor is never its host twin itself
    batch = DecodeBatch(
        query_start_loc=qsl_cpu.to(device, copy=True),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=torch.tensor(true_lens, dtype=torch.int32).to(device, copy=True),
        shadow=shadow,
        block_table=block_table.to(device, copy=True),
        max_seq_len=max_seq_len,
    )
    return Case(batch, true_lens, rows)




NAMES = tuple(p.name for p in PATHS)


def path_named(name: str) -> DecodePath:
    """The scenario ``name``; a ValueError listing the known ones otherwise."""
    for p in PATHS:
        if p.name == name:
            return p
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(NAMES)}")


@dataclass
class StepInputs:
    """The indexer's per-row inputs for a batch: fp8 queries, head weights, a filled K cache."""

    q_fp8: torch.Tensor
    weights: torch.Tensor
    k_cache: torch.Tensor


def make_step_inputs(path: DecodePath, case: Case, device: torch.device | str,
                     gen: torch.Generator) -> StepInputs:
    """Random queries and weights for every decode row, and a K cache with a key in every slot
    the batch's block table can name."""
    lay = path.layout
    n_rows = len(case.kernel_rows)
    q = torch.randn(n_rows, lay.num_heads, lay.head_dim, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(n_rows, lay.num_heads, generator=gen)
    pages_total = case.batch.block_table.numel()
    k = torch.randn(pages_total * lay.page_size, lay.head_dim, generator=gen)
    k8, ks = kernels.quantize_index_k(k)
    cache = torch.zeros(pages_total, lay.page_size * (lay.head_dim + 4), dtype=torch.uint8)
    kernels.write_index_k_cache(cache, k8, ks, torch.arange(k.shape[0], dtype=torch.int64))
    return StepInputs(q.to(device), w.to(device), cache.to(device))
