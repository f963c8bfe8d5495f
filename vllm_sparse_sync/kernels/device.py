"""Host queries of a device for the planner (``DeviceInfo``): SMs, cooperative launches, the CUDA
routes' availability and shared memory. Made once, outside capture."""

from __future__ import annotations

import os
from functools import cache

import torch

from .config import KernelConfig
from .planner import DeviceInfo


@cache
def device_sm_count(device: str) -> int:
    """Streaming multiprocessors of a CUDA device (host query, cached); 4 elsewhere (interpreter)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 4


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (programs one after another)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@cache
def cooperative_launch_supported() -> bool:
    """Whether this Triton can launch a grid cooperatively (all programs resident, or an error)."""
    if interpreting():
        return True  # the fused step then runs as phase launches, with no barriers to wait on
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - not an NVIDIA build of Triton
        return False
    return "launch_cooperative_grid" in CUDAOptions.__dataclass_fields__


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_scorer_ok(device: torch.device) -> bool:
    """Whether the CUDA scorer can run on ``device`` (a host query)."""
    if device.type != "cuda" or interpreting():
        return False
    from .cuda.scorer import status

    return status(_index(device))[0]


def cuda_topk_status(device: torch.device) -> tuple[bool, str]:
    """Whether the CUDA top-k can run on ``device``, and why not."""
    if device.type != "cuda" or interpreting():
        return False, f"device {device} is not a CUDA device"
    from .cuda.topk import status

    return status(device)


def device_info(device: torch.device | str, config: KernelConfig, fused_ctas_per_sm: int | None = None,
                num_sms: int | None = None) -> DeviceInfo:
    """What the planner needs of ``device`` under ``config`` (the CUDA routes are asked about only
    where ``config.cuda`` allows them: that imports cuda-bindings and may compile a module;
    ``num_sms`` overrides the device's SM count)."""
    device = torch.device(device)
    cooperative = interpreting() or (device.type == "cuda" and cooperative_launch_supported())
    sms = device_sm_count(str(device)) if num_sms is None else num_sms
    if not config.cuda:
        return DeviceInfo(sms, cooperative, fused_ctas_per_sm)
    cuda_topk = cuda_topk_status(device)[0]
    cluster_smem = smem_per_sm = 0
    cluster16 = False
    if cuda_topk:
        from .cuda import topk as cuda_topk_mod

        index = _index(device)
        cluster_smem = cuda_topk_mod.cluster_smem_limit(index)
        if cluster_smem > 0:
            smem_per_sm = cuda_topk_mod.smem_per_sm(index)
            cluster16 = cuda_topk_mod.module_for(index).cluster16
    return DeviceInfo(sms, cooperative, fused_ctas_per_sm, cuda_topk, cluster_smem, smem_per_sm, cluster16,
                      cuda_scorer=cuda_scorer_ok(device))


SM90_SMEM_PER_SM = 228 * 1024
"""an sm_90 SM's shared memory (H100, H200)"""
SM90_CLUSTER_SMEM = 227 * 1024 - 1536
"""what a cluster top-k CTA may use there: the opt-in limit less the kernel's static share"""


def sm90_device_info(num_sms: int) -> DeviceInfo:
    """An sm_90 device of ``num_sms`` SMs with NVRTC (H100, H200: 132): what a plan for one takes
    where there is none (``vllm-sparse-sync plan --sm90 132`` on any host)."""
    return DeviceInfo(num_sms, cooperative=True, cuda_topk=True, cluster_smem=SM90_CLUSTER_SMEM,
                      smem_per_sm=SM90_SMEM_PER_SM, cluster16=True, cuda_scorer=True)
