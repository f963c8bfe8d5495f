"""The Python snippets of the README and docs/ run as written, and the runnable example passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))]
SNIPPETS = [(doc, i, code) for doc in DOCS
            for i, code in enumerate(re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, doc)).read(), re.S))]


def test_the_readme_has_snippets():
    assert len([s for s in SNIPPETS if s[0] == "README.md"]) >= 2


@pytest.mark.parametrize("doc, i, code", SNIPPETS, ids=[f"{d}:{i}" for d, i, _ in SNIPPETS])
def test_snippet_runs_as_written(doc, i, code, tmp_path):
    script = tmp_path / f"snippet_{i}.py"
    script.write_text(code)
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
