"""Real vLLM indexer batches, one per path vLLM 0.33's builder has: `make_vllm_case(path)`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.indexer import (
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerMetadataBuilder,
)
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens, split_decodes_and_prefills

from .builder import dcp_group, make_builder, make_vllm_config

PAD_SLOT = -1  # vLLM's PAD_SLOT_ID
MAX_PREFILL_QUERY = 32  # prefill rows stay short: vLLM's prefill Triton kernels run interpreted
MAX_PREFILL_CONTEXT = 512


@dataclass(frozen=True)
class _Path:
    kind: str  # decode | padded | ragged | prefill | mixed
    num_spec: int = 0
    compress_ratio: int = 1
    dcp_world_size: int = 1
    dcp_rank: int = 0


_PATHS = {
    "decode": _Path("decode"),
    "decode-cudagraph-padded": _Path("padded"),
    "mtp-native-uniform": _Path("decode", num_spec=1),
    "mtp-native-ragged": _Path("ragged", num_spec=1),
    "mtp-flattened-uniform": _Path("decode", num_spec=3),
    "mtp-flattened-ragged": _Path("ragged", num_spec=3),
    "dcp2-rank0": _Path("decode", dcp_world_size=2, dcp_rank=0),
    "dcp2-rank1": _Path("decode", dcp_world_size=2, dcp_rank=1),
    "dcp2-mtp": _Path("decode", num_spec=1, dcp_world_size=2, dcp_rank=1),
    "compressed-c4": _Path("decode", compress_ratio=4),
    "prefill": _Path("prefill"),
    "mixed-decode-prefill": _Path("mixed"),
    "dcp2-prefill": _Path("prefill", dcp_world_size=2, dcp_rank=0),
}

VLLM_PATHS: tuple[str, ...] = tuple(_PATHS)
"""Every path of vLLM 0.33's `DeepseekV32IndexerMetadataBuilder.build()` that a CPU host reaches
(all those named here are reached by vLLM's own code, nothing emulated).

- decode: one token per request (native). decode-cudagraph-padded: the runner's FULL-graph
  padding (gpu_model_runner.py:2033-2037, 2146, 2309): zero-length padding requests, and
  ``num_actual_tokens`` counting the padding.
- mtp-native-*: one speculative token (next_n 2 is native off DeepGEMM, indexer.py:958).
  Ragged query lengths (1 and 2) are split by vLLM itself (backends/utils.py:879-906): rows
  from the first one unlike row 0 take the prefill branch, so its decode rows stay uniform.
- mtp-flattened-*: three speculative tokens (next_n 4 has no native kernel off DeepGEMM, so
  vLLM flattens, indexer.py:972); uniform runs the Triton uniform kernel, ragged the variable
  branch (indexer.py:1189-1252).
- dcp2-*: decode context parallelism over 2 ranks (interleave 1), rank set by `dcp_group`.
- compressed-c4: a DeepSeek-V4 C4 indexer layer (4 tokens per state).
- prefill, mixed-decode-prefill, dcp2-prefill: the prefill branch (chunks, Triton metadata).

The paths in :data:`UNREACHABLE_PATHS` cannot be reached on a CPU host; `make_vllm_case`
refuses them with the reason.
"""

UNREACHABLE_PATHS: dict[str, str] = {
    "sm100-varlen": "the varlen decode branch (indexer.py:1666) runs only where "
                    "_supports_varlen_paged_mqa_logits() holds (indexer.py:930): CUDA SM100 with DeepGEMM",
    "deepgemm-schedule": "DeepGEMM schedule metadata is built only when current_platform.is_cuda() and "
                         "has_deep_gemm() (indexer.py:1746)",
    "pcp": "prefill context parallelism needs a real PCP process group: get_pcp_group().rank_in_group "
           "(indexer.py:1010) and get_pcp_group().all_gather (indexer.py:1455)",
}


class UnreachablePath(RuntimeError):
    """A vLLM path that this vLLM version cannot take on this host."""


@dataclass(frozen=True, eq=False)
class VllmIndexerCase:
    """One batch for vLLM's builder, with the host facts that give its exact kernel-row maximum.

    Lengths are per request (padding requests: 0), in global uncompressed tokens. The host's
    optimistic lengths equal the true ones (no async speculative decoding).
    """

    path: str
    builder: DeepseekV32IndexerMetadataBuilder
    common: CommonAttentionMetadata
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_decodes: int  # vLLM's own split of this batch (backends/utils.py:837)
    compress_ratio: int
    dcp_world_size: int
    dcp_rank: int
    dcp_interleave: int  # tokens
    max_model_len: int

    def watch(self) -> list[torch.Tensor]:
        """Every device-standing tensor of this case's builder and batch (`vllm_watch`)."""
        from .watch import vllm_watch

        return vllm_watch(self)

    def build(self) -> DeepseekV32IndexerMetadata:
        """vLLM's `build()` on this batch (under the DCP group stand-in where DCP is on)."""
        if self.dcp_world_size == 1:
            return self.builder.build(common_prefix_len=0, common_attn_metadata=self.common)
        with dcp_group(self.dcp_rank, self.dcp_world_size):
            return self.builder.build(common_prefix_len=0, common_attn_metadata=self.common)


def _lengths(p: _Path, batch: int, rng: np.random.Generator,
             max_model_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(query_lens, seq_lens, padded requests) of the path's batch."""
    next_n = 1 + p.num_spec
    if p.kind in ("ragged", "mixed") and batch < 2:
        raise ValueError(f"a {p.kind} batch needs batch >= 2, got {batch}")
    if p.kind in ("decode", "padded"):
        q = np.full(batch, next_n)
    elif p.kind == "ragged":
        q = rng.integers(1, next_n + 1, size=batch)
        q[0], q[1] = next_n, 1  # never uniform
        q[1:] = rng.permutation(q[1:])
    else:
        q = rng.integers(2, MAX_PREFILL_QUERY + 1, size=batch)
        if p.kind == "mixed":
            q[: batch // 2] = 1
    ctx = np.where(q > next_n, rng.integers(0, MAX_PREFILL_CONTEXT + 1, size=batch),
                   rng.integers(0, max_model_len - next_n + 1, size=batch))
    pad = (1 << batch.bit_length()) - batch if p.kind == "padded" else 0  # up to a graph size
    zeros = np.zeros(pad, np.int64)
    return np.concatenate([q, zeros]), np.concatenate([ctx + q, zeros]), pad


def _host_layout(query_lens: np.ndarray, seq_lens: np.ndarray, width: int, block: int, p: _Path,
                 interleave: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host block table, slot mapping and positions for the batch (vLLM's runner layout)."""
    n = len(query_lens)
    block_table = np.zeros((n, width), np.int32)
    live = seq_lens > 0
    block_table[live] = 1 + rng.permutation(int(live.sum()) * width).reshape(-1, width)  # 0: null block
    slots, positions = [], []
    span = interleave * p.dcp_world_size
    for r, (q, length) in enumerate(zip(query_lens, seq_lens)):
        pos = np.arange(length - q, length)
        local = (pos // span) * interleave + pos % interleave
        owned = (pos // interleave) % p.dcp_world_size == p.dcp_rank
        slot = block_table[r, local // block].astype(np.int64) * block + local % block
        slots.append(np.where(owned, slot, PAD_SLOT))
        positions.append(pos)
    return block_table, np.concatenate(slots), np.concatenate(positions)


def make_vllm_case(path: str, *, batch: int = 4, seed: int = 0, device: torch.device | str = "cpu",
                   max_model_len: int = 4096) -> VllmIndexerCase:
    """vLLM's builder and a `CommonAttentionMetadata` batch of `batch` requests on `path`.

    Device fields live on `device` and are never the storage of their `_cpu` twins.
    """
    if path in UNREACHABLE_PATHS:
        raise UnreachablePath(f"path {path!r} cannot be reached on a CPU host: {UNREACHABLE_PATHS[path]}")
    if path not in _PATHS:
        raise ValueError(f"path: unknown {path!r}; vLLM paths: {', '.join(VLLM_PATHS)}")
    if batch < 1:
        raise ValueError(f"batch: must be >= 1, got {batch}")
    p = _PATHS[path]
    rng = np.random.default_rng(seed)
    query_lens, seq_lens, pad = _lengths(p, batch, rng, max_model_len)
    num_tokens = int(query_lens.sum()) + pad * (1 + p.num_spec)  # padding rows count as tokens
    config = make_vllm_config(max_model_len=max_model_len, max_num_seqs=max(256, len(seq_lens)),
                              max_num_batched_tokens=max(2048, num_tokens),
                              num_speculative_tokens=p.num_spec, dcp_world_size=p.dcp_world_size)
    interleave = config.parallel_config.cp_kv_cache_interleave_size
    builder = make_builder(config, compress_ratio=p.compress_ratio, dcp_rank=p.dcp_rank, device=device)
    width = builder.expanded_block_table_buffer.shape[1]
    block_table, slots, positions = _host_layout(query_lens, seq_lens, width,
                                                 builder.kv_cache_spec.block_size, p, interleave, rng)
    slots = np.concatenate([slots, np.full(num_tokens - len(slots), PAD_SLOT)])
    positions = np.concatenate([positions, np.zeros(num_tokens - len(positions), np.int64)])

    def host(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(np.asarray(a), dtype=dtype)

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:  # its own storage, never the twin's
        return torch.tensor(np.asarray(a), dtype=dtype, device=device)

    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    real = seq_lens[:batch]
    common = CommonAttentionMetadata(
        query_start_loc=dev(qsl, torch.int32), query_start_loc_cpu=host(qsl, torch.int32),
        seq_lens=dev(seq_lens, torch.int32), seq_lens_cpu_upper_bound=host(seq_lens, torch.int32),
        num_reqs=len(seq_lens), num_actual_tokens=num_tokens, max_query_len=int(query_lens.max()),
        max_seq_len=int(real.max()),  # gpu_model_runner.py:2290: optimistic host lengths, real rows
        block_table_tensor=dev(block_table, torch.int32), slot_mapping=dev(slots, torch.int64),
        positions=dev(positions, torch.int64),
    )
    if p.dcp_world_size > 1:  # gpu_model_runner.py:2376-2389
        local = get_dcp_local_seq_lens(host(seq_lens, torch.int32), p.dcp_world_size, p.dcp_rank, interleave)
        common.dcp_local_seq_lens = dev(local.numpy(), torch.int32)
        common.dcp_local_seq_lens_cpu_upper_bound = local
    num_decodes = split_decodes_and_prefills(
        common, decode_threshold=builder.decode_threshold,
        require_uniform=not (builder.use_flattening or builder.supports_varlen),
        treat_short_extends_as_decodes=not builder.use_pcp)[0]
    return VllmIndexerCase(path, builder, common, tuple(int(x) for x in seq_lens),
                           tuple(int(x) for x in query_lens), num_decodes, p.compress_ratio,
                           p.dcp_world_size, p.dcp_rank, interleave, max_model_len)
