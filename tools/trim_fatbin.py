"""Zero the device code a shared library carries for other GPUs, so that it compresses small.

    python tools/trim_fatbin.py IN.so OUT.so [--keep 90]

The CUDA fat binaries in the ``.nv_fatbin`` section keep their layout (every header, size and
offset stays); only the payloads of entries for architectures other than ``--keep`` (SASS and
PTX) become zeros, which xz then compresses to nothing. The runtime loads the entry that
matches the device, so on that device the library behaves as before. benchmarks/peers.sh uses
this to fit vLLM's top-k ops (``_C_stable_libtorch``, 64 MB compressed in full) beside DeepGEMM in
one device transfer.
"""

from __future__ import annotations

import argparse
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
"""the magic number of a fat binary container's header"""


def elf_section(data: bytes, name: str) -> tuple[int, int]:
    """File offset and size of the ELF64 little-endian section ``name``."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    str_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        base = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", data, base)
        end = data.index(b"\0", str_off + name_off)
        if data[str_off + name_off:end].decode() == name:
            off, size = struct.unpack_from("<QQ", data, base + 0x18)
            return off, size
    raise ValueError(f"no section {name}")


def fatbin_entries(data: bytes, start: int, size: int):
    """``(kind, arch, payload_offset, payload_size)`` of every entry of the containers in
    ``data[start:start + size]`` (kind 1: PTX, 2: SASS)."""
    pos, end = start, start + size
    while pos + 16 <= end:
        magic, _version, header, body = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned; skip padding
            continue
        p, stop = pos + header, pos + header + body
        while p < stop:
            kind, _flags, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
            arch, = struct.unpack_from("<I", data, p + 28)
            yield kind, arch, p + entry_header, payload
            p += entry_header + payload
        pos = stop


def trim(data: bytes, keep: set[int]) -> tuple[bytearray, dict]:
    """A copy of ``data`` with the payloads of entries for architectures not in ``keep`` zeroed,
    and the bytes kept and zeroed per ``(kind, arch)``."""
    out = bytearray(data)
    start, size = elf_section(data, ".nv_fatbin")
    stats: dict[tuple[int, int], int] = {}
    for kind, arch, off, n in fatbin_entries(data, start, size):
        stats[(kind, arch)] = stats.get((kind, arch), 0) + n
        if arch not in keep:
            out[off:off + n] = bytes(n)
    if not stats:
        raise ValueError("the .nv_fatbin section holds no fat binary")
    if not any(arch in keep for _, arch in stats):
        raise ValueError(f"no entry for architectures {sorted(keep)}: {sorted(stats)}")
    return out, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--keep", default="90",
                    help="comma-separated SM architectures to keep (90: sm_90/sm_90a)")
    a = ap.parse_args()
    keep = {int(x) for x in a.keep.split(",")}
    data = open(a.src, "rb").read()
    try:
        out, stats = trim(data, keep)
    except ValueError as exc:
        sys.exit(f"trim_fatbin: {a.src}: {exc}")
    open(a.dst, "wb").write(out)
    for (kind, arch), n in sorted(stats.items()):
        print(f"{'PTX ' if kind == 1 else 'SASS'} sm_{arch}: {n / 1e6:7.2f} MB "
              f"{'kept' if arch in keep else 'zeroed'}")


if __name__ == "__main__":
    main()
