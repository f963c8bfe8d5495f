"""A user's decode-metadata builder, the kind the harness is for: it keeps persistent buffers
and decides the kernel's width on the host. `careless=True` reads the width back from the
device, the one-line regression that costs a serving stack tokens per second."""

from __future__ import annotations

import torch


class MyDecodeMetadataBuilder:
    def __init__(self, max_reqs: int, device: str, *, careless: bool = False):
        self.careless = careless
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)  # persistent
        self.cu_seq_lens = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)

    def build(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor) -> tuple[torch.Tensor, int]:
        n = seq_lens.shape[0]
        self.seq_lens[:n].copy_(seq_lens)
        torch.cumsum(self.seq_lens[:n], 0, out=self.cu_seq_lens[1 : n + 1])
        if self.careless:
            width = int(self.seq_lens[:n].max().item())  # reads the device buffer back
        else:
            width = int(seq_lens_cpu.max())  # the host shadow: no sync
        return self.cu_seq_lens[: n + 1], width
