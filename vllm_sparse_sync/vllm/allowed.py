"""vLLM's deliberate syncs (`gpu_sync_allowed()` regions) as allowed syncs of this harness."""

from __future__ import annotations

import contextlib
import sys

from ..testing.records import allowed_syncs

REASON = "vLLM gpu_sync_allowed()"
_first_seen: set[tuple[str, int]] = set()


def _wrap(original):
    def gpu_sync_allowed(first_only: bool = False):
        """vLLM's own context manager, and this harness's allowed region around the same block
        (with `first_only`, only the first entry from a call site, as vLLM allows)."""
        if first_only:
            frame = sys._getframe(1)
            key = (frame.f_code.co_filename, frame.f_lineno)
            if key in _first_seen:
                return original(first_only=True)
            _first_seen.add(key)
        stack = contextlib.ExitStack()
        stack.enter_context(original(first_only=first_only))
        stack.enter_context(allowed_syncs(REASON))
        return stack

    gpu_sync_allowed._vllm_sparse_sync_original = original  # type: ignore[attr-defined]
    return gpu_sync_allowed


def install_allowed_regions() -> int:
    """Make every loaded vLLM module's `gpu_sync_allowed` also open an allowed region here;
    returns how many modules were patched (idempotent; call after vLLM's modules are imported)."""
    from vllm.utils import gpu_sync_debug

    current = gpu_sync_debug.gpu_sync_allowed
    original = getattr(current, "_vllm_sparse_sync_original", current)
    wrapped = current if current is not original else _wrap(original)
    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(module, "gpu_sync_allowed", None) is original:
            module.gpu_sync_allowed = wrapped
            patched += 1
    return patched
