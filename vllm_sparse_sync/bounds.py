"""The decode top-k bound: the host scalar a scorer/top-k needs, chosen without device reads.

The rules are the table of docs/design.md section 3, written as one table (``SOURCE_RULES``) plus
one value function per source. Every value is in the kernel's coordinates: per decode token,
compressed rows when ``compress_ratio > 1``, DCP-local when ``dcp_world_size > 1``. Invariant:
the value is never below the true maximum of the device row lengths.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import checks
from .layout import IndexerBackend, IndexerLayout
from .lengths import compress, compress_ceil, layout_kernel_lengths, layout_localize


class BoundSource(str, enum.Enum):
    """Where a decode top-k bound came from."""

    CPU_EXACT = "cpu_exact"
    """Exact maximum from an authoritative CPU seq-len shadow."""
    CPU_DCP_LOCAL = "cpu_dcp_local"
    """Exact maximum of this rank's DCP-local lengths, from the CPU shadow."""
    ACTIVE_WIDTH = "active_width"
    """B12X graph-stable live-window bound ``ceil(max_seq_len / ratio)`` (>= exact)."""
    METADATA_UPPER_BOUND = "metadata_upper_bound"
    """The scheduler's host upper bound ``max_seq_len`` in kernel coordinates (>= exact)."""
    CAPTURE_STABLE = "capture_stable"
    """Derived from ``max_model_len`` alone, for CUDA-graph capture (>= any live length)."""
    LEGACY_DEVICE_SYNC = "legacy_device_sync"
    """The old ``int(seq_lens.max().item())`` host read; only when asked for explicitly."""

    @property
    def is_exact(self) -> bool:
        """True for sources that equal the true maximum."""
        return self in (BoundSource.CPU_EXACT, BoundSource.CPU_DCP_LOCAL,
                        BoundSource.LEGACY_DEVICE_SYNC)


@dataclass(frozen=True)
class DecodeTopkBound:
    """A host bound on the decode rows' kernel lengths and where it came from."""

    value: int
    source: BoundSource


@dataclass(frozen=True)
class SeqLenShadow:
    """The runner's CPU copy of the decode requests' lengths (uncompressed tokens).

    ``seq_lens_cpu`` has one int32 entry per request and counts this step's query tokens.
    ``authoritative`` is False under async scheduling with speculative decode, where the copy
    is an optimistic upper bound. ``dcp_local_seq_lens_cpu`` (optional) holds this rank's
    local lengths per request.
    """

    seq_lens_cpu: torch.Tensor
    authoritative: bool = True
    dcp_local_seq_lens_cpu: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.seq_lens_cpu, torch.Tensor):
            raise TypeError(f"seq_lens_cpu: must be a CPU torch.Tensor, "
                            f"got {type(self.seq_lens_cpu).__name__}")
        object.__setattr__(self, "authoritative", checks.flag("authoritative", self.authoritative))
        local = self.dcp_local_seq_lens_cpu
        if local is not None and not isinstance(local, torch.Tensor):
            raise TypeError(f"dcp_local_seq_lens_cpu: must be a CPU torch.Tensor or None, "
                            f"got {type(local).__name__}")


# (backend, compressed, exact shadow usable) -> source. DCP turns CPU_EXACT into CPU_DCP_LOCAL.
SOURCE_RULES: dict[tuple[IndexerBackend, bool, bool], BoundSource] = {
    (IndexerBackend.B12X, True, True): BoundSource.ACTIVE_WIDTH,
    (IndexerBackend.B12X, True, False): BoundSource.ACTIVE_WIDTH,
    (IndexerBackend.B12X, False, True): BoundSource.CPU_EXACT,
    (IndexerBackend.B12X, False, False): BoundSource.ACTIVE_WIDTH,
    (IndexerBackend.DEEPGEMM, True, True): BoundSource.METADATA_UPPER_BOUND,
    (IndexerBackend.DEEPGEMM, True, False): BoundSource.METADATA_UPPER_BOUND,
    (IndexerBackend.DEEPGEMM, False, True): BoundSource.CPU_EXACT,
    (IndexerBackend.DEEPGEMM, False, False): BoundSource.METADATA_UPPER_BOUND,
}


def capture_stable_bound(layout: IndexerLayout) -> int:
    """Kernel-row bound from ``max_model_len`` alone: ``local(ceil(max_model_len / ratio))``."""
    return layout_localize(layout, compress_ceil(layout.max_model_len, layout.compress_ratio))


def _active_width(layout: IndexerLayout, max_seq_len: int, live_max: int) -> int:
    return layout_localize(layout, compress_ceil(max_seq_len, layout.compress_ratio))


def _metadata_upper_bound(layout: IndexerLayout, max_seq_len: int, live_max: int) -> int:
    # Rows are floor(L / ratio) with L <= max_seq_len, so floor(max_seq_len / ratio) bounds them.
    return layout_localize(layout, compress(max_seq_len, layout.compress_ratio))


def _cpu_exact(layout: IndexerLayout, max_seq_len: int, live_max: int) -> int:
    # The longest token of a request has the request's full length and every transform is
    # monotone, so the transform of the longest live request is the exact maximum.
    return layout_kernel_lengths(layout, live_max)


_VALUE_OF: dict[BoundSource, Callable[[IndexerLayout, int, int], int]] = {
    BoundSource.ACTIVE_WIDTH: _active_width,
    BoundSource.METADATA_UPPER_BOUND: _metadata_upper_bound,
    BoundSource.CPU_EXACT: _cpu_exact,
    BoundSource.CPU_DCP_LOCAL: _cpu_exact,
}


def _host_int_tensor(name: str, t: object, *, dims: int = 1) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: must be a CPU torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{name}: must live on the CPU (a host shadow), got a {t.device.type} tensor; "
            "reading a device tensor here would synchronize the host"
        )
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != dims:
        raise ValueError(f"{name}: must be a {dims}-D int32 (or int64) tensor, got {t.dtype} "
                         f"{tuple(t.shape)}")
    return t


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


@dataclass(frozen=True)
class QueryLayout:
    """What a validated ``query_start_loc_cpu`` says: per-request query lengths (read-only
    int64), decode tokens, the query length all requests share (None if ragged; 0 with no
    requests), whether every request has a token."""

    query_lens: np.ndarray
    num_rows: int
    uniform: int | None
    all_live: bool


_QUERY_LAYOUTS: dict[bytes, QueryLayout] = {}  # prefix sums seen lately (decode repeats them)


def query_layout(query_start_loc_cpu: torch.Tensor) -> QueryLayout:
    """The validated query layout of a CPU prefix sum (``n + 1`` entries), memoized by value."""
    starts = _host_int_tensor("query_start_loc_cpu", query_start_loc_cpu).numpy()
    key = starts.tobytes() + starts.dtype.char.encode()
    hit = _QUERY_LAYOUTS.get(key)
    if hit is None:
        q = _query_lens_of(starts)
        q.flags.writeable = False
        n = q.size
        uniform = (int(q[0]) if (q == q[0]).all() else None) if n else 0
        hit = QueryLayout(q, int(q.sum()), uniform, bool(n == 0 or q.min() > 0))
        if len(_QUERY_LAYOUTS) > 1024:
            _QUERY_LAYOUTS.clear()
        _QUERY_LAYOUTS[key] = hit
    return hit


def _query_lens_of(starts: np.ndarray) -> np.ndarray:
    if starts.size < 1:
        raise ValueError("query_start_loc_cpu: needs n + 1 >= 1 entries, got 0")
    if starts[0] != 0:
        raise ValueError(f"query_start_loc_cpu: must start at 0, got {int(starts[0])}")
    q = np.diff(starts.astype(np.int64))
    if q.size and (q < 0).any():
        i = _first(q < 0)
        raise ValueError(f"query_start_loc_cpu: must be non-decreasing (negative query length at "
                         f"request {i})")
    return q


def _shadow_lens_host(shadow: SeqLenShadow, ql: QueryLayout, max_seq_len: int) -> tuple[np.ndarray, int]:
    """The shadow's checked lengths and the longest live request's length (0 if none)."""
    query_lens = ql.query_lens
    n = query_lens.size
    lens_t = _host_int_tensor("shadow.seq_lens_cpu", shadow.seq_lens_cpu)
    if lens_t.shape[0] < n:
        raise ValueError(f"shadow.seq_lens_cpu: needs one entry per request ({n}), got {lens_t.shape[0]}")
    lens = lens_t.numpy()[:n].astype(np.int64)
    if n == 0:
        return lens, 0
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0:
        i = _first(lens < 0)
        raise ValueError(f"shadow.seq_lens_cpu[{i}]: negative length {int(lens[i])}")
    if shadow.authoritative:
        if hi > max_seq_len:
            i = _first(lens > max_seq_len)
            raise ValueError(f"shadow.seq_lens_cpu[{i}]: authoritative length {int(lens[i])} exceeds "
                             f"max_seq_len={max_seq_len}")
        if (lo < ql.uniform) if ql.uniform is not None else bool((lens < query_lens).any()):
            i = _first(lens < query_lens)
            raise ValueError(f"shadow.seq_lens_cpu[{i}]: length {int(lens[i])} is shorter than its "
                             f"{int(query_lens[i])} query tokens")
    if ql.all_live:
        return lens, hi
    live = lens[query_lens > 0]
    return lens, int(live.max()) if live.size else 0


def _check_dcp_local(shadow: SeqLenShadow, layout: IndexerLayout, lens: np.ndarray) -> None:
    local_t = _host_int_tensor("shadow.dcp_local_seq_lens_cpu", shadow.dcp_local_seq_lens_cpu)
    n = lens.size
    if local_t.shape[0] < n:
        raise ValueError(
            f"shadow.dcp_local_seq_lens_cpu: needs one entry per request ({n}), got {local_t.shape[0]}"
        )
    local = local_t.numpy()[:n].astype(np.int64)
    want = layout_localize(layout, lens)  # lens: int64
    if n and (local != want).any():
        i = _first(local != want)
        raise ValueError(
            f"shadow.dcp_local_seq_lens_cpu[{i}]: {int(local[i])} is not rank {layout.dcp_rank}'s share "
            f"({int(want[i])}) of seq_lens_cpu[{i}]={int(lens[i])}"
        )


@dataclass(frozen=True)
class DecodePlan:
    """What the host knows of one decode step, from host data only."""

    query_lens: np.ndarray
    """Query tokens per request (int64)."""
    num_rows: int
    """Decode tokens: rows of the kernels."""
    uniform_query_len: int | None
    """The query length every request shares, if they all do (plain decode: 1)."""
    bound: DecodeTopkBound

    @property
    def num_reqs(self) -> int:
        return int(self.query_lens.size)


def plan_decode(
    layout: IndexerLayout,
    *,
    max_seq_len: int,
    query_start_loc_cpu: torch.Tensor,
    shadow: SeqLenShadow | None = None,
) -> DecodePlan:
    """Validate one step's host data and choose its bound (docs/design.md section 3), without
    device reads."""
    if not isinstance(layout, IndexerLayout):
        raise TypeError(f"layout: must be an IndexerLayout, got {type(layout).__name__}")
    max_seq_len = checks.host_int("max_seq_len", max_seq_len)
    if not 0 <= max_seq_len <= layout.max_model_len:
        raise ValueError(
            f"max_seq_len: must lie in [0, max_model_len={layout.max_model_len}], got {max_seq_len}"
        )
    if shadow is not None and not isinstance(shadow, SeqLenShadow):
        raise TypeError(f"shadow: must be a SeqLenShadow or None, got {type(shadow).__name__}")
    ql = query_layout(query_start_loc_cpu)
    live_max = 0
    if shadow is not None:
        lens, live_max = _shadow_lens_host(shadow, ql, max_seq_len)
        if shadow.dcp_local_seq_lens_cpu is not None:
            _check_dcp_local(shadow, layout, lens)
    exact_usable = shadow is not None and shadow.authoritative
    source = SOURCE_RULES[(layout.backend, layout.is_compressed, exact_usable)]
    if source is BoundSource.CPU_EXACT and layout.uses_dcp:
        source = BoundSource.CPU_DCP_LOCAL
    bound = DecodeTopkBound(_VALUE_OF[source](layout, max_seq_len, live_max), source)
    return DecodePlan(ql.query_lens, ql.num_rows, ql.uniform, bound)


def decode_topk_bound(
    layout: IndexerLayout,
    *,
    max_seq_len: int,
    query_start_loc_cpu: torch.Tensor,
    shadow: SeqLenShadow | None = None,
    capturing: bool = False,
) -> DecodeTopkBound:
    """Host bound on every decode row's kernel length, from host data only (docs/design.md
    section 3)."""
    if not isinstance(layout, IndexerLayout):
        raise TypeError(f"layout: must be an IndexerLayout, got {type(layout).__name__}")
    if checks.flag("capturing", capturing):
        return DecodeTopkBound(capture_stable_bound(layout), BoundSource.CAPTURE_STABLE)
    return plan_decode(layout, max_seq_len=max_seq_len, query_start_loc_cpu=query_start_loc_cpu,
                       shadow=shadow).bound
