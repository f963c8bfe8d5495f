"""Plain-text tables for the command-line reports (audit, vLLM audit, selftest)."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a table: ``head``, a rule, then ``rows``, columns left-aligned two spaces apart."""
    cells = [list(head), *(list(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(head))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
