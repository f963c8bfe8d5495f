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


def test_the_modules_that_need_vllm_are_collected_exactly_where_it_is_installed():
    import importlib.util
    import pathlib

    from vllm_sparse_sync.testing.vllm_env import vllm_installed

    here = pathlib.Path(__file__).parent
    spec = importlib.util.spec_from_file_location("vllm_tests_conftest", here / "conftest.py")
    vllm_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_conftest)
    assert all((here / name).exists() for name in vllm_conftest.NEEDS_VLLM)
    assert vllm_conftest.collect_ignore == ([] if vllm_installed() else vllm_conftest.NEEDS_VLLM)
