"""The step under several kernel configs, interleaved in one process: which config is faster, shape by shape.

    python tools/step_ab.py --shapes 1x65536,64x65536 --base precise=false \\
        --config triton: --config cuda:planner.CUDA_FP8_SCORER_MIN_TOKENS=1 [--serving] [--rounds 3] [--json F]

Each ``--config NAME:ASSIGNMENTS`` (over ``--base``; the first is the baseline) is a ``KernelConfig``
(``precise=false,topk=radix``: as ``indexer.py --config``) and planner constants set while its
routes are planned (``planner.NAME=INT``: a threshold's A/B); each config gets its own workspace: the call's own size (as ``indexer.py``'s fp8 step), or with
``--serving`` a serving runner's (``max(B, indexer.SERVING_ROWS)`` rows, 128K wide, as its exact
step). For every shape, each config's step and its scorer alone (the route's kernel and splits, into that
workspace's logits) are captured as CUDA graphs of rotated inputs and replayed interleaved
(``graph_timer.interleaved_replay_us``), ``--rounds`` times over, in rotated order; the median of
the rounds is reported. Checked first: each step's selection is an exact top-k of the logits its
own scorer wrote (rows 0-1), and each config's logits are compared with the baseline's (largest
difference relative to the largest score). Prints a table (us, ratio to the baseline) and writes
JSON; exits 1 after them if a selection failed its check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_root, os.path.join(_root, "benchmarks"), os.path.join(_root, "tools")]  # package, helpers
from cold_start import require_cuda, shapes_arg  # noqa: E402


def parse_named(text: str) -> tuple[str, str]:
    """``"NAME:ASSIGNMENTS"`` -> (NAME, ASSIGNMENTS); the name is required, the assignments may be empty."""
    name, sep, assignments = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"expected NAME:ASSIGNMENTS (e.g. cuda:planner.CUDA_SCORER_MIN_ROWS=1), got {text!r}")
    return name.strip(), assignments.strip()


def split_constants(text: str) -> tuple[str, dict[str, int]]:
    """``text``'s ``KernelConfig`` assignments and its ``planner.NAME=INT`` constants (each a
    constant the planner has, with an int value), apart."""
    from vllm_sparse_sync.kernels import planner

    rest, constants = [], {}
    for item in (s.strip() for s in text.split(",") if s.strip()):
        key, _, raw = item.partition("=")
        if not key.strip().startswith("planner."):
            rest.append(item)
            continue
        name = key.strip()[len("planner."):]
        if not name.isupper() or not isinstance(getattr(planner, name, None), int):
            raise ValueError(f"config key {key.strip()!r}: the planner has no int constant {name!r}")
        try:
            constants[name] = int(raw)
        except ValueError:
            raise ValueError(f"config key {key.strip()!r}: takes an int, got {raw.strip()!r}") from None
    return ",".join(rest), constants


class Variant:
    """One named config: its ``KernelConfig`` and the planner constants its routes are planned with."""

    def __init__(self, config, constants: dict[str, int]):
        self.config, self.constants = config, constants

    def __enter__(self):
        from vllm_sparse_sync.kernels import planner

        self._saved = {n: getattr(planner, n) for n in self.constants}
        for n, v in self.constants.items():
            setattr(planner, n, v)
        return self.config

    def __exit__(self, *exc):
        from vllm_sparse_sync.kernels import planner

        for n, v in self._saved.items():
            setattr(planner, n, v)


def joined(base: str, assignments: str) -> str:
    """``--base`` and one config's assignments as one ``indexer.parse_config`` text (the config's win)."""
    return ",".join(t for t in (base, assignments) if t)


def summarise(B: int, L: int, names: list[str], rounds: list[dict[str, float]], extra: dict) -> dict:
    """One shape's row: each config's median step and scorer over the rounds, and its ratio to the first's."""
    row = dict(B=B, L=L, **extra)
    for part in ("step", "scorer"):
        for name in names:
            row[f"{part}_{name}"] = round(statistics.median(r[f"{part}_{name}"] for r in rounds), 3)
    first = names[0]
    for name in names[1:]:
        row[f"step_{name}_over_{first}"] = round(row[f"step_{name}"] / row[f"step_{first}"], 4)
    row["rounds"] = rounds
    return row


def table(rows: list[dict], names: list[str]) -> str:
    """Markdown: per shape, each config's step (its scorer kind) and scorer, and the ratios."""
    first = names[0]
    cols = (["B", "L"] + [f"step {n}" for n in names] + [f"scorer {n}" for n in names]
            + [f"{n} / {first}" for n in names[1:]] + ["check"])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in rows:
        cells = [str(r["B"]), str(r["L"])]
        cells += [f"{r[f'step_{n}']:.2f} ({r[f'kind_{n}']})" for n in names]
        cells += [f"{r[f'scorer_{n}']:.2f}" for n in names]
        cells += [f"{r[f'step_{n}_over_{first}']:.3f}" for n in names[1:]]
        cells.append(r["check"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure(B: int, L: int, configs: dict, serving: bool, rounds: int, iters: int) -> dict:
    """One shape under every config (name -> ``Variant``), interleaved; each config's routes are
    planned (and memoized by its workspace) under its own planner constants."""
    import indexer as ix
    from graph_timer import interleaved_replay_us

    from vllm_sparse_sync.kernels import ops as tk
    from vllm_sparse_sync.kernels.verify import topk_violations
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    copies, ncalls = ix.graph_sizes(B, L)
    inp = ix.Inputs(B, L, copies)
    out = torch.empty(B, ix.TOPK, dtype=torch.int32, device=ix.DEV)
    named, extra, bad, base_logits, spaces = {}, {}, [], None, {}
    for name, variant in configs.items():
        with variant as cfg:  # the route planned and memoized under the variant's constants
            ws = (IndexerTopkWorkspace(max(B, ix.SERVING_ROWS), ix.TOPK, ix.WIDE, ix.DEV, config=cfg) if serving
                  else IndexerTopkWorkspace(B, ix.TOPK, L, ix.DEV, config=cfg))
            spaces[name] = ws
            route = ws.plan_call(B, L, ix.PAGE)
            got = tk.indexer_topk(*inp.args(0), ix.TOPK, width=L, workspace=ws)
        extra[f"kind_{name}"] = route.scorer
        extra[f"splits_{name}"] = route.score_splits
        logits = ws.logits[:B, :L].clone()
        rows = min(B, 2)
        bad += [f"{name}: {v}" for v in topk_violations(got[:rows], logits[:rows], inp.lens[:rows], ix.TOPK)]
        if base_logits is None:
            base_logits = logits
        else:
            fin = torch.isfinite(base_logits)
            extra[f"logits_{name}_max_rel"] = float((logits - base_logits).abs()[fin].max()
                                                    / base_logits[fin].abs().max())
        calls = ix.step_calls(inp, ws, out)  # the step and its scorer as indexer.py times them
        for part in ("step", "scorer"):
            named[f"{part}_{name}"] = [lambda i=i, f=calls[part]: f(i) for i in range(ncalls)]
    extra["ncalls"] = ncalls
    times = [interleaved_replay_us(named, iters) for _ in range(rounds)]
    extra["check"] = "ok" if not bad else bad[0]
    return summarise(B, L, list(configs), times, extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x65536,64x65536")
    ap.add_argument("--base", default="",
                    help="assignments every config starts from (KernelConfig fields, planner.NAME=INT)")
    ap.add_argument("--config", action="append", default=[],
                    help="NAME:ASSIGNMENTS; the first is the baseline")
    ap.add_argument("--serving", action="store_true",
                    help="serving-size workspaces (indexer.py's exact step's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15, help="interleaved replays of each graph a round")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = shapes_arg(ap, a.shapes)
    import indexer as ix

    if len(a.config) < 2:
        ap.error("--config: give at least two (NAME:ASSIGNMENTS), the first the baseline")
    configs = {}
    for text in a.config:
        try:
            name, assignments = parse_named(text)
            if name in configs:
                raise ValueError(f"config name {name!r} given twice")
            rest, constants = split_constants(joined(a.base, assignments))
            configs[name] = Variant(ix.parse_config(rest), constants)
        except (ValueError, TypeError, KeyError) as exc:
            ap.error(f"--config: {exc}")
    if a.rounds < 1 or a.iters < 1:
        ap.error("--rounds and --iters: must be >= 1")
    require_cuda("step_ab.py")
    rows = []
    for B, L in shapes:
        rows.append(measure(B, L, configs, a.serving, a.rounds, a.iters))
        print(table(rows[-1:], list(configs)), flush=True)
        torch.cuda.empty_cache()
    print(table(rows, list(configs)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(base=a.base, configs=a.config, serving=a.serving, shapes=rows), f, indent=1)
    failed = failed_checks(rows)
    if failed:
        print(f"error: a step's selection failed its check: {'; '.join(failed)}", file=sys.stderr)
        sys.exit(1)


def failed_checks(rows: list[dict]) -> list[str]:
    """``"BxL: why"`` of every shape whose check (each config's step, rows 0-1) failed."""
    return [f"{r['B']}x{r['L']}: {r['check']}" for r in rows if r["check"] != "ok"]


if __name__ == "__main__":
    main()
