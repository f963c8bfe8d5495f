"""The decode top-k bound vLLM 0.33 passes for a batch, and the exact kernel-row maximum."""

from __future__ import annotations

import numpy as np

from ..lengths import kernel_lengths, per_token_lengths_host
from .cases import VllmIndexerCase


def vllm_bound(case: VllmIndexerCase, *, capture: bool = False) -> int:
    """The bound vLLM's decode top-k gets: the metadata's `max_seq_len`
    (sparse_attn_indexer.py:927-934), which the runner sets to the longest optimistic host
    length of the batch, or to `max_model_len` while capturing a CUDA graph
    (gpu_model_runner.py:2284-2290). Global uncompressed tokens, on compressed and DCP layers
    too, whose kernel rows are shorter."""
    return case.max_model_len if capture else int(case.common.max_seq_len)


def exact_kernel_max(case: VllmIndexerCase) -> int:
    """The longest decode row the kernels see: per decode token ``L - q + 1 + j``, compressed
    by the layer's ratio, localized to this DCP rank; 0 when the batch has no decode rows."""
    n = case.num_decodes
    rows = np.asarray(per_token_lengths_host(list(case.seq_lens[:n]), list(case.query_lens[:n])), np.int64)
    if rows.size == 0:
        return 0
    ratio = case.compress_ratio
    interleave = case.dcp_interleave // ratio if case.dcp_world_size > 1 else case.dcp_interleave
    return int(kernel_lengths(rows, ratio, case.dcp_world_size, case.dcp_rank, interleave).max())
