"""One decode token per request for step tests: a K cache, q and weights, live lengths on the
device with their host shadow, and the ``DecodeBatch`` a builder builds from them."""

from __future__ import annotations

import torch

from vllm_sparse_sync import DecodeBatch, SeqLenShadow
from vllm_sparse_sync.kernels.synth import make_case


class DecodeRows:
    """``rows`` requests of one token each, ``max_len`` tokens at most (pages of 64), on ``device``."""

    def __init__(self, rows: int, max_len: int, *, seed: int, device: str) -> None:
        self.max_len = max_len
        self.case = make_case([max_len] * rows, heads=64, table_pages=max_len // 64, device=device, seed=seed)
        self.q = torch.randn(rows, 64, 128, device=device).to(torch.float8_e4m3fn)
        self.w = torch.randn(rows, 64, device=device)
        self.qsl = torch.arange(rows + 1, dtype=torch.int32)
        self.qsl_dev = self.qsl.to(device)
        self.seq = torch.randint(1, max_len + 1, (rows,), dtype=torch.int32, device=device)
        self.shadow = SeqLenShadow(self.seq.cpu())

    def batch(self) -> DecodeBatch:
        return DecodeBatch(self.qsl_dev, self.qsl, self.seq, self.shadow, self.case.block_table, self.max_len)

    def set_lengths(self, lens: torch.Tensor) -> None:
        """New live lengths, on the device and in the host shadow (as a serving loop writes them)."""
        self.seq.copy_(lens)
        self.shadow.seq_lens_cpu.copy_(lens)
