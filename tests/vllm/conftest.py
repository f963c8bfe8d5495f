"""Without vLLM the modules that need it cannot import: they are not collected (rather than each
counted as one skipped module, which made the summary's total differ from the collected count);
``test_vllm_import.py`` runs everywhere and checks this choice."""

from __future__ import annotations

from vllm_sparse_sync.testing.vllm_env import vllm_installed

NEEDS_VLLM = ["test_vllm_audit.py", "test_vllm_builder.py", "test_vllm_regions.py", "test_vllm_suite.py"]
collect_ignore = [] if vllm_installed() else list(NEEDS_VLLM)
