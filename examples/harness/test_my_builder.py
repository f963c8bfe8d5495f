"""Proving a builder sync-free with the harness (run: pytest examples/harness).

On a CPU host the sentinel layer stands the watched tensors in for device tensors; on a GPU host
every CUDA layer runs too. `device_tensors` collects what to watch from the objects themselves.
"""

from __future__ import annotations

import pytest
import torch
from my_builder import MyDecodeMetadataBuilder

from vllm_sparse_sync.testing import HostSyncError, device_tensors

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n: int = 4):
    seq_lens_cpu = torch.randint(1, 4096, (n,), dtype=torch.int32)
    return seq_lens_cpu.to(DEVICE, copy=True), seq_lens_cpu


def test_builder_is_sync_free(no_host_sync):
    builder = MyDecodeMetadataBuilder(8, DEVICE)
    seq_lens, seq_lens_cpu = _inputs()
    builder.build(seq_lens, seq_lens_cpu)  # warm up outside the check
    with no_host_sync(watch=device_tensors(builder, seq_lens)):
        _, width = builder.build(seq_lens, seq_lens_cpu)
    assert width == int(seq_lens_cpu.max())


def test_the_harness_catches_the_careless_builder(no_host_sync):
    builder = MyDecodeMetadataBuilder(8, DEVICE, careless=True)
    seq_lens, seq_lens_cpu = _inputs()
    builder.build(seq_lens, seq_lens_cpu)
    with pytest.raises(HostSyncError, match="reads the device buffer back"):
        with no_host_sync(watch=device_tensors(builder, seq_lens)):
            builder.build(seq_lens, seq_lens_cpu)
