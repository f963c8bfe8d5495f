"""Known reads are keyed by what they are (file, function, code), never by line number: a line
planted above a known read changes nothing, a moved known read stays known, a new read in the
same function is still new, and the record names the line where the read is today."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vllm_sparse_sync.testing import HostSyncError, no_host_sync, sync_recorder
from vllm_sparse_sync.testing.known import (
    KnownRead,
    accept_known_reads,
    forget_known_reads,
    known_reads,
    normalize_code,
)

UPSTREAM = '''\
import torch


def build_chunks(seq_lens):
    cu = torch.cumsum(seq_lens, 0)
{above}    total = int(cu[-1].item())  # upstream: reads the total back
{new}    return total
'''
KNOWN = KnownRead("upstream_pkg/chunks.py", "build_chunks", code="total = int(cu[-1].item())",
                  why="upstream reads the total back")


@pytest.fixture
def upstream(tmp_path):
    """Load a fresh copy of an 'upstream' module written with the given edits."""
    pkg = tmp_path / "upstream_pkg"
    pkg.mkdir()
    path = pkg / "chunks.py"
    loads = iter(range(1000))

    def load(above: str = "", new: str = "", edit=lambda text: text):
        path.write_text(edit(UPSTREAM.format(above=above, new=new)))
        import linecache

        linecache.checkcache(str(path))
        spec = importlib.util.spec_from_file_location(f"upstream_chunks_{next(loads)}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    accept_known_reads([KNOWN])
    yield load
    forget_known_reads()


def _run(mod):
    seq_lens = torch.tensor([3, 4, 5])
    with sync_recorder(watch=[seq_lens], layers="sentinel") as rec:
        mod.build_chunks(seq_lens)
    return rec.records


def test_a_known_read_is_allowed_and_named_where_it_is(upstream):
    (rec,) = _run(upstream())
    assert rec.known and rec.allowed == "upstream reads the total back"
    assert rec.location.endswith("chunks.py:6")


def test_a_line_planted_above_changes_nothing(upstream):
    mod = upstream(above="    cu = cu + 0  # a line planted above\n    pass\n")
    (rec,) = _run(mod)
    assert rec.known and rec.location.endswith("chunks.py:8")  # today's line
    lens = torch.tensor([1, 2])
    with no_host_sync(watch=[lens], layers="sentinel") as check:
        mod.build_chunks(lens)  # a known read does not fail a check
    assert [r.known for r in check.records] == [True]


def test_a_reformatted_known_read_stays_known(upstream):
    mod = upstream(edit=lambda text: text.replace("total = int(cu[-1].item())",
                                                  "total = int( cu[ -1 ].item() )"))
    (rec,) = _run(mod)
    assert rec.known and "int( cu[ -1 ].item() )" in rec.code


def test_a_new_read_in_the_same_function_is_new(upstream):
    mod = upstream(new="    total += int(seq_lens.max())  # a new read\n")
    records = _run(mod)
    known = [r for r in records if r.known]
    new = [r for r in records if not r.allowed]
    assert len(known) == 1 and [r.code for r in new] == ["total += int(seq_lens.max())  # a new read"]
    lens = torch.tensor([1, 2])
    with pytest.raises(HostSyncError, match="a new read"):
        with no_host_sync(watch=[lens], layers="sentinel"):
            mod.build_chunks(lens)


def test_same_code_in_another_function_or_file_is_not_known():
    assert KNOWN.matches("/x/upstream_pkg/chunks.py", "build_chunks", "total = int(cu[-1].item())")
    assert not KNOWN.matches("/x/upstream_pkg/chunks.py", "other", "total = int(cu[-1].item())")
    assert not KNOWN.matches("/x/other_upstream_pkg/chunks.py", "build_chunks", "total = int(cu[-1].item())")
    assert not KNOWN.matches("/x/upstream_pkg/chunks.py", "build_chunks", "total = int(cu[0].item())")


def test_code_is_compared_without_comments_and_whitespace():
    assert normalize_code("  x = int(a[-1].item())  # why") == normalize_code("x=int( a[ -1 ].item() )")
    assert normalize_code("x = '#not a comment'") != normalize_code("x = ''")
    assert normalize_code("foo(a,") == "foo(a,"  # part of a longer statement


def test_a_read_without_a_line_is_known_by_its_op():
    by_op = KnownRead("ext/lib.py", "plan", op="cudaStreamSynchronize")
    assert by_op.matches("/site/ext/lib.py", "plan", "def plan(self):", "cudaStreamSynchronize via x")
    assert not by_op.matches("/site/ext/lib.py", "plan", "def plan(self):", "cudaDeviceSynchronize")


@pytest.mark.parametrize("entry, words", [
    ({"site": "vllm/x.py:1895", "why": "w"}, "'site' (vllm/x.py:1895) is a file:line"),
    ({"file": "x.py", "code": "a"}, "missing 'function'"),
    ({"file": "x.py", "function": " ", "code": "a"}, "'function' must be a non-empty string"),
    ({"file": "x.py", "function": "f"}, "give its 'code'"),
    ({"file": "x.py", "function": "f", "code": "a", "line": 3}, "unknown field(s) line"),
    ("x.py:3", "expected an object"),
])
def test_bad_baseline_entries_are_refused_naming_the_field(entry, words):
    with pytest.raises(ValueError, match="baseline\\[0\\]") as err:
        KnownRead.from_dict(entry, where="baseline[0]")
    assert words in str(err.value)


def test_accepted_reads_are_listed_and_forgotten():
    before = known_reads()
    accept_known_reads([KNOWN])
    try:
        assert known_reads()[-1] == KNOWN
        assert KnownRead.from_dict(KNOWN.to_dict()) == KNOWN
    finally:
        forget_known_reads()
        accept_known_reads(before)
