"""vLLM's real `DeepseekV32IndexerMetadataBuilder` on the smallest config stand-ins that work."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
from vllm.config import AttentionConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.v1.attention.backends.mla import indexer
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder
from vllm.v1.kv_cache_interface import MLAAttentionSpec

STATES_PER_BLOCK = 64  # indexer cache blocks hold 64 (compressed) states
INDEX_ENTRY_BYTES = 132  # 128 fp8 key bytes and a 4-byte scale per state


@dataclass(frozen=True)
class ModelConfigStandIn:
    """`ModelConfig` as the builder reads it on CPU and CUDA platforms: `max_model_len`, for the
    prefill workspace (indexer.py:917). A real `ModelConfig` needs a Hugging Face config; its
    other reads (`architectures`, `hf_config`, indexer.py:76,952) happen only on ROCm."""

    max_model_len: int


@dataclass(frozen=True)
class SpeculativeConfigStandIn:
    """`SpeculativeConfig` as the builder reads it: `num_speculative_tokens` (next_n,
    indexer.py:1024; also `VllmConfig.num_speculative_tokens`, config/vllm.py:612) and
    `enable_adaptive_verification` (indexer.py:977,1183). A real one needs a draft model."""

    num_speculative_tokens: int
    enable_adaptive_verification: bool = False


@dataclass(frozen=True)
class DcpGroupStandIn:
    """What the builder reads of `get_dcp_group()`: this rank's index (indexer.py:1007)."""

    rank_in_group: int
    world_size: int


@contextmanager
def dcp_group(rank: int, world_size: int) -> Iterator[DcpGroupStandIn]:
    """Make the indexer module's `get_dcp_group()` return a stand-in; restored on exit."""
    group = DcpGroupStandIn(rank_in_group=rank, world_size=world_size)
    with mock.patch.object(indexer, "get_dcp_group", lambda: group):
        yield group


def indexer_spec(compress_ratio: int = 1) -> MLAAttentionSpec:
    """The indexer K cache's spec: 64 states of 132 bytes per block, `compress_ratio` tokens each."""
    return MLAAttentionSpec(block_size=STATES_PER_BLOCK * compress_ratio, num_kv_heads=1,
                            head_size=INDEX_ENTRY_BYTES, dtype=torch.uint8,
                            tokens_per_state=compress_ratio)


def make_vllm_config(*, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                     num_speculative_tokens: int = 0, dcp_world_size: int = 1,
                     dcp_interleave: int = 1) -> VllmConfig:
    """A real `VllmConfig` (scheduler, parallel and attention configs) with stand-ins for the
    model and speculative configs, which cannot be built without model files.

    `ParallelConfig` needs a tensor-parallel size divisible by the DCP size; the builder reads
    TP only to decide CUDA-only prefill row sharding. The attention config's prefill workspace
    factor is asserted at indexer.py:919.
    """
    config = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                         max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                         is_encoder_decoder=False),
        parallel_config=ParallelConfig(tensor_parallel_size=dcp_world_size,
                                       decode_context_parallel_size=dcp_world_size,
                                       cp_kv_cache_interleave_size=dcp_interleave),
        attention_config=AttentionConfig(sparse_mla_prefill_workspace_factor=5),
    )
    config.model_config = ModelConfigStandIn(max_model_len)  # type: ignore[assignment]
    if num_speculative_tokens:
        config.speculative_config = SpeculativeConfigStandIn(num_speculative_tokens)  # type: ignore[assignment]
    return config


def make_builder(config: VllmConfig, *, compress_ratio: int = 1, dcp_rank: int = 0,
                 device: torch.device | str = "cpu") -> DeepseekV32IndexerMetadataBuilder:
    """vLLM's builder for one indexer layer, its block table as wide as `max_model_len` needs."""
    spec = indexer_spec(compress_ratio)
    width = -(-config.model_config.max_model_len // spec.block_size)
    with dcp_group(dcp_rank, config.parallel_config.decode_context_parallel_size):
        return DeepseekV32IndexerMetadataBuilder(spec, ["model.layers.0.self_attn.indexer"], config,
                                                 torch.device(device), block_table_width=width)
