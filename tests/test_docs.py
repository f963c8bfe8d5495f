"""The README's Python snippets run as written, and the runnable example passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNIPPETS = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "README.md")).read(), re.S)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_written(i, tmp_path):
    script = tmp_path / f"snippet_{i}.py"
    script.write_text(SNIPPETS[i])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_harness_example_passes_and_catches_its_planted_read():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                           os.path.join(ROOT, "examples", "harness")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout
    assert "scalar_read=1" in proc.stdout  # the careless builder's .item() was seen (listed with -v)
