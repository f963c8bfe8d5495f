"""Plant a shared-ring bug (one ring for every consumer) in a copy of the checkout, to see the scorer's GPU tests fail.

    python scripts/plant_shared_ring.py DEST [R]        # R slots shared by all consumers (default 6)
    cd DEST && PYTHONPATH=$PWD python -m pytest -m gpu tests/test_cuda_scorer_gpu.py -k shuffled

The copy's ``cuda_scorer.cu`` runs one ring of R slots shared by every consumer warpgroup (slot
it % R, its use it / R) instead of each warpgroup's own slots, so a slot's successive uses
belong to different warpgroups and a wait can pass on a stale parity. With R = 6 the stress test
fails (docs/performance.md); with R = 10 the GPU cannot produce the race and only
the CPU model (tests/test_ring_protocol.py) sees it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("vllm_sparse_sync", "tests", "conftest.py", "pyproject.toml")


def planted(source: str, slots: int) -> str:
    """``source`` (cuda_scorer.cu) with the shared ring of ``slots`` slots; a clear error where the
    source no longer has the lines the plant replaces."""
    if slots < 1:
        raise ValueError(f"slots: must be >= 1, got {slots}")
    for old, new in (
        ("return it % CONSUMERS + CONSUMERS * ((it / CONSUMERS) % per_consumer);", f"return it % {slots};"),
        ("if (j >= per_consumer) mbar_wait(smem_addr(&empty[s]), ((j / per_consumer) - 1) & 1);",
         f"if (it >= {slots}) mbar_wait(smem_addr(&empty[s]), ((it / {slots}) - 1) & 1);"),
        ("mbar_wait(smem_addr(&full[s]), ((it / CONSUMERS) / per_consumer) & 1);",
         f"mbar_wait(smem_addr(&full[s]), (it / {slots}) & 1);"),
    ):
        if source.count(old) != 1:
            raise ValueError(f"the scorer source no longer has exactly one {old!r}: update the plant")
        source = source.replace(old, new)
    return source


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    dest, slots = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) == 3 else 6
    if dest.exists():
        sys.exit(f"error: {dest} exists; give a new folder")
    dest.mkdir(parents=True)
    for name in COPIED:
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / name)
    cu = dest / "vllm_sparse_sync" / "kernels" / "cuda" / "scorer.cu"
    cu.write_text(planted(cu.read_text(), slots))
    print(f"planted a ring of {slots} slots shared by every consumer in {dest}")


if __name__ == "__main__":
    main()
