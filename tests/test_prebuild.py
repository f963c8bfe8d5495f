"""``vllm-sparse-sync prebuild``: it fills the cubin cache with exactly the entries the modules
look up when a device loads them (NVRTC stood in by a fast fake; the real compile is
``test_nvrtc_cache.py``'s), and refuses bad input in one line."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from vllm_sparse_sync.cli import main
from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer
from vllm_sparse_sync.kernels.cuda import topk as cuda_topk
from vllm_sparse_sync.kernels.cuda import nvrtc_cache
from vllm_sparse_sync.kernels.cuda import prebuild


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """compile_source replaced by a fake whose cubin is a digest of (arch, name, text); calls counted."""
    calls = []

    def fake(arch, *, output="cubin", extra_options=(), text=None, name="topk.cu"):
        body = cuda_topk.source() if text is None else text
        calls.append((arch, name))
        return hashlib.sha256(f"{arch}|{name}|{body}".encode()).digest() * 8, ""

    monkeypatch.setattr(cuda_topk, "compile_source", fake)
    monkeypatch.setattr(cuda_topk, "compiler_status", lambda: (True, "NVRTC fake"))
    monkeypatch.setattr(cuda_topk, "compiler_identity", lambda: "NVRTC fake")
    monkeypatch.setattr(cuda_topk, "supported_archs", lambda: (70, 75, 80, 90, 100))
    monkeypatch.delenv(nvrtc_cache.SWITCH_ENV, raising=False)
    return calls


def _no_compile(*a, **k):
    raise AssertionError("compiled: the prebuilt cache did not hold this module")


def test_prebuild_holds_what_every_module_of_an_h200_loads(tmp_path, fake_nvrtc, monkeypatch):
    env = {nvrtc_cache.DIR_ENV: str(tmp_path)}
    lines: list[str] = []
    rows = prebuild.prebuild((9, 0), env, progress=lines.append)
    assert [r["origin"] for r in rows] == ["compiled"] * 3
    assert sorted(fake_nvrtc) == sorted([("sm_90", "topk.cu")] * 2 + [("sm_90a", "scorer.cu")])
    assert any("already cached" not in ln and "compiled" in ln for ln in lines)
    # what cuda_topk._Module and cuda_scorer._Module call when a device loads them
    monkeypatch.setattr(cuda_topk, "compile_source", _no_compile)
    monkeypatch.setenv(nvrtc_cache.DIR_ENV, str(tmp_path))
    assert cuda_topk.module_cubin("sm_90")[1] == "cache"
    assert cuda_topk.module_cubin("sm_90", extra_options=cuda_topk.SLOTS_OPTIONS)[1] == "cache"
    assert cuda_scorer.build_cubin()[1] == "cache"
    # a second prebuild finds every module
    assert [r["origin"] for r in prebuild.prebuild((9, 0), env, progress=lines.append)] == ["cache"] * 3
    assert sum("already cached" in ln for ln in lines) == 3


def test_each_module_is_one_cache_entry(tmp_path, fake_nvrtc):
    prebuild.prebuild((9, 0), {nvrtc_cache.DIR_ENV: str(tmp_path)}, progress=lambda s: None)
    assert len([p for p in os.listdir(tmp_path) if p.endswith(".cubin")]) == 3


def test_only_a_9_0_device_gets_the_scorer_and_from_9_0_the_slots_module():
    assert [b.label for b in prebuild.builds_for((8, 0))] == ["CUDA top-k (sm_80)"]
    assert [b.label for b in prebuild.builds_for((9, 0))] == ["CUDA top-k (sm_90)", "CUDA top-k slots (sm_90)",
                                                             "CUDA scorer (sm_90a)"]
    assert [b.label for b in prebuild.builds_for((10, 0))] == ["CUDA top-k (sm_100)",
                                                              "CUDA top-k slots (sm_100)"]


@pytest.mark.parametrize("text, cap", [("sm_90", (9, 0)), ("sm_90a", (9, 0)), (" sm_80 ", (8, 0)),
                                       ("sm_100", (10, 0)), ("sm_120", (12, 0)), ("sm_70", (7, 0))])
def test_parse_arch(text, cap):
    assert prebuild.parse_arch(text) == cap


@pytest.mark.parametrize("text", ["90", "sm90", "sm_9", "compute_90", "sm_61", "sm_90b", ""])
def test_parse_arch_refuses(text):
    with pytest.raises(ValueError):
        prebuild.parse_arch(text)


def test_cli_prebuild_writes_json_and_names_the_folder(tmp_path, fake_nvrtc, capsys):
    out = tmp_path / "rows.json"
    assert main(["prebuild", "--arch", "sm_90", "--cache-dir", str(tmp_path / "c"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["origin"] for r in rows] == ["compiled"] * 3 and all(r["bytes"] > 0 for r in rows)
    assert str(tmp_path / "c") in capsys.readouterr().out
    assert len(os.listdir(tmp_path / "c")) == 3


def test_cli_prebuild_reports_a_compile_error(tmp_path, monkeypatch, capsys):
    def broken(*a, **k):
        raise cuda_topk.CompileError("NVRTC failed to compile topk.cu for sm_90:\nerror: x")

    monkeypatch.setattr(cuda_topk, "compile_source", broken)
    monkeypatch.setattr(cuda_topk, "compiler_status", lambda: (True, "NVRTC fake"))
    monkeypatch.setattr(cuda_topk, "compiler_identity", lambda: "NVRTC fake")
    monkeypatch.setattr(cuda_topk, "supported_archs", lambda: (90,))
    assert main(["prebuild", "--arch", "sm_90", "--cache-dir", str(tmp_path)]) == 1
    assert "NVRTC failed" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, env, words", [
    (["prebuild", "--arch", "sm_61"], {}, "7.0 or newer"),
    (["prebuild", "--arch", "hopper"], {}, "not an arch"),
    (["prebuild", "--arch", "sm_90", "--json", "/nonexistent/x.json"], {}, "does not exist"),
    (["prebuild", "--arch", "sm_90"], {nvrtc_cache.SWITCH_ENV: "0"}, "cache is off"),
])
def test_cli_prebuild_usage_errors_are_one_line(argv, env, words, monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cuda_topk, "compile_source", _no_compile)
    monkeypatch.setattr(cuda_topk, "compiler_status", lambda: (True, "NVRTC fake"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_prebuild_without_nvrtc_says_why(monkeypatch, capsys):
    monkeypatch.setattr(cuda_topk, "compiler_status", lambda: (False, "cuda-bindings is not installed"))
    assert main(["prebuild", "--arch", "sm_90"]) == 2
    assert "cuda-bindings is not installed" in capsys.readouterr().err


def test_an_arch_this_nvrtc_does_not_compile_for_is_refused_by_name(tmp_path, fake_nvrtc, monkeypatch, capsys):
    """A newer NVRTC drops old archs (CUDA 13: sm_70): prebuild says so instead of failing in NVRTC."""
    monkeypatch.setattr(cuda_topk, "supported_archs", lambda: (75, 80, 90))
    with pytest.raises(RuntimeError, match="does not compile for sm_70"):
        prebuild.prebuild((7, 0), {nvrtc_cache.DIR_ENV: str(tmp_path)}, progress=lambda s: None)
    assert main(["prebuild", "--arch", "sm_70", "--cache-dir", str(tmp_path)]) == 2
    assert "does not compile for sm_70" in capsys.readouterr().err
    assert fake_nvrtc == []  # refused before anything compiles
