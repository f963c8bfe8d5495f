"""vLLM's own indexer, sparse-MLA and MLA tests under ``pytest --sync-vllm``, unedited.

    python -m vllm_sparse_sync.testing.vllm_suite [--cache DIR] [--workers N] [--list] [pytest args]

vLLM's wheel ships no tests, so this gets them from the PyPI source release (sdist) of the vLLM
version installed here, checks its sha256 (pinned for the versions listed in `PINNED`, else the
one PyPI publishes), caches it, and extracts only ``tests/`` and ``pyproject.toml`` (vLLM's pytest
configuration). It then runs the suite in vLLM's offline environment (no Hugging Face Hub
lookups), with nothing else exported: the plugin prepares the process itself. Tests that fail on
a host for reasons that are not this project's are deselected, each with its reason, printed
every run. The exit code is pytest's.

Needs vLLM and its test dependencies: ``pip install "vllm-sparse-sync[vllm-tests]"``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from importlib import metadata
from urllib.parse import urljoin

PYPI = "https://pypi.org/pypi/vllm"
PINNED = {"0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"}
"""sha256 of vLLM sdists checked by hand; another version takes the digest PyPI publishes."""
TEST_DEPS = {"tblib": "tblib", "multiprocess": "multiprocess"}  # module -> package
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}
OFFLINE_ENV_TEXT = " ".join(f"{k}={v}" for k, v in OFFLINE_ENV.items())

SUITE = (
    "tests/v1/attention/test_*indexer*.py",
    "tests/v1/attention/test_*sparse*.py",
    "tests/v1/attention/test_kpool*.py",
    "tests/v1/attention/test_mla_*.py",
    "tests/v1/worker/test_*kpool*.py",
    "tests/kernels/test_*indexer*.py",
    "tests/kernels/test_*sparse*.py",
    "tests/kernels/test_*kpool*.py",
    "tests/kernels/attention/test_*indexer*.py",
    "tests/kernels/attention/test_*sparse*.py",
    "tests/model_executor/layers/test_*indexer*.py",
    "tests/models/*/test_*indexer*.py",
)
"""vLLM's indexer, sparse-MLA, KV-pool tail and MLA test files (globs in the sdist)."""

DESELECT = {
    "tests/v1/attention/test_mla_prefill_quant_output.py":
        "imports compile_flash_attn_varlen_func_from_specs, which the 0.33.0 wheel's "
        "vllm/v1/attention/backends/fa_utils.py does not have (the sdist's test and the wheel disagree)",
}
"""Tests of the suite that fail on every host for reasons not this project's."""

_NO_GPU = "needs a CUDA device and does not skip without one (torch: 'Found no NVIDIA driver')"
DESELECT_CPU = {
    "tests/kernels/attention/test_flashmla_sparse.py::"
    "test_deepseek_v4_c128a_adaptive_width_has_capture_stable_stride": _NO_GPU,
    "tests/kernels/attention/test_flashmla_sparse.py::test_flashinfer_mixed_sparse_indices": _NO_GPU,
    "tests/kernels/test_fused_indexer_q_rope_quant.py": _NO_GPU,
    "tests/kernels/test_kpool_decode_update_batched.py": _NO_GPU,
    "tests/v1/attention/test_flashinfer_mla_sparse_sm90.py::test_plan_uses_state_params": _NO_GPU,
    "tests/v1/attention/test_indexer_deepseek_v4_slot_mapping.py::"
    "test_indexer_prefill_budget_matches_compressed_workspace":
        "builds a ModelConfig for 'Qwen/Qwen3-0.6B', which needs the model's files from the Hugging "
        "Face Hub (the run is offline)",
    "tests/v1/attention/test_rocm_glm5next_sparse.py::test_rocm_long_bf16_prefill_dispatch": _NO_GPU,
    "tests/v1/attention/test_rocm_glm5next_sparse.py::test_rocm_sparse_triton_route_preserves_padded_sinks":
        _NO_GPU,
}
"""Tests of the suite that fail on a host without a CUDA device for reasons not this project's."""


def installed_vllm() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise SystemExit('vLLM is not installed: pip install "vllm-sparse-sync[vllm-tests]"') from None


def _json(url: str):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)


def sdist_info(version: str) -> tuple[str, str]:
    """(URL, sha256) of vLLM `version`'s sdist on PyPI."""
    try:
        files = _json(f"{PYPI}/{version}/json")["urls"]
        base = f"{PYPI}/{version}/json"
    except Exception:  # noqa: BLE001 - some mirrors serve only the project page
        files = _json(f"{PYPI}/json")["releases"].get(version, [])
        base = f"{PYPI}/json"
    for f in files:
        if f.get("packagetype") == "sdist":
            return urljoin(base, f["url"]), f["digests"]["sha256"]
    raise SystemExit(f"PyPI lists no source release (sdist) for vLLM {version}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(version: str, cache: str) -> str:
    """The sdist of vLLM `version` in `cache` (downloaded once), its sha256 checked every time."""
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"vllm-{version}.tar.gz")
    want = PINNED.get(version)
    if os.path.exists(path) and want is not None and _sha256(path) == want:
        return path
    url, published = sdist_info(version)
    if want is not None and published != want:
        raise SystemExit(f"PyPI's sha256 for vllm-{version}.tar.gz is {published}, not the pinned {want}")
    want = want or published
    if os.path.exists(path) and _sha256(path) == want:
        return path
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=300) as r:
            shutil.copyfileobj(r, out)
        got = _sha256(tmp)
        if got != want:
            raise SystemExit(f"{url}: sha256 {got}, expected {want}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def extract_tests(tarball: str, dest: str) -> str:
    """`tests/` and `pyproject.toml` of the sdist, under `dest`; returns the source root."""
    digest = _sha256(tarball)
    with tarfile.open(tarball) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        root = os.path.join(dest, top)
        done = os.path.join(root, ".vllm_sparse_sync_extracted")
        if os.path.exists(done) and open(done).read() == digest:
            return root
        wanted = []
        for m in tar.getmembers():
            parts = m.name.split("/")
            if len(parts) < 2 or parts[0] != top or ".." in parts or m.name.startswith("/"):
                continue
            if not (m.isfile() or m.isdir()):
                continue
            if parts[1] == "tests" or m.name == f"{top}/pyproject.toml":
                wanted.append(m)
        if os.path.isdir(root):
            shutil.rmtree(root)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=wanted, filter="data")
        else:  # names were checked above
            tar.extractall(dest, members=wanted)
    with open(done, "w") as f:
        f.write(digest)
    return root


def suite_files(root: str) -> list[str]:
    files = sorted({os.path.relpath(p, root) for pattern in SUITE
                    for p in glob.glob(os.path.join(root, pattern))})
    if not files:
        raise SystemExit(f"{root}: no test file matches the suite ({', '.join(SUITE)})")
    return files


def deselected(cuda: bool) -> dict[str, str]:
    """What this host leaves out of the suite, and why."""
    return {**DESELECT, **({} if cuda else DESELECT_CPU)}


def missing_test_deps() -> list[str]:
    return [pkg for mod, pkg in TEST_DEPS.items() if importlib.util.find_spec(mod) is None]


def default_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm-sparse-sync")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_sparse_sync.testing.vllm_suite",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=os.environ.get("VLLM_SPARSE_SYNC_CACHE") or default_cache(),
                        help="where the sdist and its tests are kept (default: %(default)s)")
    parser.add_argument("--workers", default="2", help="pytest-xdist workers (-n), default 2")
    parser.add_argument("--list", action="store_true", help="print the files and deselections, run nothing")
    args, pytest_args = parser.parse_known_args(argv)
    missing = missing_test_deps()
    if missing:
        print(f"vLLM's tests need {', '.join(missing)}: pip install \"vllm-sparse-sync[vllm-tests]\"",
              file=sys.stderr)
        return 2
    version = installed_vllm()
    tarball = fetch(version, args.cache)
    root = extract_tests(tarball, args.cache)
    files = suite_files(root)
    from .vllm_env import cuda_device_present

    skip = deselected(cuda_device_present())
    print(f"vLLM {version}: {len(files)} test files from {tarball} (sha256 checked)")
    for node, why in skip.items():
        print(f"  deselected {node}: {why}")
    if args.list:
        print("\n".join(files))
        return 0
    files = [f for f in files if f not in skip]  # a whole file left out is not collected
    options = ["--sync-vllm", "-p", "no:cacheprovider", "-n", args.workers,
               *(f"--deselect={n}" for n in skip if "::" in n), *pytest_args]
    print(f"$ cd {root} && {OFFLINE_ENV_TEXT} python -m pytest <{len(files)} files> {' '.join(options)}",
          flush=True)
    return subprocess.call([sys.executable, "-m", "pytest", *files, *options], cwd=root,
                           env={**os.environ, **OFFLINE_ENV})


if __name__ == "__main__":
    raise SystemExit(main())
