"""The runner of vLLM's own suite, without vLLM: the sdist is taken only with the right sha256,
only its tests and pytest configuration are extracted, and --sync-vllm without vLLM is a usage
error that says what to install."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

import pytest

from vllm_sparse_sync.testing import vllm_suite

pytest_plugins = ["pytester"]


def _sdist(path, version="9.9.9", extra=()):
    """A small stand-in sdist: tests, pyproject, package source, and hostile members."""
    top = f"vllm-{version}"
    members = {f"{top}/tests/__init__.py": b"",
               f"{top}/tests/v1/attention/test_kpool_x.py": b"def test_x():\n    pass\n",
               f"{top}/pyproject.toml": b"[tool.pytest.ini_options]\n", f"{top}/vllm/__init__.py": b"boom\n",
               **dict(extra)}
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_fetch_takes_the_sdist_only_with_its_sha256(tmp_path, monkeypatch):
    src = tmp_path / "src.tar.gz"
    digest = _sdist(src)
    cache = tmp_path / "cache"
    monkeypatch.setattr(vllm_suite, "sdist_info", lambda version: (src.as_uri(), digest))
    path = vllm_suite.fetch("9.9.9", str(cache))
    assert open(path, "rb").read() == src.read_bytes()
    monkeypatch.setitem(vllm_suite.PINNED, "9.9.9", "0" * 64)  # pinned: PyPI's digest must agree
    with pytest.raises(SystemExit, match="not the pinned"):
        vllm_suite.fetch("9.9.9", str(cache))
    monkeypatch.setitem(vllm_suite.PINNED, "9.9.9", digest)
    monkeypatch.setattr(vllm_suite, "sdist_info", lambda version: pytest.fail("cached: no lookup"))
    assert vllm_suite.fetch("9.9.9", str(cache)) == path  # from the cache, checked


def test_a_download_with_another_digest_is_refused_and_not_kept(tmp_path, monkeypatch):
    src = tmp_path / "src.tar.gz"
    _sdist(src)
    monkeypatch.setattr(vllm_suite, "sdist_info", lambda version: (src.as_uri(), "1" * 64))
    with pytest.raises(SystemExit, match="expected 1111"):
        vllm_suite.fetch("9.9.9", str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []


def test_only_tests_and_the_pytest_configuration_are_extracted(tmp_path):
    src = tmp_path / "src.tar.gz"
    _sdist(src, extra={"vllm-9.9.9/tests/../../evil.py": b"x", "/abs/evil.py": b"x"})
    root = vllm_suite.extract_tests(str(src), str(tmp_path / "out"))
    found = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    assert found == [".vllm_sparse_sync_extracted", "pyproject.toml", "tests/__init__.py",
                     "tests/v1/attention/test_kpool_x.py"]
    assert not (tmp_path / "evil.py").exists()
    assert vllm_suite.suite_files(root) == ["tests/v1/attention/test_kpool_x.py"]
    assert vllm_suite.extract_tests(str(src), str(tmp_path / "out")) == root  # once


def test_every_deselection_has_a_reason_and_cpu_ones_only_without_cuda():
    assert set(vllm_suite.deselected(cuda=True)) == set(vllm_suite.DESELECT)
    cpu = vllm_suite.deselected(cuda=False)
    assert set(cpu) == set(vllm_suite.DESELECT) | set(vllm_suite.DESELECT_CPU)
    assert all(node.startswith("tests/") and len(why) > 20 for node, why in cpu.items())


def test_sync_vllm_without_vllm_says_what_to_install(pytester, monkeypatch):
    from vllm_sparse_sync.testing.vllm_env import vllm_installed

    if vllm_installed():
        pytest.skip("vLLM is installed here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))  # this tree
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--sync-vllm")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert 'vLLM is not installed (pip install "vllm-sparse-sync[vllm]")' in result.stderr.str()
    pytester.makeini("[pytest]\nsync_vllm = true\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
