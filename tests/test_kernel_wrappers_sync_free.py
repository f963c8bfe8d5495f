"""Property-based proof that the kernels' host side never reads device data on the host.

The host side is everything between the caller and the kernels: `kernels.dispatch`, the Triton
entry points (`ops`: checks, the call's plan, `launch`) and the workspace. On a
CPU host the tensors are CPU stand-ins watched by the sentinel, and the launches either run in
Triton's interpreter (few examples, results checked) or are stubbed out (many examples: the
host logic alone). A launch with a watched argument taints all its arguments, so a wrapper that
read a kernel's output back would fail here too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from interpret_env import CUDA, SKIP_WITH_CUDA

triton = pytest.importorskip("triton")

from vllm_sparse_sync.kernels import dispatch  # noqa: E402
from vllm_sparse_sync.kernels import reference as ref  # noqa: E402
from vllm_sparse_sync.kernels import launch, planner  # noqa: E402
from vllm_sparse_sync.kernels import ops as tk  # noqa: E402
from vllm_sparse_sync.kernels.config import KernelConfig  # noqa: E402
from vllm_sparse_sync.kernels.triton import fused, topk_sample  # noqa: E402
from vllm_sparse_sync.kernels.synth import make_case  # noqa: E402
from vllm_sparse_sync.kernels.verify import topk_violations  # noqa: E402
from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace  # noqa: E402
from vllm_sparse_sync.testing import device_tensors, no_host_sync  # noqa: E402

pytestmark = [pytest.mark.interpret, pytest.mark.skipif(CUDA, reason=SKIP_WITH_CUDA)]

PAGE = 64
CONFIGS = {
    "radix": KernelConfig(topk="radix", fused=False),
    "sample": KernelConfig(topk="sample", fused=False),
    "auto": KernelConfig(fused=False),  # sampled from 3 rows (small_kernels)
    "fused": KernelConfig(),
}


@pytest.fixture(autouse=True)
def small_kernels(monkeypatch):
    """The sampled top-k shrunk so small rows take every path (and "auto" from 3 rows), the fused
    resolve 64 candidates an iteration; set before any workspace is made."""
    for name, value in dict(CAP=128, SAMPLE_ABOVE=128, SAMPLES=64, BLOCK=64, RESOLVE_BLOCK=64).items():
        monkeypatch.setattr(topk_sample, name, value)
    monkeypatch.setattr(planner, "SAMPLE_MIN_ROWS", 3)
    monkeypatch.setattr(fused, "RESOLVE_BLOCK", 64)
ENTRIES = ("write_index_k_cache", "paged_indexer_logits", "topk_indices", "indexer_topk")


@st.composite
def calls(draw, entry):
    rows = draw(st.integers(1, 6))
    table_pages = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(0, table_pages * PAGE + 40), min_size=rows, max_size=rows))
    contract = draw(st.sampled_from(["exact", "host_width", "active_width"]))
    exact = max(lens)
    width = exact if contract == "exact" else table_pages * PAGE + draw(st.integers(0, 100))
    active = None
    if contract == "active_width":
        active = torch.tensor([draw(st.integers(0, width))], dtype=torch.int32)
    return dict(entry=entry, rows=rows, table_pages=table_pages, lens=lens, width=width, active=active,
                k=draw(st.integers(1, 40)), heads=draw(st.sampled_from([16, 32])),
                algo=draw(st.sampled_from(sorted(CONFIGS))), seed=draw(st.integers(0, 2**16)),
                with_out=draw(st.booleans()), with_workspace=draw(st.booleans()))


def _run(c, *, via_dispatch: bool):
    """Build the call's inputs, run it under the sentinel; returns (result, inputs)."""
    case = make_case(c["lens"], heads=c["heads"], table_pages=c["table_pages"], seed=c["seed"])
    q, w, cache, bt, lens = case.args
    k, width, active, rows = c["k"], c["width"], c["active"], c["rows"]
    cfg = CONFIGS[c["algo"]]
    ws = IndexerTopkWorkspace(rows, k, width if c["entry"] == "indexer_topk" else 0, "cpu",
                              config=cfg, num_sms=16 if c["algo"] == "fused" else 4)
    api = dispatch if via_dispatch else tk
    entry = c["entry"]
    out = None
    if entry == "write_index_k_cache":
        gen = torch.Generator().manual_seed(c["seed"])
        k8, ks = ref.quantize_index_k(torch.randn(rows * 7, 128, generator=gen))
        slots = torch.randperm(cache.shape[0] * PAGE)[: rows * 7].to(torch.int64)
        slots[::5] = -1
        args = (cache, k8, ks, slots)
        call = lambda: api.write_index_k_cache(*args)  # noqa: E731
    elif entry == "paged_indexer_logits":
        out = torch.empty(rows, width, dtype=torch.float32) if c["with_out"] else None
        args = (q, w, cache, bt, lens, active, out)
        call = lambda: api.paged_indexer_logits(q, w, cache, bt, lens, width, active_width=active,  # noqa: E731
                                                out=out)
    elif entry == "topk_indices":
        logits = ref.paged_indexer_logits(q, w, cache, bt, lens, width, active_width=active)
        out = torch.empty(rows, k, dtype=torch.int32) if c["with_out"] else None
        args = (logits, lens, active, out)
        call = lambda: api.topk_indices(logits, lens, k, active_width=active, out=out,  # noqa: E731
                                        workspace=ws if c["with_workspace"] else None)
    else:
        out = torch.empty(rows, k, dtype=torch.int32) if c["with_out"] else None
        args = (q, w, cache, bt, lens, active, out)
        call = lambda: api.indexer_topk(q, w, cache, bt, lens, k, active_width=active, width=width,  # noqa: E731
                                        out=out, workspace=ws if c["with_workspace"] else None)
    watch = [t for t in args if isinstance(t, torch.Tensor)] + device_tensors(ws)
    with no_host_sync(watch=watch, layers="sentinel", where=f"{api.__name__}.{entry}") as check:
        result = call()
    nothing_to_do = entry == "paged_indexer_logits" and width == 0
    assert check.touched > 0 or nothing_to_do, "no watched tensor was used: a vacuous check"
    return result, case, args


def _check_result(c, result, case, args):
    entry, width, active, k = c["entry"], c["width"], c["active"], c["k"]
    q, w, cache, bt, lens = case.args
    if entry == "write_index_k_cache":
        want = make_case(c["lens"], heads=c["heads"], table_pages=c["table_pages"], seed=c["seed"]).k_cache
        ref.write_index_k_cache(want, *args[1:])
        assert torch.equal(args[0], want)
    elif entry == "paged_indexer_logits":
        want = ref.paged_indexer_logits(q, w, cache, bt, lens, width, active_width=active)
        assert torch.equal(torch.isinf(result), torch.isinf(want))
        torch.testing.assert_close(result, want, rtol=1e-5, atol=1e-4)
    else:
        logits = ref.paged_indexer_logits(q, w, cache, bt, lens, width, active_width=active)
        eff = ref.effective_lengths(lens, width, active)
        assert topk_violations(result, logits, eff, k, tol=1e-3) == []


def _stub_launches(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    launched = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **kw: launched.append(self))
    return launched


MANY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.function_scoped_fixture])
FEW = settings(MANY, max_examples=max(3, settings().max_examples // 15))


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("via_dispatch", [False, True], ids=["ops", "dispatch"])
def test_host_side_never_reads_device_data_stubbed_launches(entry, via_dispatch, monkeypatch):
    launched = _stub_launches(monkeypatch)
    if via_dispatch:
        monkeypatch.setattr(dispatch, "_on_device", lambda t: True)

    @MANY
    @given(c=calls(entry))
    def prove(c):
        _run(c, via_dispatch=via_dispatch)

    prove()
    assert launched, "no kernel was launched: the wrappers were not exercised"


@pytest.mark.parametrize("entry", ENTRIES)
def test_host_side_never_reads_device_data_interpreted(entry, monkeypatch):
    monkeypatch.setattr(dispatch, "_on_device", lambda t: True)

    @FEW
    @given(c=calls(entry))
    def prove(c):
        _check_result(c, *_run(c, via_dispatch=True))

    prove()


def test_a_wrapper_that_reads_its_output_back_is_caught(monkeypatch):
    """Plant the bug: a launch wrapper that checks its result on the host."""
    from vllm_sparse_sync.testing import HostSyncError

    _stub_launches(monkeypatch)
    orig = launch.launch_topk

    def checking(route, logits, row_lens, active_width, ws, out, k, width, **kw):
        orig(route, logits, row_lens, active_width, ws, out, k, width, **kw)
        assert int(out.min()) >= -1  # planted: a host read of the kernel's output

    monkeypatch.setattr(tk, "launch_topk", checking)
    c = dict(entry="topk_indices", rows=3, table_pages=2, lens=[5, 90, 128], width=128, active=None,
             k=8, heads=16, algo="radix", seed=1, with_out=False, with_workspace=True)
    with pytest.raises(HostSyncError, match=r"int\(out.min\(\)\)"):
        _run(c, via_dispatch=False)
