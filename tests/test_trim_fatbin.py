"""tools/trim_fatbin.py on a synthetic ELF: the kept architecture's payloads and every header
stay byte for byte, the others become zeros, and a file with nothing to keep is refused."""

from __future__ import annotations

import importlib.util
import pathlib
import struct

import pytest

TOOL = pathlib.Path(__file__).resolve().parent.parent / "tools" / "trim_fatbin.py"


def _tool():
    spec = importlib.util.spec_from_file_location("trim_fatbin", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = struct.pack("<HHIQ", kind, 0, 64, len(payload)) + bytes(12) + struct.pack("<I", arch)
    return header + bytes(64 - len(header)) + payload


def _container(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf(section: bytes) -> bytes:
    """A minimal ELF64 LE file: a null section, ``.nv_fatbin`` (``section``) and the name table."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    data_off = 64
    names_off = data_off + len(section)
    shoff = (names_off + len(names) + 7) & ~7
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 3, 2)
    sh = bytes(64)
    sh += struct.pack("<IIQQQQIIQQ", 1, 1, 0, 0, data_off, len(section), 0, 0, 8, 0)
    sh += struct.pack("<IIQQQQIIQQ", 12, 3, 0, 0, names_off, len(names), 0, 0, 1, 0)
    blob = header + section + names
    return blob + bytes(shoff - len(blob)) + sh


def test_other_architectures_are_zeroed_and_the_layout_kept():
    tool = _tool()
    sass90, ptx90, sass80, sass120 = b"\x11" * 40, b"\x22" * 24, b"\x33" * 32, b"\x44" * 16
    section = (_container([_entry(2, 80, sass80), _entry(2, 90, sass90)]) + bytes(8)
               + _container([_entry(1, 90, ptx90), _entry(2, 120, sass120)]))
    data = _elf(section)
    out, stats = tool.trim(data, {90})
    assert len(out) == len(data)
    assert stats == {(2, 80): 32, (2, 90): 40, (1, 90): 24, (2, 120): 16}
    assert sass90 in out and ptx90 in out
    assert sass80 not in out and sass120 not in out
    changed = [i for i in range(len(data)) if out[i] != data[i]]
    zeroed = [data.index(sass80) + i for i in range(32)] + [data.index(sass120) + i for i in range(16)]
    assert changed == sorted(zeroed)  # nothing but the two payloads moved


def test_nothing_to_keep_is_refused():
    tool = _tool()
    data = _elf(_container([_entry(2, 80, b"\x01" * 8)]))
    with pytest.raises(ValueError, match="no entry for architectures"):
        tool.trim(data, {90})
    with pytest.raises(ValueError, match="not a 64-bit"):
        tool.trim(b"\0" * 64, {90})
