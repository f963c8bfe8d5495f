"""Which cluster top-k entries compile to the same code in two copies of ``topk.cu``.

    python tools/ptx_diff.py --source old.cu [--define NAME=VALUE] [--show ENTRY]

NVRTC compiles the library's source and ``--source`` to PTX for ``compute_90a`` (no GPU needed);
each ``topk_cluster_*`` entry's body is compared after register numbers, labels, parameter
names, the scratch struct's declaration and mangled helper names are normalised away, so a
change that leaves an entry's instructions alone reads ``same`` (e.g. the slots entries changed
without touching the positions entries' code). ``--show ENTRY``
prints that entry's normalised diff. Exits 1 when an entry of the old source differs or is gone.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers

from vllm_sparse_sync.kernels.cuda import topk as cuda_topk  # noqa: E402

ENTRY = re.compile(r"\.entry (topk_cluster_\w+)\((.*?)\)\s*(?:\.\w+[^{]*)?\{(.*?)\n\}", re.S)
NORMALISE = (
    (re.compile(r"%(r|rd|p|f|rs|h)\d+"), r"%\1"),  # register numbers
    (re.compile(r"\$L__BB\d+_\d+"), "L"),  # labels
    (re.compile(r"topk_cluster_\w+_param_\d+"), "PARAM"),
    (re.compile(r"\.reg .*\n"), ""),  # register counts
    (re.compile(r"\.shared \.align \d+ \.b8 _ZZ\w+E2sc\[\d+\];"), "SCRATCH"),  # its size
    (re.compile(r"_ZZ\w+E2sc"), "SC"),
    (re.compile(r"_Z\d+\w+?EEv\w*"), "HELPER"),  # an out-of-line helper's mangled name
)


def entries(ptx: str) -> dict[str, str]:
    """Each ``topk_cluster_*`` entry's body in ``ptx``."""
    return {m.group(1): m.group(3) for m in ENTRY.finditer(ptx)}


def normalise(body: str) -> str:
    for pattern, repl in NORMALISE:
        body = pattern.sub(repl, body)
    return body


def compare(old: dict[str, str], new: dict[str, str]) -> dict[str, str]:
    """``entry -> "same" | "differs" | "gone"`` for every entry of ``old``."""
    return {name: "gone" if name not in new else
            ("same" if normalise(old[name]) == normalise(new[name]) else "differs") for name in old}


def ptx_of(text: str, defines: list[str]) -> str:
    code, _ = cuda_topk.compile_source("sm_90a", output="ptx", text=text,
                                       extra_options=tuple(f"-D{d}" for d in defines))
    return code.decode(errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True,
                    help="the other copy of topk.cu (e.g. an earlier commit's)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a macro for both compiles (repeatable)")
    ap.add_argument("--show", default="", help="print this entry's normalised diff")
    a = ap.parse_args()
    try:
        with open(a.source) as f:
            other = f.read()
    except OSError as exc:
        raise SystemExit(f"--source: {exc}") from None
    old, new = entries(ptx_of(other, a.define)), entries(ptx_of(cuda_topk.source(), a.define))
    result = compare(old, new)
    for name, verdict in result.items():
        print(f"{name}: {verdict}")
    print(f"{sum(v == 'same' for v in result.values())}/{len(result)} entries the same")
    if a.show:
        if a.show not in old or a.show not in new:
            raise SystemExit(f"--show: no entry {a.show!r} in both")
        print("\n".join(difflib.unified_diff(normalise(old[a.show]).splitlines(),
                                             normalise(new[a.show]).splitlines(), lineterm="", n=1)))
    sys.exit(0 if all(v == "same" for v in result.values()) else 1)


if __name__ == "__main__":
    main()
