"""Watch lists for vLLM's objects: every device-standing tensor of a case, builder or batch."""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from ..testing.watch import WatchList, device_tensors
from .cases import VllmIndexerCase

# CommonAttentionMetadata fields that vLLM 0.33's runner fills with host tensors although their
# names carry no `cpu`: `is_prefilling` (gpu_model_runner.py:2327) and `rswa_prefix_lens`
# (gpu_model_runner.py:2355). Watching them would flag vLLM's legitimate host reads.
HOST_FIELDS = ("is_prefilling", "rswa_prefix_lens")


def vllm_watch(*objs: object, depth: int = 3) -> WatchList:
    """Every device-standing tensor of `objs` (cases count as their builder and batch): the
    non-`_cpu` tensor fields of `CommonAttentionMetadata`, the builder's tensor attributes and
    buffers, and tensors inside helper objects (a `CpuGpuBuffer`'s `.gpu`, not `.cpu`/`.np`).

    A device field passed as its host twin itself (``query_start_loc_cpu=query_start_loc``, as
    vLLM's tests on the CPU do) is left out and named in the result's `unwatched`.
    """
    expanded = [x for o in objs for x in ((o.builder, o.common) if isinstance(o, VllmIndexerCase) else (o,))]
    host = {id(t) for o in expanded if isinstance(o, CommonAttentionMetadata)
            for name in HOST_FIELDS if isinstance(t := getattr(o, name, None), torch.Tensor)}
    found = device_tensors(*expanded, depth=depth)
    out = WatchList(t for t in found if id(t) not in host)
    out.unwatched = found.unwatched
    return out
