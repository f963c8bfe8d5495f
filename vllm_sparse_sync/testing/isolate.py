"""Run a step in a fresh Python process, for layers whose hooks cannot be undone (trace)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

from .layers.trace import ENV
from .records import SyncRecord


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    mod, qual = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not mod or mod == "__main__" or "<locals>" in qual:
        raise ValueError("run_isolated needs an importable module-level function "
                         "(or a 'module:function' string)")
    return f"{mod}:{qual}"


def _load(name: str) -> Callable:
    mod, _, qual = name.partition(":")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def run_isolated(target, *, layers: Sequence[str] = ("trace",), warmup: int = 1,
                 repeat: int = 1, timeout: float = 300.0) -> list[SyncRecord]:
    """Run `target()` in a subprocess under `sync_recorder(layers=...)`; return its records.

    `target` builds its own inputs (a module-level function or "module:function"); it is
    called `warmup` times unrecorded, then `repeat` times recorded. The subprocess may use
    the GPU trace hooks (they die with it).
    """
    name = _target_name(target)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.json")
        env = dict(os.environ)
        env[ENV] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        cmd = [sys.executable, "-m", __name__, name, ",".join(layers), str(warmup),
               str(repeat), out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=os.getcwd())
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"isolated run of {name} failed (rc {proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        with open(out) as f:
            data = json.load(f)
    if data["unavailable"]:
        missing = ", ".join(f"{k} ({v})" for k, v in data["unavailable"].items())
        raise RuntimeError(f"isolated run of {name}: layers could not run: {missing}")
    return [SyncRecord.from_dict(d) for d in data["records"]]


def _child(argv: Sequence[str]) -> int:
    name, layer_spec, warmup, repeat, out = argv
    from .guard import SyncCheckUnavailable, sync_recorder

    fn = _load(name)
    rec = sync_recorder(layers=layer_spec or None)
    if rec.unavailable:
        with open(out, "w") as f:
            json.dump({"records": [], "unavailable": rec.unavailable}, f)
        return 0
    for _ in range(int(warmup)):
        fn()
    try:
        with rec:
            for _ in range(int(repeat)):
                fn()
    except SyncCheckUnavailable as exc:
        with open(out, "w") as f:
            json.dump({"records": [], "unavailable": exc.reasons}, f)
        return 0
    with open(out, "w") as f:
        json.dump({"records": [r.to_dict() for r in rec.records],
                   "unavailable": rec.unavailable}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1:]))
