"""`--sync-vllm` (ini `sync_vllm`): vLLM's own test suite, checked without edits.

Before the initial conftests load (`early`), the process is prepared for vLLM: on a host
without a CUDA device, vLLM's CPU platform and Triton's interpreter. At configure (`enter`),
vLLM's `gpu_sync_allowed()` regions become allowed regions, the baseline of known upstream reads
is accepted, and every vLLM attention-metadata build becomes a checked region
(`vllm_sparse_sync.vllm.regions`). A run with the flag that checks no build fails
(`report.py`).
"""

from __future__ import annotations

import pytest

from .vllm_env import EXPORT, cuda_device_present, imported_unprepared, prepare_for_vllm, vllm_installed

NOT_INSTALLED = '--sync-vllm: vLLM is not installed (pip install "vllm-sparse-sync[vllm]")'
_KEY_EARLY = pytest.StashKey[str]()


def requested(config) -> bool:
    """Whether vLLM mode is on: the flag, else the ini option."""
    flag = config.getoption("sync_vllm", None)
    if flag is None:
        flag = getattr(getattr(config, "known_args_namespace", None), "sync_vllm", None)
    return bool(flag) or bool(config.getini("sync_vllm"))


def early(config) -> None:
    """Prepare the process before any conftest imports vLLM."""
    if not vllm_installed():
        raise pytest.UsageError(NOT_INSTALLED)
    why = _too_late()
    if why:
        raise pytest.UsageError(
            f"--sync-vllm: vLLM was imported before pytest loaded its first conftest ({why}): by "
            "another plugin, or by the program that started pytest, so the plugin could not prepare "
            f"the process. Start pytest with {EXPORT} exported")
    config.stash[_KEY_EARLY] = prepare_for_vllm()


def _too_late() -> str | None:
    """Why vLLM, imported already, cannot be put on the CPU platform any more (never on a GPU host)."""
    return None if cuda_device_present() else imported_unprepared()


def _prepare_late(config) -> str:
    why = _too_late()
    if why and _KEY_EARLY not in config.stash:
        raise pytest.UsageError(
            f"--sync-vllm: vLLM was imported before the plugin could prepare the process ({why}): "
            "the plugin was loaded after the conftests that import vLLM (from a conftest's "
            "pytest_plugins?). Load it with -p vllm_sparse_sync.testing.plugin on the command line, "
            f"or through its installed entry point, or start pytest with {EXPORT} exported")
    try:
        return prepare_for_vllm()
    except RuntimeError as exc:
        raise pytest.UsageError(f"--sync-vllm: {exc}") from None


def enter(config, *, runs_tests: bool) -> None:
    """Wire vLLM mode into this process; `runs_tests`: it runs tests (not an xdist controller)."""
    if not vllm_installed():
        raise pytest.UsageError(NOT_INSTALLED)
    config._vss_vllm = {"setup": _prepare_late(config), "regions": False}
    if not runs_tests:
        return
    from ..vllm.allowed import install_allowed_regions
    from ..vllm.audit import load_baseline
    from ..vllm.regions import install
    from .known import accept_known_reads

    install_allowed_regions()
    try:
        baseline = load_baseline(config.getini("sync_vllm_baseline") or None)
    except (OSError, ValueError) as exc:  # JSON errors included
        raise pytest.UsageError(f"sync_vllm_baseline: {exc}") from None
    accept_known_reads(baseline)
    install()
    config._vss_vllm["regions"] = True


def leave(config) -> None:
    state = getattr(config, "_vss_vllm", None)
    if state and state.get("regions"):
        from ..vllm.regions import uninstall

        uninstall()
        state["regions"] = False
