"""Command-line entry: ``vllm-sparse-sync audit``, ``selftest``, ``plan`` and ``prebuild``.

Usage errors are one line on stderr and exit status 2, checked before any work starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


DESCRIPTION = ("Check that sparse-attention indexer decode steps never synchronize the host: audit "
               "the bound paths, measure which torch ops sync (selftest), print a step's kernels "
               "(plan), compile the CUDA kernels ahead of time (prebuild).")

SEED_MAX = 2**63 - 1
"""Largest seed a batch may have (torch generators take 64-bit seeds)."""


class UsageError(Exception):
    """A bad option: reported as one line, exit status 2."""


def check_paths(paths: Sequence[str] | None, known: Sequence[str]) -> tuple[str, ...] | None:
    """The ``--path`` values, each known and named once (None: every path)."""
    if not paths:
        return None
    unknown = [p for p in paths if p not in known]
    if unknown:
        raise UsageError(f"--path: unknown path(s) {', '.join(unknown)}; known: {', '.join(known)}")
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise UsageError(f"--path: {', '.join(twice)} named more than once")
    return tuple(paths)


def check_seed(seed: int, paths: int, batches: int) -> None:
    """Refuse a seed whose batches' seeds (``seed + i * batches + j``) leave ``[0, 2**63 - 1]``."""
    if batches < 1:
        raise UsageError(f"--batches: must be >= 1, got {batches}")
    last = seed + paths * batches - 1
    if seed < 0 or last > SEED_MAX:
        raise UsageError(f"--seed: the batches' seeds (seed + path * batches + batch) must lie in "
                         f"[0, 2**63 - 1]; got --seed {seed} with {paths} path(s) x {batches} batches")


def check_output_path(option: str, path: str | None) -> None:
    """Refuse an output file that cannot be written, before the work that fills it."""
    if not path:
        return
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise UsageError(f"{option}: {path} is a directory")
    if not os.path.isdir(folder):
        raise UsageError(f"{option}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise UsageError(f"{option}: {path} is not writable")


def parse_device(text: str | None):
    """A torch device that exists here, or a UsageError saying why not."""
    import torch

    if not text:
        return None
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"--device: {text!r} is not a torch device ({str(exc).splitlines()[0]})") from None
    if device.type == "cuda":
        from .testing.cuda_env import no_cuda_reason

        reason = no_cuda_reason()
        if reason:
            raise UsageError(f"--device {text}: {reason}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif device.type != "cpu":
        raise UsageError(f"--device: {text!r}: the audit runs on cpu or cuda")
    return device


def _vllm_audit_module():
    """`vllm_sparse_sync.vllm.audit`, or a UsageError saying why vLLM cannot be audited here."""
    from importlib import metadata

    from .vllm_plugin import UnsupportedVllm, check_vllm_version

    try:  # the version without importing vLLM: its CPU setup must come first
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise UsageError('--target vllm: vLLM is not installed (pip install -e ".[vllm]", see the '
                         "README's Checking vLLM)") from None
    try:
        check_vllm_version(version)
    except UnsupportedVllm as exc:
        raise UsageError(f"--target vllm: {exc}") from None
    from .vllm import audit

    return audit


def _audit_vllm(args: argparse.Namespace) -> int:
    if args.device:
        raise UsageError("--device: the vLLM audit runs vLLM's builder where vLLM resolves its platform")
    if args.batches < 1:
        raise UsageError(f"--batches: must be >= 1, got {args.batches}")
    check_output_path("--json", args.json)
    va = _vllm_audit_module()
    paths = check_paths(args.path, va.VLLM_PATHS) or va.VLLM_PATHS
    check_seed(args.seed, len(paths), args.batches)
    try:
        baseline = va.load_baseline(args.baseline)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--baseline: {exc}") from None
    rows = va.run_vllm_audit(paths, seed=args.seed, batches=args.batches, with_plugin=args.with_plugin,
                             baseline=baseline)
    print(va.format_table(rows, baseline))
    if args.json:
        with open(args.json, "w") as f:
            f.write(va.rows_to_json(rows) + "\n")
    return 0 if all(r.ok for r in rows) else 1


def _audit(args: argparse.Namespace) -> int:
    if args.target == "vllm":
        return _audit_vllm(args)
    if args.with_plugin or args.baseline:
        raise UsageError("--with-plugin and --baseline apply to --target vllm")
    from .audit import AUDIT_PATHS, default_device, format_report, rows_to_json, run_audit

    known = {p.name: p for p in AUDIT_PATHS}
    names = check_paths(args.path, tuple(known))
    paths = tuple(known[p] for p in names) if names else AUDIT_PATHS
    check_seed(args.seed, len(paths), args.batches)
    check_output_path("--json", args.json)
    device = parse_device(args.device) or default_device()
    rows = run_audit(paths, device=device, seed=args.seed, batches=args.batches)
    print(format_report(rows, device))
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_to_json(rows) + "\n")
    return 0 if all(r.ok for r in rows) else 1


def _selftest(args: argparse.Namespace) -> int:
    try:
        from .testing import layers as layer_registry
        from .testing.selftest import main as selftest_main
    except ImportError as e:  # the harness is optional at import time
        raise UsageError(f"selftest needs vllm_sparse_sync.testing ({e})") from None
    check_output_path("--json", args.json)
    try:
        layers = layer_registry.parse_layers(args.layers) or ()
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--layers: {exc}") from None
    why = {name: layer_registry.unavailable_reason(name) for name in layers}
    if layers and all(why.values()):  # nothing would be measured: never report ok for that
        reasons = "; ".join(f"{name}: {reason}" for name, reason in why.items())
        print(f"vllm-sparse-sync selftest: nothing could run here, so nothing was measured ({reasons})",
              file=sys.stderr)
        return 1
    for name, reason in why.items():
        if reason:
            print(f"vllm-sparse-sync selftest: {name} is not measured here ({reason})", file=sys.stderr)
    argv = ["--layers", args.layers] + (["--json", args.json] if args.json else [])
    return int(selftest_main(argv) or 0)


def _prebuild(args: argparse.Namespace) -> int:
    import json

    import torch

    from .kernels.cuda import nvrtc_cache
    from .kernels.cuda.topk import CompileError
    from .kernels.cuda.prebuild import parse_arch, prebuild

    check_output_path("--json", args.json)
    if args.arch:
        try:
            capability = parse_arch(args.arch)
        except ValueError as exc:
            raise UsageError(f"--arch: {exc}") from None
    elif torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    else:
        raise UsageError("no CUDA device here to take the arch from: name one, e.g. --arch sm_90 "
                         "(H100, H200)")
    environ = dict(os.environ)
    if args.cache_dir:
        environ[nvrtc_cache.DIR_ENV] = args.cache_dir
    try:
        rows = prebuild(capability, environ, progress=lambda line: print(line, flush=True))
    except CompileError as exc:
        print(f"vllm-sparse-sync prebuild: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(rows, indent=1) + "\n")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from . import IndexerLayout, IndexerStep
    from .bounds import capture_stable_bound
    from .kernels.config import parse_config
    from .kernels.device import sm90_device_info
    from .step import step_plan

    try:
        layout = IndexerLayout(backend=args.backend, compress_ratio=args.compress_ratio, topk=args.topk,
                               page_size=args.page_size, max_model_len=args.max_model_len)
        config = parse_config(args.config)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if args.max_rows < 1:
        raise UsageError(f"--max-rows: must be >= 1, got {args.max_rows}")
    pages = -(-capture_stable_bound(layout) // layout.page_size)
    if args.sm90 is not None:
        if args.sm90 < 1:
            raise UsageError(f"--sm90: an SM count >= 1, got {args.sm90}")
        print(step_plan(layout, args.max_rows, pages, sm90_device_info(args.sm90), config))
        return 0
    import torch

    device = parse_device(args.device) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(repr(IndexerStep(layout, max_rows=args.max_rows, max_pages_per_req=pages, device=device, config=config)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``vllm-sparse-sync`` command."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="vllm-sparse-sync", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"vllm-sparse-sync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    audit = sub.add_parser("audit", help="run every bound path through builder and kernels "
                                         "(--target vllm: vLLM's own builder)")
    audit.add_argument("--target", choices=("project", "vllm"), default="project",
                       help="project: this package's builder and kernels (default); vllm: vLLM's own "
                            "indexer builder on every path it has (needs vLLM)")
    audit.add_argument("--with-plugin", action="store_true",
                       help="--target vllm: also the bound this project's vLLM plugin puts in "
                            "vLLM's metadata")
    audit.add_argument("--baseline", metavar="FILE",
                       help="--target vllm: known upstream syncs to accept (JSON list of {file, function, "
                            "code or op, why, link}); default: the ones found in vLLM 0.33")
    audit.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list to FILE")
    audit.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    audit.add_argument("--path", action="append", help="audit only this path (repeatable, each once)")
    audit.add_argument("--seed", type=int, default=0,
                       help="random seed of the first batch (default 0); batch j of path i has "
                            "seed + i * batches + j")
    audit.add_argument("--batches", type=int, default=None, metavar="N",
                       help="random batches per path; each row reports the worst (default 4; "
                            "--target vllm: 2)")
    audit.set_defaults(func=_audit)
    selftest = sub.add_parser("selftest", help="measure which torch ops synchronize, per layer")
    selftest.add_argument("--layers", default="sentinel,debug_mode,trace,runtime_api,capture",
                          help="comma-separated layers to measure (default: all)")
    selftest.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    selftest.set_defaults(func=_selftest)
    plan = sub.add_parser("plan", help="print the kernels a decode step takes at each row count")
    plan.add_argument("--backend", choices=("b12x", "deepgemm"), default="b12x",
                      help="the host contract (default b12x: the block table's width)")
    plan.add_argument("--max-model-len", type=int, default=131072, metavar="TOKENS")
    plan.add_argument("--compress-ratio", type=int, default=1, metavar="R")
    plan.add_argument("--page-size", type=int, default=64, metavar="ROWS")
    plan.add_argument("--topk", type=int, default=2048, metavar="K")
    plan.add_argument("--max-rows", type=int, default=256, metavar="N", help="most decode rows a step (default 256)")
    plan.add_argument("--config", default="", metavar="FIELD=VALUE,...",
                      help="KernelConfig choices, e.g. precise=false,topk=radix")
    plan.add_argument("--device", help="plan on this torch device (default: cuda if available, else cpu)")
    plan.add_argument("--sm90", type=int, metavar="SMS",
                      help="plan for an sm_90 GPU of SMS SMs with NVRTC (H100, H200: 132), on any host")
    plan.set_defaults(func=_plan)
    pre = sub.add_parser("prebuild", help="compile the CUDA kernels into the NVRTC cubin cache ahead of "
                                          "time (no GPU needed)")
    pre.add_argument("--arch", help="the GPU's arch, e.g. sm_90 for H100/H200 (default: this host's GPU)")
    pre.add_argument("--cache-dir", metavar="DIR",
                     help="the cache folder (default: $VLLM_SPARSE_SYNC_CACHE_DIR, else "
                          "$XDG_CACHE_HOME/vllm_sparse_sync/nvrtc, else "
                          "~/.cache/vllm_sparse_sync/nvrtc)")
    pre.add_argument("--json", metavar="FILE", help="also write one row a module as JSON to FILE")
    pre.set_defaults(func=_prebuild)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vllm-sparse-sync`` console script."""
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "audit" and args.batches is None:
        args.batches = 2 if args.target == "vllm" else 4
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"vllm-sparse-sync {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
