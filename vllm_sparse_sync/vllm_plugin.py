"""The bound rules inside vLLM, without a fork: a `vllm.general_plugins` entry point.

Off unless ``VLLM_SPARSE_SYNC_BOUNDS=1``. When on (and vLLM is the tested 0.33.x on a CUDA-like
platform), it wraps `DeepseekV32IndexerMetadataBuilder.build` so that the decode top-k bound
vLLM passes to its top-k (`DeepseekV32IndexerMetadata.max_seq_len`, read at
sparse_attn_indexer.py:933) is this project's bound for the batch, in kernel coordinates:
compressed layers get it in compressed rows, DCP ranks their local rows, an authoritative CPU
shadow (`seq_lens_cpu_upper_bound` outside async speculative decoding) the exact maximum, and a
CUDA-graph capture (vLLM passes `max_model_len` then) the capture-stable bound. Only host data
is read. Anything it cannot decide leaves vLLM's value in place. This module imports nothing
of vLLM until `register()` runs, and changes nothing in the process when the variable is unset.

vLLM runs `register()` when it loads its general plugins (`vllm.plugins.load_general_plugins`),
once per process, in every process that builds an engine: where engine arguments become a config
(`LLM(...)`, `vllm serve`), in the engine core, in each worker, and in vLLM's CLI parser. Importing
vLLM does not load it, nor does a test that builds a metadata builder directly; call `install()`
there. Its lines go through vLLM's logger (`vllm.logger.init_logger`).
"""

from __future__ import annotations

import functools
import os

from .bounds import BoundSource, DecodeTopkBound, SeqLenShadow, capture_stable_bound, plan_decode
from .layout import IndexerBackend, IndexerLayout

ENV = "VLLM_SPARSE_SYNC_BOUNDS"
TESTED_VLLM = "0.33."
LOGGER = "vllm.plugins.vllm_sparse_sync"


def _log():
    """vLLM's logger for this plugin (under vLLM's own handlers and format)."""
    from vllm.logger import init_logger

    return init_logger(LOGGER)


def platform_name(platform) -> str:
    """How a vLLM platform is named in a line: its class and device type, even when empty."""
    return f"{type(platform).__name__} (device type {str(getattr(platform, 'device_type', ''))!r})"


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not a version this plugin was tested with."""


def check_vllm_version(version: str) -> None:
    if not version.startswith(TESTED_VLLM):
        raise UnsupportedVllm(f"vllm-sparse-sync's bound plugin is tested with vLLM {TESTED_VLLM}x, "
                              f"found {version}: not loaded")


def layout_of(builder) -> IndexerLayout:
    """The indexer layout of a vLLM `DeepseekV32IndexerMetadataBuilder` (DeepGEMM-style host width:
    vLLM sizes the decode logits on the host)."""
    ratio = int(builder.compress_ratio)
    world = int(builder.dcp_world_size)
    interleave = int(builder.cp_kv_cache_interleave_size) if world > 1 else 1
    return IndexerLayout(backend=IndexerBackend.DEEPGEMM, compress_ratio=ratio, dcp_world_size=world,
                         dcp_rank=int(builder.dcp_rank), cp_interleave=max(1, interleave // ratio),
                         max_model_len=int(builder.vllm_config.model_config.max_model_len))


def shadow_is_authoritative(builder) -> bool:
    """vLLM's host lengths are exact except under async scheduling with speculative decoding."""
    async_sched = bool(getattr(builder.vllm_config.scheduler_config, "async_scheduling", False))
    return not (async_sched and int(builder.num_speculative_tokens) > 0)


def indexer_bound(builder, common, num_decodes: int) -> DecodeTopkBound:
    """This project's decode top-k bound for the first `num_decodes` requests of `common` (a vLLM
    `CommonAttentionMetadata`), from host data only."""
    layout = layout_of(builder)
    max_seq_len = int(common.max_seq_len)
    if max_seq_len >= layout.max_model_len:  # the runner's capture setting (gpu_model_runner.py:2290)
        return DecodeTopkBound(capture_stable_bound(layout), BoundSource.CAPTURE_STABLE)
    qsl = common.query_start_loc_cpu[: num_decodes + 1]
    shadow = None
    host_lens = getattr(common, "seq_lens_cpu_upper_bound", None)
    if host_lens is not None:
        shadow = SeqLenShadow(host_lens[:num_decodes], authoritative=shadow_is_authoritative(builder))
    return plan_decode(layout, max_seq_len=max_seq_len, query_start_loc_cpu=qsl, shadow=shadow).bound


def _with_bound(build):
    @functools.wraps(build)
    def build_with_project_bound(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        meta = build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        if meta.num_decodes:
            try:
                meta.max_seq_len = indexer_bound(self, common_attn_metadata, meta.num_decodes).value
            except (TypeError, ValueError) as exc:  # a hint we cannot read: vLLM's value stays
                _log().warning("vllm-sparse-sync: bound not applied (%s)", exc)
        return meta

    build_with_project_bound._vllm_sparse_sync_original = build  # type: ignore[attr-defined]
    return build_with_project_bound


def install(*, force: bool = False) -> bool:
    """Wrap vLLM's indexer builder; True when installed. `force`: also on a non-CUDA platform
    (tests and the audit: vLLM's CPU indexer reads `max_seq_len` in its own way)."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder as B

    check_vllm_version(vllm.__version__)
    if not force and not current_platform.is_cuda_alike():
        _log().warning("vllm-sparse-sync: bound plugin not loaded on platform %s (CUDA-like platforms "
                       "only)", platform_name(current_platform))
        return False
    if not hasattr(B.build, "_vllm_sparse_sync_original"):
        B.build = _with_bound(B.build)
    return True


def uninstall() -> None:
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder as B

    original = getattr(B.build, "_vllm_sparse_sync_original", None)
    if original is not None:
        B.build = original


def register() -> None:
    """vLLM's general-plugin hook: installs the bound rules when VLLM_SPARSE_SYNC_BOUNDS=1."""
    if os.environ.get(ENV, "") != "1":
        return
    try:
        install()
    except UnsupportedVllm as exc:
        _log().error("%s", exc)
