"""Known syncs (a library's upstream host reads that a run accepts), keyed by what they are.

A known read names its file (a path suffix), its function and the source text of its line, so
an edit above it, a patch release that moves it, or a reformat leaves it known, while a new read
in the same function (other code) stays new. A read seen without its own line (a profiler record
that names only the function around an extension call) is named by its op instead. Each match
prints the file:line where the read is today.
"""

from __future__ import annotations

import io
import tokenize
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

FIELDS = ("file", "function", "code", "op", "why", "link")


def normalize_code(line: str) -> str:
    """A source line without its comment and whitespace: what the code is, however it is laid out."""
    line = line.strip()
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(line + "\n").readline)
                  if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                                    tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)]
    except (tokenize.TokenError, IndentationError, SyntaxError):  # part of a longer statement
        return "".join(line.split("#", 1)[0].split())
    return "".join(t.string for t in tokens)


def _path_matches(filename: str, suffix: str) -> bool:
    path = filename.replace("\\", "/")
    suffix = suffix.replace("\\", "/").lstrip("/")
    return path == suffix or path.endswith("/" + suffix)


@dataclass(frozen=True)
class KnownRead:
    """One accepted sync: in `file` (a path suffix), in `function`, on a line whose code is `code`
    (compared without comments and whitespace), or, with no `code`, any sync there whose op
    contains `op`. `why` and `link` are shown with it."""

    file: str
    function: str
    code: str = ""
    op: str = ""
    why: str = ""
    link: str = ""

    def __post_init__(self):
        for name in ("file", "function"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"known read: {name!r} must be a non-empty string, got {value!r}")
        if not (self.code.strip() or self.op.strip()):
            raise ValueError(f"known read in {self.file} {self.function}: give its 'code' (the source "
                             "line) or its 'op'")
        object.__setattr__(self, "_norm", normalize_code(self.code) if self.code else "")

    @classmethod
    def from_dict(cls, data: Mapping, where: str = "known read") -> KnownRead:
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected an object with file, function and code, "
                             f"got {type(data).__name__}")
        if "site" in data and "code" not in data and "op" not in data:
            raise ValueError(f"{where}: 'site' ({data['site']}) is a file:line, which the next release "
                             "moves; name the read by 'file', 'function' and 'code' (its source line)")
        missing = [k for k in ("file", "function") if k not in data]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(repr(k) for k in missing)} (file: a path suffix "
                             "such as vllm/v1/attention/backends/mla/indexer.py; function: its name)")
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; fields: {', '.join(FIELDS)}")
        try:
            return cls(**{k: data[k] for k in FIELDS if k in data})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v}

    def matches(self, filename: str, function: str, code: str, op: str = "") -> bool:
        if function != self.function or not _path_matches(filename, self.file):
            return False
        if self.code:
            return normalize_code(code) == self._norm
        return self.op in op


_known: list[KnownRead] = []


def accept_known_reads(reads: Iterable[KnownRead]) -> None:
    """Record syncs matching these as allowed (shown every run with their reason, never counted)."""
    _known.extend(reads)


def known_reads() -> list[KnownRead]:
    """The accepted reads (a copy)."""
    return list(_known)


def forget_known_reads() -> None:
    _known.clear()


def find_known(filename: str, function: str, code: str, op: str = "",
               reads: Iterable[KnownRead] | None = None) -> KnownRead | None:
    """The known read that a sync at this file, function and line of code (or op) is, if any."""
    for read in _known if reads is None else reads:
        if read.matches(filename, function, code, op):
            return read
    return None
