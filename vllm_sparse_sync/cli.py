"""Command-line entry: ``vllm-sparse-sync audit`` and ``vllm-sparse-sync selftest``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _audit(args: argparse.Namespace) -> int:
    import torch

    from .audit import AUDIT_PATHS, format_table, rows_to_json, run_audit

    paths = AUDIT_PATHS
    if args.path:
        known = {p.name: p for p in AUDIT_PATHS}
        unknown = [p for p in args.path if p not in known]
        if unknown:
            print(f"error: --path: unknown path(s) {', '.join(unknown)}; known: {', '.join(known)}",
                  file=sys.stderr)
            return 2
        paths = tuple(known[p] for p in args.path)
    if args.batches < 1:
        print(f"error: --batches: must be >= 1, got {args.batches}", file=sys.stderr)
        return 2
    device = torch.device(args.device) if args.device else None
    rows = run_audit(paths, device=device, seed=args.seed, batches=args.batches)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_to_json(rows) + "\n")
    return 0 if all(r.ok for r in rows) else 1


def _selftest(args: argparse.Namespace) -> int:
    try:
        from .testing.selftest import main as selftest_main
    except ImportError as e:  # the harness is optional at import time
        print(f"error: selftest needs vllm_sparse_sync.testing ({e})", file=sys.stderr)
        return 2
    return int(selftest_main(args.rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``vllm-sparse-sync`` command."""
    parser = argparse.ArgumentParser(prog="vllm-sparse-sync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    audit = sub.add_parser("audit", help="run every bound path through builder and kernels")
    audit.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list to FILE")
    audit.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    audit.add_argument("--path", action="append", help="audit only this path (repeatable)")
    audit.add_argument("--seed", type=int, default=0,
                       help="random seed of the first batch (default 0); batch j of path i has "
                            "seed + i * batches + j")
    audit.add_argument("--batches", type=int, default=4, metavar="N",
                       help="random batches per path; each row reports the worst (default 4)")
    audit.set_defaults(func=_audit)
    selftest = sub.add_parser("selftest", help="measure which torch ops synchronize, per layer")
    selftest.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the selftest")
    selftest.set_defaults(func=_selftest)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vllm-sparse-sync`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
