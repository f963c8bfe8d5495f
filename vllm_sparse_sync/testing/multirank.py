"""Run a function on N ranks of a torch.distributed process group, from one test process.

A :class:`RankPool` spawns ``world_size`` worker processes once (``spawn``: safe with CUDA),
each joining one process group (gloo on CPUs, NCCL with one GPU per rank), and then runs any
number of calls on them: ``pool.run(fn, *args)`` sends the call to every rank, waits for all of
them and returns the per-rank results in rank order. Spawning and joining a group is the slow
part (seconds); reusing a pool keeps many cases per spawn cheap.

Never hangs: every wait has a timeout. When a rank raises, the call fails with a
:class:`RankFailure` that carries that rank's traceback (and the others', where they finish
within a short grace period; a rank still waiting in a collective for the failed one is
reported as such), and the pool is shut down (its ranks may be stuck in a collective), so the
next call gets a fresh one. No fixed ports: the parent hosts the rendezvous store on a port the
OS picks (port 0), so pools in parallel ``pytest -n`` workers never collide.

``fn`` must be picklable by reference (a module-level function; ``module:function`` strings
work too); it is called as ``fn(ctx, *args, **kwargs)`` with a :class:`RankContext`. Results
travel back pickled: return small, CPU-side values.
"""

from __future__ import annotations

import importlib
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT = 300.0
GRACE = 5.0
"""Seconds to wait for the other ranks' outcomes once one rank has failed."""


@dataclass(frozen=True)
class RankContext:
    """What a rank's function gets: its rank, the world, the backend and its device
    (``cuda:<rank>`` with NCCL, ``cpu`` with gloo). The process group is the default one."""

    rank: int
    world_size: int
    backend: str
    device: str

    @property
    def group(self):
        import torch.distributed as dist

        return dist.group.WORLD

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


class RankFailure(AssertionError):
    """One or more ranks failed (or timed out); ``errors`` maps rank -> traceback or reason."""

    def __init__(self, what: str, errors: dict[int, str]):
        self.errors = dict(errors)
        parts = [what]
        for rank in sorted(self.errors):
            parts.append(f"--- rank {rank} ---\n{self.errors[rank].rstrip()}")
        super().__init__("\n".join(parts))


def free_port() -> int:
    """A TCP port that was free a moment ago (prefer hosting a store on port 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(fn):
    if isinstance(fn, str):
        mod, _, qual = fn.partition(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    return fn


def _worker(rank: int, world: int, backend: str, host: str, port: int, tasks, results,
            env: dict[str, str], pg_timeout: float, threads: int, parent: int) -> None:
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        store = dist.TCPStore(host, port, world + 1, False, timeout=timedelta(seconds=pg_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        ctx = RankContext(rank, world, backend, device)
    except BaseException:
        results.put((0, rank, False, traceback.format_exc().encode()))
        return
    results.put((0, rank, True, pickle.dumps(None)))
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone: do not linger
                break
            continue
        if task is None:
            break
        task_id, blob = task
        try:
            fn, args, kwargs = pickle.loads(blob)
            payload = pickle.dumps(_resolve(fn)(ctx, *args, **kwargs))
            ok = True
        except BaseException:
            payload, ok = traceback.format_exc().encode(), False
        results.put((task_id, rank, ok, payload))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - shutting down anyway
        pass


class RankPool:
    """``world_size`` spawned ranks in one process group, reused across calls."""

    def __init__(self, world_size: int, backend: str = "gloo", *, env: dict[str, str] | None = None,
                 start_timeout: float = 180.0, pg_timeout: float = 120.0, threads: int | None = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: must be a positive int, got {world_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if backend == "nccl":
            reason = nccl_unavailable_reason(world_size)
            if reason:
                raise RuntimeError(reason)
        import multiprocessing as mp

        import torch.distributed as dist

        self.world_size, self.backend = world_size, backend
        self._ctx = mp.get_context("spawn")
        # The parent hosts the rendezvous on a port the OS picks: no races under pytest -n.
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                    timeout=timedelta(seconds=start_timeout))
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._task_id = 0
        threads = (1 if backend == "gloo" else 0) if threads is None else threads
        self._procs = []
        for rank in range(world_size):
            p = self._ctx.Process(
                target=_worker, daemon=True, name=f"rank{rank}",
                args=(rank, world_size, backend, "127.0.0.1", self._store.port, self._tasks[rank],
                      self._results, dict(env or {}), pg_timeout, threads, os.getpid()))
            p.start()
            self._procs.append(p)
        self._collect(0, start_timeout, "starting the ranks")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable | str, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on every rank; the results in rank order.

        Raises :class:`RankFailure` (and shuts the pool down) when a rank raises, dies or does
        not finish within ``timeout`` seconds.
        """
        if not self.alive:
            raise RuntimeError("RankPool: the pool is closed (a failed call shuts it down)")
        try:
            blob = pickle.dumps((fn, args, kwargs))
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"RankPool.run: fn and its arguments must pickle (a module-level "
                            f"function, or a 'module:function' string): {exc}") from exc
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, blob))
        name = getattr(fn, "__qualname__", str(fn))
        return self._collect(self._task_id, timeout, f"running {name}")

    def _collect(self, task_id: int, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        done: dict[int, Any] = {}
        failed: dict[int, str] = {}
        first_failure = None
        while len(done) + len(failed) < self.world_size:
            now = time.monotonic()
            if now >= deadline or (first_failure is not None and now >= first_failure + GRACE):
                break
            try:
                tid, rank, ok, payload = self._results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                for rank, p in enumerate(self._procs):
                    if not p.is_alive() and rank not in done and rank not in failed:
                        failed[rank] = f"the rank's process died (exit code {p.exitcode})"
                        first_failure = first_failure or time.monotonic()
                continue
            if tid != task_id:
                continue  # a stale answer of an earlier, failed call
            if ok:
                done[rank] = pickle.loads(payload)
            else:
                failed[rank] = payload.decode(errors="replace")
                first_failure = first_failure or time.monotonic()
        if failed or len(done) < self.world_size:
            for rank in range(self.world_size):
                if rank not in done and rank not in failed:
                    failed[rank] = ("did not finish " + (
                        f"within {GRACE:.0f} s of another rank's failure (probably waiting for it "
                        f"in a collective)" if first_failure is not None else f"within {timeout:.0f} s"))
            self.close()
            head = sorted(r for r, e in failed.items() if not e.startswith("did not finish"))
            who = f"rank {head[0]} failed" if head else "timed out"
            raise RankFailure(f"{what} on {self.world_size} {self.backend} ranks: {who}", failed)
        return [done[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (politely, then by force); idempotent."""
        for q in self._tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def nccl_unavailable_reason(world_size: int) -> str | None:
    """None when NCCL ranks of ``world_size`` GPUs (one each) can run here, else why not."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return "torch.distributed has no NCCL backend here"
    if not torch.cuda.is_available():
        return f"needs {world_size} CUDA GPUs (one per rank); CUDA is not available"
    n = torch.cuda.device_count()
    if n < world_size:
        return f"needs {world_size} CUDA GPUs (one per rank); {n} visible"
    return None


class MultiRank:
    """Pools keyed by (world size, backend, env), made on first use and reused; what the
    ``multirank`` fixture gives a test."""

    def __init__(self) -> None:
        self._pools: dict[tuple, RankPool] = {}

    def pool(self, world_size: int = 2, backend: str = "gloo", *, env: dict[str, str] | None = None,
             **kw) -> RankPool:
        key = (world_size, backend, tuple(sorted((env or {}).items())))
        pool = self._pools.get(key)
        if pool is None or not pool.alive:
            pool = self._pools[key] = RankPool(world_size, backend, env=env, **kw)
        return pool

    def run(self, fn: Callable | str, *args, world_size: int = 2, backend: str = "gloo",
            env: dict[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks; per-rank results in rank order.

        With ``backend="nccl"`` and fewer GPUs than ranks, the calling test is skipped with the
        reason (``pytest.skip``)."""
        if backend == "nccl":
            reason = nccl_unavailable_reason(world_size)
            if reason:
                import pytest

                pytest.skip(reason)
        return self.pool(world_size, backend, env=env).run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def run_ranks(fn: Callable | str, *args, world_size: int = 2, backend: str = "gloo",
              env: dict[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list[Any]:
    """One-shot: spawn ``world_size`` ranks, run ``fn(ctx, *args, **kwargs)`` on each, shut them
    down; the results in rank order (outside pytest; call it under ``if __name__ == "__main__"``)."""
    with RankPool(world_size, backend, env=env) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
