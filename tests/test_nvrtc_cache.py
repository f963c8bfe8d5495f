"""The on-disk cubin cache (``kernels.nvrtc_cache``): a hit only for the same source compiled the
same way, a damaged entry a miss, a folder it cannot use no error; and ``cuda_topk.module_cubin``
with the real NVRTC (skipped with the reason when it is absent)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_sparse_sync.kernels.cuda import topk as cuda_topk
from vllm_sparse_sync.kernels.cuda import nvrtc_cache

NVRTC_OK, NVRTC_WHY = cuda_topk.compiler_status()


class Compiler:
    """A stand-in for NVRTC that counts its calls."""

    def __init__(self, out: bytes = b"\x7fELF cubin bytes") -> None:
        self.out, self.calls = out, 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.out


def _cached(tmp_path, fn, **kw):
    args = dict(text="__global__ void k() {}", name="k.cu", target="sm_90a", options=(),
                compiler="NVRTC 12.9")
    args.update(kw)
    return nvrtc_cache.cached(fn, environ={nvrtc_cache.DIR_ENV: str(tmp_path)}, **args)


def test_second_call_is_a_hit_with_the_same_bytes(tmp_path):
    fn = Compiler()
    assert _cached(tmp_path, fn) == (fn.out, "compiled")
    assert _cached(tmp_path, fn) == (fn.out, "cache")
    assert fn.calls == 1
    (entry,) = [p for p in os.listdir(tmp_path) if p.endswith(".cubin")]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
    assert os.stat(tmp_path / entry).st_mode & 0o444 == 0o444  # other users' processes can read it


FIELDS = ("text", "name", "target", "options", "compiler")
BASE = dict(text="__global__ void k() {}", name="k.cu", target="sm_90a", options=("-lineinfo",),
            compiler="NVRTC 12.9; cuda-bindings 12.9.0")


@given(field=st.sampled_from(FIELDS), change=st.text(min_size=1, max_size=12))
def test_any_change_of_what_the_cubin_depends_on_changes_the_key(field, change):
    other = dict(BASE)
    other[field] = (*BASE["options"], change) if field == "options" else BASE[field] + change
    assert nvrtc_cache.entry_key(**BASE) != nvrtc_cache.entry_key(**other)
    assert nvrtc_cache.entry_key(**BASE) == nvrtc_cache.entry_key(**dict(BASE))


def test_options_are_not_concatenated_into_one_another():
    a = dict(BASE, options=("-a", "b"))
    b = dict(BASE, options=("-ab",))
    assert nvrtc_cache.entry_key(**a) != nvrtc_cache.entry_key(**b)


def test_a_changed_source_is_compiled_again(tmp_path):
    fn = Compiler()
    _cached(tmp_path, fn)
    fn2 = Compiler(b"other")
    changes = [dict(text="__global__ void k2() {}"), dict(compiler="NVRTC 13.0"), dict(target="sm_100a"),
               dict(options=("-lineinfo",)), dict(name="j.cu")]
    for change in changes:
        assert _cached(tmp_path, fn2, **change) == (b"other", "compiled"), change
    assert fn2.calls == len(changes)
    assert _cached(tmp_path, fn) == (fn.out, "cache")  # the first entry is still there


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "digest_only"])
def test_a_damaged_entry_is_a_miss_and_is_rewritten(tmp_path, damage):
    fn = Compiler()
    _cached(tmp_path, fn)
    (path,) = [tmp_path / p for p in os.listdir(tmp_path)]
    blob = path.read_bytes()
    path.write_bytes({
        "flip": blob[:3] + bytes([blob[3] ^ 1]) + blob[4:],
        "truncate": blob[:-1],
        "empty": b"",
        "digest_only": blob[-nvrtc_cache.DIGEST:],
    }[damage])
    assert _cached(tmp_path, fn) == (fn.out, "compiled")
    assert fn.calls == 2
    assert path.read_bytes() == blob  # rewritten whole
    assert _cached(tmp_path, fn) == (fn.out, "cache")


def test_a_folder_it_cannot_create_costs_a_compile_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    fn = Compiler()
    assert _cached(blocker / "cache", fn) == (fn.out, "compiled")
    assert _cached(blocker / "cache", fn) == (fn.out, "compiled")
    assert fn.calls == 2


def test_a_failed_compile_stores_nothing(tmp_path):
    def broken():
        raise cuda_topk.CompileError("bad source")

    with pytest.raises(cuda_topk.CompileError):
        _cached(tmp_path, broken)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", ["0", "off", "false", "No"])
def test_the_switch_turns_it_off(tmp_path, value):
    env = {nvrtc_cache.DIR_ENV: str(tmp_path), nvrtc_cache.SWITCH_ENV: value}
    assert nvrtc_cache.cache_dir(env) is None
    fn = Compiler()
    for _ in range(2):
        assert nvrtc_cache.cached(fn, text="t", name="k.cu", target="sm_90", compiler="c",
                                  environ=env) == (fn.out, "compiled (cache off)")
    assert fn.calls == 2 and os.listdir(tmp_path) == []


def test_where_the_folder_is(tmp_path):
    assert nvrtc_cache.cache_dir({nvrtc_cache.DIR_ENV: str(tmp_path)}) == str(tmp_path)
    assert nvrtc_cache.cache_dir({"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "vllm_sparse_sync", "nvrtc")
    home = nvrtc_cache.cache_dir({})
    assert home == os.path.join(os.path.expanduser("~"), ".cache", "vllm_sparse_sync", "nvrtc")
    assert nvrtc_cache.cache_dir({nvrtc_cache.SWITCH_ENV: "1", nvrtc_cache.DIR_ENV: " "}) == home


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_module_cubin_compiles_once_then_loads_from_disk(tmp_path, monkeypatch):
    """With the real NVRTC: the first call compiles a small kernel and stores it, the second
    returns the same cubin while NVRTC would fail, and another compiler version misses."""
    monkeypatch.setenv(nvrtc_cache.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(nvrtc_cache.SWITCH_ENV, raising=False)
    text = 'extern "C" __global__ void cache_probe(int* x) { x[threadIdx.x] += 1; }\n'
    first, origin = cuda_topk.module_cubin("sm_90", text=text, name="probe.cu")
    assert origin == "compiled" and first[:4] == b"\x7fELF"
    assert cuda_topk.compiler_identity().startswith("NVRTC ")

    def no_nvrtc(*a, **k):
        raise AssertionError("compiled although the cache holds the cubin")

    monkeypatch.setattr(cuda_topk, "compile_source", no_nvrtc)
    assert cuda_topk.module_cubin("sm_90", text=text, name="probe.cu") == (first, "cache")
    monkeypatch.setattr(cuda_topk, "compiler_identity", lambda: "NVRTC 99.0; cuda-bindings x")
    with pytest.raises(AssertionError, match="compiled although"):
        cuda_topk.module_cubin("sm_90", text=text, name="probe.cu")


def _race_one(args):
    directory, i = args
    data = bytes(range(256)) * 64  # the same cubin from every process, as one compile gives
    got, origin = nvrtc_cache.cached(lambda: data, text="t", name="k.cu", target="sm_90", compiler="c",
                                     environ={nvrtc_cache.DIR_ENV: directory})
    return got == data, origin


def test_processes_racing_on_one_entry_all_get_whole_cubins(tmp_path):
    """Eight processes asking for one missing entry at once: each gets the whole cubin (its own
    compile or another's entry, never a torn one), one entry is left and no temporary file."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(4) as pool:
        results = pool.map(_race_one, [(str(tmp_path), i) for i in range(8)])
    assert all(ok for ok, _ in results), results
    assert {origin for _, origin in results} <= {"compiled", "cache"}
    assert sorted(os.listdir(tmp_path)) == [nvrtc_cache.entry_key("t", "k.cu", "sm_90", (), "c") + ".cubin"]
    assert _race_one((str(tmp_path), 8)) == (True, "cache")
