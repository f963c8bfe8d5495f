"""The scorer's launch: the CUDA wgmma kernel (``cuda_scorer``) where the route says so and the
call's tensors fit it, the Triton kernel (``triton_scorer``) otherwise. Both write the same
scores (the exact path to fp32 rounding; the e4m3 path to its tensor cores' accumulation)."""

from __future__ import annotations

import torch

from .route import CUDA, TRITON
from .workspace import interpreting


def cuda_scorer_ok(device: torch.device) -> bool:
    """Whether the CUDA scorer can run on ``device`` (a host query, cached per device)."""
    if device.type != "cuda" or interpreting():
        return False
    from .cuda.scorer import status

    return status(device.index if device.index is not None else torch.cuda.current_device())[0]


def scorer_kind(rows: int, page: int, device: torch.device, config, width: int = 0) -> str:
    """The kernel ``route.scorer_for`` picks for a call of ``rows`` rows and width bound ``width``
    on ``device`` (``config``: a ``KernelConfig``)."""
    from .route import DeviceInfo, scorer_for

    return scorer_for(rows, page, DeviceInfo(1, cuda_scorer=cuda_scorer_ok(device)), config, width)


def launch_score(q_fp8, weights, k_cache, block_table, row_lens, active, out, *, page_size, sel_width,
                 fill_width, splits, config, kind: str, counts: torch.Tensor | None = None) -> str:
    """Score ``out`` (arguments as ``triton_scorer.launch_score``; ``config``: a ``ScorerConfig``)
    with the ``kind`` of kernel the route chose (``route.scorer_for``); a call the CUDA kernel is
    not built for runs on Triton. ``counts``: where the CUDA kernel runs, its counts build also
    writes the top-k's pass-A counts there (``cuda_scorer.launch_cuda_score``); Triton leaves them.
    Returns the kind run."""
    if kind == CUDA:
        from .cuda import scorer as cuda_scorer

        if cuda_scorer.takes(q_fp8, k_cache, block_table, page_size, splits):
            cuda_scorer.launch_cuda_score(q_fp8, weights, k_cache, block_table, row_lens, active, out,
                                          page_size=page_size, sel_width=sel_width, fill_width=fill_width,
                                          splits=splits, config=config, counts=counts)
            return CUDA
    from .triton.scorer import launch_score as launch_triton_score

    launch_triton_score(q_fp8, weights, k_cache, block_table, row_lens, active, out, page_size=page_size,
                        sel_width=sel_width, fill_width=fill_width, splits=splits, config=config)
    return TRITON
