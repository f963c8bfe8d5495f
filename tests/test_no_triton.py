"""The CPU route needs neither Triton nor cuda-bindings: the docs' DCP example and the audit run
in processes (the spawned ranks included) where importing either fails, as after the README's
plain ``pip install "torch==..." -e .`` on a host without them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKED = ("triton", "cuda", "cuda.bindings")
SITECUSTOMIZE = f"""import sys
for _name in {BLOCKED!r}:  # importing these raises ModuleNotFoundError in this process
    sys.modules[_name] = None
"""


def _doc_snippet(doc: str, word: str) -> str:
    snippets = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, doc)).read(), re.S)
    found = [s for s in snippets if word in s]
    assert len(found) == 1, f"{doc} has {len(found)} snippets with {word!r}"
    return found[0]


def _run(argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    """``argv`` under Python with Triton and cuda-bindings blocked, this tree first on the path."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=env)


def test_the_block_holds_in_the_subprocess(tmp_path):
    proc = _run(["-c", "import triton"], tmp_path)
    assert proc.returncode != 0 and "triton" in proc.stderr


def test_the_dcp_example_runs_without_triton(tmp_path):
    script = tmp_path / "dcp_example.py"
    script.write_text(_doc_snippet("docs/kernels.md", "run_ranks(merge_two_ranks"))
    proc = _run([str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_audit_runs_without_triton(tmp_path):
    proc = _run(["-m", "vllm_sparse_sync.cli", "audit", "--batches", "1", "--device", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("audit: ok"), proc.stdout[-2000:]


@pytest.mark.parametrize("module", ["vllm_sparse_sync", "vllm_sparse_sync.kernels", "vllm_sparse_sync.distributed",
                                    "vllm_sparse_sync.audit"])
def test_the_package_imports_without_triton(module, tmp_path):
    proc = _run(["-c", f"import {module}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
