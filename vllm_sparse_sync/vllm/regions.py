"""Every vLLM attention-metadata build as a checked region, with no test edits (`--sync-vllm`).

`install()` wraps `build()` of every `AttentionMetadataBuilder` subclass, those defined later
included (through the base class's `__init_subclass__`), and the sparse indexer's forward on the
platforms whose host-side setup precedes its kernels (`SparseAttnIndexer.forward_cuda`,
`forward_hip`, `forward_xpu`). Each call is one region on the process's default layers:

- the watch is the call's own data: the device fields of the `CommonAttentionMetadata` it gets
  (the `_cpu` twins and vLLM's host fields are not watched) and the builder's device buffers;
  a device field passed as its host twin itself is left out and named in the report, and the
  rest of the call is still checked;
- a sync inside fails the test with a `HostSyncError` at its file:line, unless vLLM allows it
  (`gpu_sync_allowed()`), the baseline of known upstream reads names it, or it is in the test's
  own code that the call ran (a stand-in passed in), which is shown as the test's;
- a call that nothing can check here (no layer can run) is reported as not checked, never
  passed as checked.

A builder's `build()` calling its base class's `build()` (or a wrapped method of its own) is the
same call; a builder calling another builder's `build()` opens a region inside it.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading

import torch
import vllm
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata

from ..testing.guard import SyncCheck, SyncCheckUnavailable
from ..testing.records import user_frame
from ..testing.watch import WatchList, device_tensors, is_host_name
from .watch import HOST_FIELDS

BUILD = "vllm_build"
FORWARD = "vllm_indexer_forward"
FORWARDS = ("forward_cuda", "forward_hip", "forward_xpu")
_MARK = "_vllm_sparse_sync_region"

_local = threading.local()
_state: dict = {"installed": False, "wrapped": [], "hook": None}


def _calls() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def builder_buffers(builder) -> WatchList:
    """The builder's device buffers: tensor attributes, the device side of its CPU/GPU buffers,
    and tensors in its lists, tuples and dicts (host-named attributes excluded)."""
    found = device_tensors({k: v for k, v in vars(builder).items()
                            if isinstance(v, (torch.Tensor, list, tuple, dict)) or hasattr(v, "gpu")},
                           depth=1)
    out = WatchList(found)
    out.unwatched = tuple(u.replace("dict.", "builder.", 1) if u.startswith("dict.") else u
                          for u in found.unwatched)
    return out


def metadata_watch(common) -> WatchList:
    """The device fields of `common` (not the `_cpu` twins, not vLLM's host fields)."""
    host = {id(getattr(common, n, None)) for n in HOST_FIELDS}
    found = device_tensors(common, depth=1)
    out = WatchList(t for t in found if id(t) not in host)
    prefix = f"{type(common).__name__}."
    out.unwatched = tuple(u.replace(prefix, "") for u in found.unwatched)
    return out


def call_watch(builder, common) -> WatchList:
    """What one `build()` call watches: the batch's device fields and the builder's buffers; host
    tensors of the batch never (a builder buffer that is one of them is left out)."""
    parts = [metadata_watch(common)] if common is not None and hasattr(common, "__dict__") else []
    parts.append(builder_buffers(builder))
    host = set()
    if common is not None and hasattr(common, "__dict__"):
        for name, value in vars(common).items():
            if isinstance(value, torch.Tensor) and (is_host_name(name) or name in HOST_FIELDS):
                host.add(id(value.untyped_storage()))
    out, seen = WatchList(), set()
    for part in parts:
        for t in part:
            if id(t) not in seen and id(t.untyped_storage()) not in host:
                seen.add(id(t))
                out.append(t)
    if any(t.device.type != "cpu" for t in out):  # on a device: host tensors are what they say
        out[:] = [t for t in out if t.device.type != "cpu"]
    out.unwatched = tuple(u for part in parts for u in part.unwatched)
    return out


def _find_metadata(args, kwargs):
    """The batch a `build()` call got: a `CommonAttentionMetadata` argument, else what is passed
    as `common_attn_metadata` (a test's stand-in object is read by the same naming rules)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, CommonAttentionMetadata):
            return value
    if "common_attn_metadata" in kwargs:
        return kwargs["common_attn_metadata"]
    return args[1] if len(args) > 1 else None


TEST_CODE = "the test's own code, run inside vLLM's call (a stand-in the test passed in)"


_VLLM_DIR = os.path.dirname(os.path.abspath(vllm.__file__)) + os.sep


def is_test_code(path: str) -> bool:
    """Whether `path` is a test's code: a test module (``test_*.py``, ``*_test.py``), a conftest,
    or a file in a ``tests``/``test`` folder (below site-packages, for installed packages);
    never a file of vLLM itself."""
    path = os.path.normpath(os.path.abspath(path))
    if path.startswith(_VLLM_DIR):
        return False
    parts = path.split(os.sep)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("site-packages", "dist-packages"):
            parts = parts[i + 1:]
            break
    name = parts[-1]
    return (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
            or any(p in ("tests", "test") for p in parts[:-1]))


def not_vllms(record) -> str:
    """Why a record is the test's own code and not the code under check (a sync in a stand-in
    that vLLM's call ran), or ""."""
    if record.attribution != "op":
        return ""
    path = record.location.rsplit(":", 1)[0]
    if path in ("?", "") or path.startswith("<"):
        return ""
    return TEST_CODE if is_test_code(path) else ""


def unchecked_reason(exc: SyncCheckUnavailable) -> str:
    """Why a call could not be checked, in a line."""
    reasons = {k: v for k, v in exc.reasons.items() if k != "capture"}
    sentinel = reasons.pop("sentinel", "")
    if sentinel.startswith("nothing watched") and all("CUDA" in v for v in reasons.values()):
        return ("no CUDA device, and nothing to watch: no device field apart from its host twins, "
                "no builder buffer")
    return "no layer can run: " + "; ".join(f"{k}: {v}" for k, v in {**reasons, "sentinel": sentinel}.items()
                                            if v)


def _caller() -> str:
    """file:line of the code that called the wrapped method (a test or vLLM)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return user_frame(frame).location


def _region(kind: str, owner, watch: WatchList, called_at: str) -> SyncCheck:
    cls = type(owner)
    what = "build()" if kind == BUILD else "forward"
    return SyncCheck(watch=watch, raise_on_sync=True, where=f"vLLM {cls.__name__}.{what} from {called_at}",
                     info={"kind": kind, "builder": f"{cls.__module__}.{cls.__qualname__}",
                           "called_at": called_at}, allow=not_vllms)


def _checked(kind: str, owner, watch_fn, call):
    """Run `call()` as a checked region of `owner` (once per call, whatever wraps inside it)."""
    stack = _calls()
    if stack and stack[-1] is owner:  # super().build() or another wrapped method of the same call
        return call()
    called_at = _caller()
    region = _region(kind, owner, watch_fn(), called_at)
    try:
        region.__enter__()
    except SyncCheckUnavailable as exc:
        region.info["unchecked"] = unchecked_reason(exc)
        region.finish()
        stack.append(owner)
        try:
            return call()
        finally:
            stack.pop()
    stack.append(owner)
    try:
        result = call()
    except BaseException:
        if not region.__exit__(*sys.exc_info()):
            raise
        return None  # torch's error-mode rejection became a record: the region raised for it
    else:
        region.__exit__(None, None, None)
        return result
    finally:
        stack.pop()


def _wrap_build(build):
    @functools.wraps(build)
    def build_checked(self, *args, **kwargs):
        common = _find_metadata(args, kwargs)
        return _checked(BUILD, self, lambda: call_watch(self, common), lambda: build(self, *args, **kwargs))

    setattr(build_checked, _MARK, build)
    return build_checked


def _wrap_forward(forward):
    @functools.wraps(forward)
    def forward_checked(self, *args, **kwargs):
        def watch():
            from vllm.forward_context import get_forward_context, is_forward_context_available

            meta = None
            if is_forward_context_available():
                attn = get_forward_context().attn_metadata
                prefix = getattr(getattr(self, "k_cache", None), "prefix", None)
                meta = attn.get(prefix) if isinstance(attn, dict) else None
            buffer = getattr(self, "topk_indices_buffer", None)
            return device_tensors([meta, list(args), dict(kwargs), buffer], depth=3)

        return _checked(FORWARD, self, watch, lambda: forward(self, *args, **kwargs))

    setattr(forward_checked, _MARK, forward)
    return forward_checked


def _wrap_class(cls) -> None:
    build = cls.__dict__.get("build")
    if build is None or not inspect.isfunction(build) or hasattr(build, _MARK):
        return
    if getattr(build, "__isabstractmethod__", False):
        return
    cls.build = _wrap_build(build)
    _state["wrapped"].append((cls, "build", build))


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _wrap_forwards() -> int:
    try:
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    except Exception:  # noqa: BLE001 - not importable on this platform: nothing to wrap
        return 0
    n = 0
    for name in FORWARDS:
        fn = SparseAttnIndexer.__dict__.get(name)
        if inspect.isfunction(fn) and not hasattr(fn, _MARK):
            setattr(SparseAttnIndexer, name, _wrap_forward(fn))
            _state["wrapped"].append((SparseAttnIndexer, name, fn))
            n += 1
    return n


def install() -> int:
    """Wrap every builder's `build()` (and builders defined from now on) and the indexer forward;
    returns how many methods were wrapped. Idempotent."""
    if _state["installed"]:
        return 0
    base = AttentionMetadataBuilder
    for cls in _subclasses(base):
        _wrap_class(cls)
    previous = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        _wrap_class(cls)

    _state["hook"] = previous
    base.__init_subclass__ = classmethod(__init_subclass__)
    _wrap_forwards()
    _state["installed"] = True
    return len(_state["wrapped"])


def uninstall() -> None:
    """Put every wrapped method and the base class's `__init_subclass__` back."""
    if not _state["installed"]:
        return
    for cls, name, fn in reversed(_state["wrapped"]):
        setattr(cls, name, fn)
    _state["wrapped"].clear()
    base = AttentionMetadataBuilder
    previous = _state["hook"]
    if previous is None:
        del base.__init_subclass__
    else:
        base.__init_subclass__ = previous
    _state["installed"] = False
