"""vllm_sparse_sync.vllm without vLLM: a clear ImportError, and the rest of the package unaffected.

Runs everywhere (subprocesses that hide vLLM), vLLM installed or not.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_without_vllm(code: str) -> subprocess.CompletedProcess:
    hide = "import sys\nsys.modules['vllm'] = None  # as if vLLM were not installed\n"
    return subprocess.run([sys.executable, "-c", hide + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


def test_import_without_vllm_names_the_extra():
    proc = run_without_vllm("""
        try:
            import vllm_sparse_sync.vllm
        except ImportError as err:
            print(type(err).__name__, err.name, err)
        else:
            print("imported")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ModuleNotFoundError vllm "), proc.stdout
    assert 'pip install "vllm-sparse-sync[vllm]"' in proc.stdout


def test_rest_of_package_never_imports_it():
    proc = run_without_vllm("""
        import vllm_sparse_sync, vllm_sparse_sync.audit, vllm_sparse_sync.cli, vllm_sparse_sync.testing
        import vllm_sparse_sync.testing.plugin, vllm_sparse_sync.scenarios
        print(sorted(m for m in sys.modules if m.startswith("vllm_sparse_sync.vllm")))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
