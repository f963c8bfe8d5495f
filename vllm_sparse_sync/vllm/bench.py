"""Host time of vLLM's `build()` per call: ``python -m vllm_sparse_sync.vllm.bench [PATH]``."""

from __future__ import annotations

import statistics
import sys
import time

from .cases import VllmIndexerCase, make_vllm_case


def time_build(case: VllmIndexerCase, *, calls: int = 200, warmup: int = 20) -> float:
    """Median seconds of one `builder.build()` call on `case`, after `warmup` calls."""
    build, common = case.builder.build, case.common
    for _ in range(warmup):
        build(common_prefix_len=0, common_attn_metadata=common)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        build(common_prefix_len=0, common_attn_metadata=common)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = args[0] if args else "decode"
    for batch in (1, 8, 64):
        us = time_build(make_vllm_case(path, batch=batch)) * 1e6
        print(f"{path} batch={batch}: {us:.1f} us per build() (median of 200, 20 warm-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
