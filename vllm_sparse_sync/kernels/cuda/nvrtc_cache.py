"""On-disk cache of NVRTC-compiled cubins, so a later process loads a module instead of compiling it.

An entry is named by a digest of everything the cubin depends on (source text, target, options,
the compiler's version) and ends with a digest of its own bytes; an entry that fails that check
is a miss (the digest guards against damage, not tampering: the folder is trusted as Triton's
cache is). Entries are readable by every user (an image prebuilt as root serves a non-root
process). The cache only ever saves time: when the folder cannot be read or written, the call
compiles as if there were none.

``VLLM_SPARSE_SYNC_CACHE_DIR`` moves the folder (default ``$XDG_CACHE_HOME/vllm_sparse_sync/nvrtc``,
else ``~/.cache/vllm_sparse_sync/nvrtc``); ``VLLM_SPARSE_SYNC_NVRTC_CACHE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Mapping

DIR_ENV = "VLLM_SPARSE_SYNC_CACHE_DIR"
SWITCH_ENV = "VLLM_SPARSE_SYNC_NVRTC_CACHE"
FORMAT = 1
"""bump when the entry layout or the key's fields change"""
DIGEST = 32  # sha256 trailer bytes


def cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The cache folder the environment names, or None when the cache is off."""
    env = os.environ if environ is None else environ
    if env.get(SWITCH_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    explicit = env.get(DIR_ENV, "").strip()
    if explicit:
        return os.path.expanduser(explicit)
    base = env.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm_sparse_sync", "nvrtc")


def entry_key(text: str, name: str, target: str, options: tuple[str, ...], compiler: str) -> str:
    """The entry's file stem: a digest of the source and of how it is compiled (``compiler``:
    the compiler's identity, e.g. ``"NVRTC 12.9"``)."""
    h = hashlib.sha256()
    for part in (f"format {FORMAT}", compiler, target, name, *options, "\0source\0", text):
        h.update(part.encode())
        h.update(b"\0")
    return f"{name.rsplit('.', 1)[0]}-{target}-{h.hexdigest()[:32]}"


def entry_path(directory: str, key: str) -> str:
    return os.path.join(directory, key + ".cubin")


def read_entry(directory: str, key: str) -> bytes | None:
    """The cached bytes of ``key``, or None when absent, unreadable or failing their digest."""
    try:
        with open(entry_path(directory, key), "rb") as f:
            blob = f.read()
    except OSError:
        return None
    data, tail = blob[:-DIGEST], blob[-DIGEST:]
    if len(blob) <= DIGEST or hashlib.sha256(data).digest() != tail:
        return None
    return data


def write_entry(directory: str, key: str, data: bytes) -> bool:
    """Store ``data`` under ``key`` (written aside, then renamed into place); whether it was stored."""
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(data) + hashlib.sha256(bytes(data)).digest())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a prebuilt entry from other users
        os.replace(tmp, entry_path(directory, key))
        return True
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


def cached(
    compile_fn: Callable[[], bytes], *, text: str, name: str, target: str, options: tuple[str, ...] = (),
    compiler: str, environ: Mapping[str, str] | None = None,
) -> tuple[bytes, str]:
    """``(cubin, origin)``: the cached cubin for this source and compiler, else ``compile_fn()``'s,
    then stored; ``origin`` is ``"cache"``, ``"compiled"`` or ``"compiled (cache off)"``."""
    directory = cache_dir(environ)
    if directory is None:
        return compile_fn(), "compiled (cache off)"
    key = entry_key(text, name, target, options, compiler)
    hit = read_entry(directory, key)
    if hit is not None:
        return hit, "cache"
    data = bytes(compile_fn())
    write_entry(directory, key, data)
    return data, "compiled"
