"""The harness: detection layers, fixtures and capture helpers that prove a decode step never
synchronizes the host. Load it in pytest with `-p vllm_sparse_sync.testing.plugin` (it is also
registered through the `pytest11` entry point)."""

from __future__ import annotations

from .capture import DecodeGraph, decode_graph
from .guard import SyncCheck, SyncCheckUnavailable, check_step, no_host_sync, sync_recorder
from .isolate import run_isolated
from .layers import (
    CaptureProbe,
    DebugModeLayer,
    RuntimeApiLayer,
    SentinelLayer,
    TraceLayer,
)
from .multirank import MultiRank, RankContext, RankFailure, RankPool, run_ranks
from .records import KINDS, Budget, HostSyncError, SyncRecord, allowed_syncs
from .watch import device_tensors

__all__ = [
    "KINDS",
    "MultiRank",
    "RankContext",
    "RankFailure",
    "RankPool",
    "Budget",
    "CaptureProbe",
    "DebugModeLayer",
    "DecodeGraph",
    "HostSyncError",
    "RuntimeApiLayer",
    "SentinelLayer",
    "SyncCheck",
    "SyncCheckUnavailable",
    "SyncRecord",
    "TraceLayer",
    "allowed_syncs",
    "check_step",
    "decode_graph",
    "device_tensors",
    "no_host_sync",
    "run_isolated",
    "run_ranks",
    "sync_recorder",
]
