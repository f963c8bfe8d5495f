"""The DCP merge + remap in CUDA (``dcp_merge_p*`` of ``topk.cu``, compiled with the CUDA
top-k by NVRTC): one CTA of 1024 threads per row holds the row's ``world * k_local`` gathered
keys in registers and selects the exact global top-k by radix passes of 11 bits that stop once
the k-th key's bin is resolved.

Same output as ``dcp.merge_candidate_keys`` + ``dcp.global_to_local`` (and the Triton
``dcp_merge``), element for element; rows of up to ``MAX_KEYS`` keys (world 8 at k 2048). Static
shapes, no host reads, launched on torch's current stream: capturable. ``topk_emu.dcp_merge_row``
is the CPU specification of the kernel's passes.
"""

from __future__ import annotations

import ctypes

import torch

from . import topk as cuda_topk

THREADS = 1024
KEYS_PER_THREAD = (1, 2, 4, 8, 16)
MAX_KEYS = THREADS * KEYS_PER_THREAD[-1]


def keys_per_thread(world: int, k_local: int) -> int | None:
    """Keys each thread holds for rows of ``world * k_local`` keys (None: more than ``MAX_KEYS``)."""
    n = world * k_local
    for per in KEYS_PER_THREAD:
        if n <= THREADS * per:
            return per
    return None


def merge_fits(world: int, k_local: int) -> bool:
    return keys_per_thread(world, k_local) is not None


def status(device: torch.device | str | int | None = None) -> tuple[bool, str]:
    """Whether the CUDA merge can run on ``device``, and why not (the CUDA top-k's status)."""
    return cuda_topk.status(device)


def cuda_dcp_merge(gathered: torch.Tensor, k: int, global_idx: torch.Tensor, local_idx: torch.Tensor,
                   local_mask: torch.Tensor, *, world: int, rank: int, interleave: int) -> None:
    """Merge + remap of gathered keys ``int64 [world, rows, k_local]`` (CUDA) into the caller's
    ``[rows, k]`` buffers (``global_idx`` / ``local_idx`` int32, ``local_mask`` bool): what
    ``dcp.merge_candidate_keys``, ``dcp.global_to_local`` and ``>= 0`` write."""
    from ...dcp import check_merge_buffers

    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k < 2**31:
        raise ValueError(f"cuda_dcp_merge: k must be a positive int32, got {k!r}")
    rows, k_local = check_merge_buffers("cuda_dcp_merge", gathered, world, k, global_idx, local_idx,
                                        local_mask)
    if not 0 <= rank < world or isinstance(interleave, bool) or interleave < 1:
        raise ValueError(f"cuda_dcp_merge: rank {rank} must be in [0, {world}) and interleave "
                         f"{interleave} >= 1")
    per = keys_per_thread(world, k_local)
    if per is None:
        raise ValueError(f"cuda_dcp_merge: {world} x {k_local} keys per row exceed MAX_KEYS={MAX_KEYS} "
                         f"(take the torch merge)")
    if rows == 0:
        return
    if rows > 2**31 - 1:
        raise ValueError(f"cuda_dcp_merge: {rows} rows exceed the grid")
    dev = gathered.device
    mod = cuda_topk.module_for(dev.index if dev.index is not None else torch.cuda.current_device())
    fn = mod.function(f"dcp_merge_p{per}", 0)
    values = (
        ctypes.c_void_p(gathered.data_ptr()),
        ctypes.c_longlong(gathered.stride(0)),
        ctypes.c_longlong(gathered.stride(1)),
        ctypes.c_int(world),
        ctypes.c_int(k_local),
        ctypes.c_int(k),
        ctypes.c_int(interleave),
        ctypes.c_int(rank),
        ctypes.c_void_p(global_idx.data_ptr()),
        ctypes.c_void_p(local_idx.data_ptr()),
        ctypes.c_void_p(local_mask.data_ptr()),
        ctypes.c_longlong(global_idx.stride(0)),
    )
    cuda_topk.launch_values(mod, fn, (rows, 1, 1), THREADS, 0, values, dev)
