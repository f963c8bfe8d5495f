"""Checked regions nest: inner regions share the running layers, each sync is recorded once, in
the innermost region of its thread, only that region raises, and the layers stop (restoring what
they changed) when the last region leaves. On the CPU: the sentinel and stand-in layers that,
like torch's profiler and debug mode, are process-wide and cannot run twice."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch

from vllm_sparse_sync.testing import HostSyncError, SyncCheckUnavailable, no_host_sync, shared, sync_recorder
from vllm_sparse_sync.testing import layers as L
from vllm_sparse_sync.testing.layers.protocol import LayerBase
from vllm_sparse_sync.testing.records import STREAM_SYNC, SyncRecord, harness_work, user_frame


class ProcessWide(LayerBase):
    """A stand-in for torch's debug mode: one process-wide setting, an error when started twice
    or stopped when off (as torch's profiler raises), records from any thread."""

    name: ClassVar[str] = "fake_process"
    order: ClassVar[int] = 5
    state: ClassVar[str] = "off"
    starts: ClassVar[int] = 0
    live: ClassVar[list] = []

    def __init__(self):
        self.records: list[SyncRecord] = []

    @classmethod
    def unavailable_reason(cls):
        return None

    def start(self):
        if ProcessWide.state != "off":
            raise RuntimeError("already running: cannot nest")
        ProcessWide.state = "on"
        ProcessWide.starts += 1
        ProcessWide.live.append(self)

    def stop(self):
        if ProcessWide.state != "on":
            raise RuntimeError("Can't disable it when it's not running")
        ProcessWide.state = "off"
        ProcessWide.live.remove(self)
        return self.collect()


class OwnThread(ProcessWide):
    """A stand-in for torch's profiler: started, collected and stopped on one thread only."""

    name: ClassVar[str] = "fake_profiler"
    order: ClassVar[int] = 0
    own_thread_only: ClassVar[bool] = True
    state: ClassVar[str] = "off"
    live: ClassVar[list] = []

    def start(self):
        if OwnThread.state != "off":
            raise RuntimeError("profiler already running")
        OwnThread.state, self.thread = "on", threading.get_ident()
        OwnThread.live.append(self)

    def collect(self):
        assert threading.get_ident() == self.thread, "collected on another thread"
        return super().collect()

    def stop(self):
        assert threading.get_ident() == self.thread, "stopped on another thread"
        OwnThread.state = "off"
        OwnThread.live.remove(self)
        return self.collect()


def fake_sync(line: str = "") -> None:
    """A sync every running stand-in layer sees (as a CUDA sync is seen by each CUDA layer)."""
    if harness_active():
        return
    for cls in (ProcessWide, OwnThread):
        for layer in cls.live:
            layer.records.append(SyncRecord.at(STREAM_SYNC, cls.name, "fake sync", user_frame(),
                                               detail=line))


def harness_active() -> bool:
    from vllm_sparse_sync.testing.records import in_harness_work

    return in_harness_work()


@pytest.fixture(autouse=True)
def stand_in_layers(monkeypatch):
    monkeypatch.setitem(L.REGION_LAYERS, ProcessWide.name, ProcessWide)
    monkeypatch.setitem(L.REGION_LAYERS, OwnThread.name, OwnThread)
    monkeypatch.setattr(L, "ALL_LAYERS", (*L.ALL_LAYERS, ProcessWide.name, OwnThread.name))
    yield
    assert ProcessWide.state == "off" and OwnThread.state == "off"
    assert not shared._running, shared._running
    assert torch._C._len_torch_function_stack() == 0


ALL = "sentinel,fake_process,fake_profiler"


def lines(check, layer=None):
    return [r.detail or r.code for r in check.records if layer is None or r.layer == layer]


def test_a_nested_region_shares_the_layers_and_only_it_raises_for_its_syncs():
    x = torch.tensor([3, 1, 4])
    with sync_recorder(watch=[x], layers=ALL) as outer:
        fake_sync("outer before")
        with pytest.raises(HostSyncError) as err:
            with no_host_sync(watch=[x], layers=ALL) as inner:
                fake_sync("inner")
                int(x.max())  # the inner read
        fake_sync("outer after")
        x.tolist()  # the outer read
    assert sorted(lines(inner)) == ["inner", "inner", "int(x.max())  # the inner read"]
    assert sorted(r.layer for r in err.value.records) == ["fake_process", "fake_profiler", "sentinel"]
    assert sorted(lines(outer)) == sorted(["outer before", "outer before", "outer after", "outer after",
                                           "x.tolist()  # the outer read"])
    assert inner.ran == outer.ran == ["fake_profiler", "fake_process", "sentinel"]


def test_each_layer_starts_once_for_nested_regions():
    before = ProcessWide.starts
    x = torch.arange(3)
    with no_host_sync(watch=[x], layers=ALL):
        with no_host_sync(watch=[x], layers=ALL):
            with no_host_sync(watch=[x], layers="fake_process"):
                assert ProcessWide.state == "on"
        assert ProcessWide.state == "on"
    assert ProcessWide.starts == before + 1


def test_an_inner_region_may_run_a_layer_the_outer_does_not():
    x = torch.arange(3)
    with sync_recorder(watch=[x], layers="sentinel") as outer:
        with sync_recorder(layers="fake_process") as inner:
            fake_sync("inner")
            x.tolist()  # seen by the outer's sentinel, the only one running
        assert ProcessWide.state == "off"
    assert lines(inner) == ["inner"]
    assert [r.layer for r in outer.records] == ["sentinel"]


def test_inner_watch_is_watched_and_the_outer_watch_is_seen_inside():
    a, b = torch.arange(3), torch.arange(4)
    with sync_recorder(watch=[a], layers="sentinel") as outer:
        with sync_recorder(watch=[b], layers="sentinel") as inner:
            b.tolist()
            a.tolist()
    assert len(inner.records) == 2 and outer.records == []
    assert inner.touched == 2 and outer.touched == 0


def test_an_exception_inside_leaves_both_regions_and_every_layer_clean():
    x = torch.arange(3)
    with pytest.raises(ValueError, match="boom"):
        with no_host_sync(watch=[x], layers=ALL):
            with no_host_sync(watch=[x], layers=ALL):
                x + 1
                raise ValueError("boom")
    with pytest.raises(HostSyncError) as err:  # a sync before it: the inner region's error
        with no_host_sync(watch=[x], layers=ALL) as outer:
            with no_host_sync(watch=[x], layers=ALL):
                fake_sync("before the error")
                raise ValueError("boom")
    assert isinstance(err.value.__cause__, ValueError)
    assert lines(err.value) == ["before the error", "before the error"] and outer.records == []
    # the fixture checks: stand-ins off, nothing running, no torch mode left


def test_an_inner_error_passes_through_an_outer_region_over_its_own_budget():
    x = torch.arange(3)
    with pytest.raises(HostSyncError) as err:
        with no_host_sync(watch=[x], layers="sentinel") as outer:
            x.tolist()  # the outer's own
            with no_host_sync(watch=[x], layers="sentinel"):
                int(x[0])  # the inner's
    assert [r.code for r in err.value.records] == ["int(x[0])  # the inner's"]
    assert [r.code for r in outer.records] == ["x.tolist()  # the outer's own"]


def test_regions_on_two_threads_get_their_own_syncs_and_the_layer_stops_after_both():
    x = torch.arange(3)
    entered, release = threading.Event(), threading.Event()
    out = {}

    def worker():
        y = torch.arange(5)
        with sync_recorder(watch=[y], layers="sentinel,fake_process") as rec:
            entered.set()
            release.wait(10)
            fake_sync("worker")
            y.tolist()
        out["rec"] = rec

    t = threading.Thread(target=worker, name="worker")
    with sync_recorder(watch=[x], layers="sentinel,fake_process") as main:
        t.start()
        assert entered.wait(10)
        fake_sync("main")
        release.set()
        t.join(10)
        assert ProcessWide.state == "on"  # the main region still runs
        x.tolist()
    worker_rec = out["rec"]
    assert sorted(lines(main)) == ["main", "x.tolist()"]
    assert sorted(lines(worker_rec)) == ["worker", "y.tolist()"]
    assert {r.thread for r in worker_rec.records} == {"worker"}
    assert ProcessWide.state == "off"


def test_the_first_region_may_leave_before_one_on_another_thread():
    entered, release = threading.Event(), threading.Event()
    out = {}

    def worker():
        with sync_recorder(layers="fake_process") as rec:
            entered.set()
            release.wait(10)
            fake_sync("worker")
        out["rec"] = rec

    t = threading.Thread(target=worker, name="late")
    with sync_recorder(layers="fake_process") as first:
        t.start()
        assert entered.wait(10)
    assert ProcessWide.state == "on"  # the worker's region holds it
    release.set()
    t.join(10)
    assert ProcessWide.state == "off"
    assert lines(out["rec"]) == ["worker"] and first.records == []


def test_a_layer_stopped_only_on_its_thread_is_not_joined_from_another_and_says_why():
    entered, release = threading.Event(), threading.Event()
    out = {}

    def worker():
        try:
            with sync_recorder(layers="fake_profiler,fake_process") as rec:
                entered.set()
                release.wait(10)
                fake_sync("worker")
            out["rec"] = rec
        except BaseException as exc:  # noqa: BLE001
            out["exc"] = exc
            entered.set()

    t = threading.Thread(target=worker, name="other")
    with sync_recorder(layers="fake_profiler,fake_process") as main:
        t.start()
        assert entered.wait(10)
        release.set()
        t.join(10)
    assert "exc" not in out, out.get("exc")
    rec = out["rec"]
    assert rec.ran == ["fake_process"] and "thread 'MainThread'" in rec.unavailable["fake_profiler"]
    assert [r.layer for r in rec.records] == ["fake_process"]
    assert [(r.layer, r.thread) for r in main.records] == [("fake_profiler", "other")]


def test_a_region_left_with_no_layer_it_can_run_refuses_to_pass():
    entered = threading.Event()
    out = {}

    def worker():
        try:
            with no_host_sync(layers="fake_profiler"):
                pass
        except SyncCheckUnavailable as exc:
            out["exc"] = exc
        finally:
            entered.set()

    with sync_recorder(layers="fake_profiler"):
        t = threading.Thread(target=worker)
        t.start()
        assert entered.wait(10)
        t.join(10)
    assert "fake_profiler" in out["exc"].reasons


def test_harness_work_is_not_recorded_by_the_regions_around_it():
    x = torch.arange(3)
    with sync_recorder(watch=[x], layers=ALL) as rec:
        with harness_work():
            fake_sync("harness")
            x.tolist()
        fake_sync("user")
    assert sorted(lines(rec)) == ["user", "user"]


@pytest.fixture
def profiler_on_the_cpu(monkeypatch):
    """The runtime-API layer with its CUDA parts stubbed: torch's real profiler, CPU events."""
    from vllm_sparse_sync.testing.layers import runtime_api

    monkeypatch.setattr(runtime_api, "no_cuda_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_nested_regions_run_one_profiler_session_at_a_time(profiler_on_the_cpu, capfd):
    x = torch.arange(4)
    with sync_recorder(watch=[x], layers="runtime_api,sentinel") as outer:
        with sync_recorder(watch=[x], layers="runtime_api,sentinel") as inner:
            with sync_recorder(layers="runtime_api") as innermost:
                assert torch.autograd.profiler._is_profiler_enabled
            x.tolist()  # inner
        x.sum().item()  # outer
    assert outer.ran == inner.ran == ["runtime_api", "sentinel"] and innermost.ran == ["runtime_api"]
    assert [r.code for r in inner.records] == ["x.tolist()  # inner"]
    assert [r.code for r in outer.records] == ["x.sum().item()  # outer"]
    assert not torch.autograd.profiler._is_profiler_enabled
    assert "no active profiling session" not in capfd.readouterr().err


def test_a_profiler_the_user_runs_is_left_alone(profiler_on_the_cpu):
    x = torch.arange(4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with sync_recorder(watch=[x], layers="runtime_api,sentinel") as rec:
            x.tolist()
        assert torch.autograd.profiler._is_profiler_enabled
    assert rec.ran == ["sentinel"]
    assert "another torch profiler is running" in rec.unavailable["runtime_api"]
