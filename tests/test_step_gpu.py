"""The step API, the route planner and the no-silent-wrong-answer rules on a CUDA device."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from decode_rows import DecodeRows

from vllm_sparse_sync import DecodeBatch, IndexerLayout, IndexerMetadataBuilder, IndexerStep, SeqLenShadow
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.synth import make_case
from vllm_sparse_sync.kernels.verify import topk_violations
from vllm_sparse_sync.testing import check_step, decode_graph, device_tensors

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def _ws(rows, k, width, *, cluster=True, **values):
    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG

    return _workspace(rows, k, width, DEV, DEFAULT_CONFIG.with_values(**values), cluster)


def _workspace(rows, k, width, device, config, cluster):
    """``cluster=False``: planned as on a device without the cluster top-k (where calls of few
    rows take the fused step)."""
    from vllm_sparse_sync.kernels.device import device_info
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    info = None if cluster else replace(device_info(device, config), cluster_smem=0)
    return IndexerTopkWorkspace(rows, k, width, device, config=config, device_info=info)


def _steps_without_cluster(monkeypatch):
    """Steps made from here on plan as on a device without the cluster top-k (a step's workspace
    comes from ``kernels.make_workspace``)."""
    from vllm_sparse_sync import kernels

    def make_workspace(rows, k, width=0, device=DEV, config=None):
        return _workspace(rows, k, width, device, config or kernels.DEFAULT_CONFIG, cluster=False)

    monkeypatch.setattr(kernels, "make_workspace", make_workspace)


def _ops():
    from vllm_sparse_sync.kernels import ops

    return ops


def _set(t):
    return set(t[t >= 0].tolist())


def test_a_small_call_on_a_serving_size_workspace_takes_the_fused_route():
    k, width = 2048, 131072
    case = make_case([65536], heads=64, table_pages=width // 64, device=DEV, seed=1)
    if _ws(1, k, width).device_info().cluster_smem:  # sm_90+: scorer, then the cluster top-k
        assert _ws(256, k, width).plan_call(1, width, 64).kind == "cuda_radix"
    big = _ws(256, k, width, cluster=False)
    assert big.plan_call(1, width, 64).fused
    got = _ops().indexer_topk(*case.args, k, width=width, workspace=big)
    small = _ops().indexer_topk(*case.args, k, width=width, workspace=_ws(1, k, width, cluster=False))
    assert _set(got[0]) == _set(small[0])
    logits = ref.paged_indexer_logits(*case.args, width)
    assert topk_violations(got, logits, ref.effective_lengths(case.row_lens, width), k, tol=1e-3) == []


@pytest.mark.parametrize("route", ["radix", "sample", "fused", "cuda_radix"])
def test_nan_scores_rank_below_every_number(route):
    k, n = 64, 4096
    logits = torch.randn(2, n, device=DEV)
    logits[0, ::3] = float("nan")
    logits[1, :100] = float("nan")
    logits[1, 100:110] = -float("nan")  # a NaN with the sign bit set
    lens = torch.tensor([n, n], dtype=torch.int32, device=DEV)
    topk = {"fused": "radix", "cuda_radix": "cuda"}.get(route, route)
    got = _ops().topk_indices(logits, lens, k, workspace=_ws(2, k, 0, topk=topk, fused=False))
    want = ref.topk_indices(logits.cpu(), lens.cpu(), k)
    for r in range(2):
        assert _set(got[r]) == _set(want[r])
        assert not torch.isnan(logits[r, got[r].long()]).any()


def test_write_index_k_cache_skips_slots_past_the_cache_like_the_reference():
    cache = torch.zeros(4, 64 * 132, dtype=torch.uint8, device=DEV)
    k8, ks = ref.quantize_index_k(torch.randn(6, 128, device=DEV) + 2)
    slots = torch.tensor([0, 255, 256, 1000, -1, 7], device=DEV)
    _ops().write_index_k_cache(cache, k8, ks, slots)
    want = torch.zeros(4, 64 * 132, dtype=torch.uint8)
    ref.write_index_k_cache(want, k8.cpu(), ks.cpu(), slots.cpu())
    assert torch.equal(cache.cpu(), want)


def test_a_stalled_fused_row_is_marked_and_reported(monkeypatch):
    k, width = 512, 8192
    layout = IndexerLayout(backend="deepgemm", topk=k, max_model_len=width)
    _steps_without_cluster(monkeypatch)  # sm_90+ would not fuse
    step = IndexerStep(layout, max_rows=4, max_pages_per_req=width // 64, device=DEV)
    builder = IndexerMetadataBuilder(layout, max_num_reqs=4, max_num_tokens=4,
                                     max_pages_per_req=width // 64, device=DEV)
    lens = torch.tensor([8000, 6000], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    case = make_case([8000, 6000], heads=64, table_pages=width // 64, device=DEV, seed=3)
    meta = builder.build(DecodeBatch(qsl.to(DEV), qsl, lens.to(DEV), SeqLenShadow(lens),
                                     case.block_table, 8000))
    assert step.route(2, meta.bound.value).fused
    step.workspace.fused_stall[1] = 1  # what a barrier that gave up leaves behind
    got = step.run(meta, case.q_fp8, case.weights, case.k_cache)
    assert got[1].tolist() == [-1] * k and (got[0] >= 0).all()
    health = step.health()
    assert not health.ok and health.stalled_rows == 1
    assert step.health().ok  # read and cleared


@pytest.mark.parametrize("backend", ["b12x", "deepgemm"])
@pytest.mark.parametrize("query_lens", [(1, 1, 1), (3, 1, 2)], ids=["decode", "mtp"])
def test_builder_and_step_capture_once_and_replay_new_lengths(backend, query_lens):
    """The public way: builder outside the graph, the step captured once, replayed with new
    lengths written by build(); no host sync anywhere in the step."""
    k, max_len = 256, 8192
    layout = IndexerLayout(backend=backend, topk=k, max_model_len=max_len)
    pages = max_len // 64
    builder = IndexerMetadataBuilder(layout, max_num_reqs=4, max_num_tokens=8, max_pages_per_req=pages,
                                     device=DEV)
    step = IndexerStep.for_builder(builder)
    n_rows = sum(query_lens)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    qsl = torch.tensor(starts, dtype=torch.int32)
    case = make_case([max_len] * len(query_lens), heads=64, table_pages=pages, device=DEV, seed=5)
    q = (torch.randn(n_rows, 64, 128, device=DEV)).to(torch.float8_e4m3fn)
    w = torch.randn(n_rows, 64, device=DEV)
    seq = torch.tensor([4000, 7000, 300], dtype=torch.int32, device=DEV)
    shadow = SeqLenShadow(seq.cpu())

    qsl_dev = qsl.to(DEV)

    def batch():
        return DecodeBatch(qsl_dev, qsl, seq, shadow, case.block_table, max_len)

    out = torch.empty(n_rows, k, dtype=torch.int32, device=DEV)
    meta = builder.build_for_capture(len(query_lens), n_rows)
    step.run(builder.build(batch()), q, w, case.k_cache, out=out)  # warm every kernel
    watch = device_tensors(builder, step.workspace, seq, case.block_table, q, w, case.k_cache, out)
    check = check_step(lambda: step.run(builder.build(batch()), q, w, case.k_cache, out=out),
                       watch=watch, warmup=1)
    assert check.records == [] and check.touched
    graph = decode_graph(lambda: step.run(meta, q, w, case.k_cache, out=out), inputs=[q, w])
    for lens in ([8000, 5, 512], [100, 8192, 2048]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        shadow.seq_lens_cpu.copy_(torch.tensor(lens, dtype=torch.int32))
        live = builder.build(batch())
        graph.replay()
        torch.cuda.synchronize()
        width = pages * 64
        logits = ref.paged_indexer_logits(q.cpu(), w.cpu(), case.k_cache.cpu(), live.block_table.cpu(),
                                          live.row_lens.cpu(), width)
        eff = ref.effective_lengths(live.row_lens.cpu(), width)
        assert topk_violations(out.cpu(), logits, eff, k, tol=1e-3) == []
    assert step.health().ok


def test_metadata_kernel_on_cuda_matches_the_torch_path():
    gen = torch.Generator().manual_seed(7)
    for world, rank, interleave, ratio in ((1, 0, 1, 1), (2, 1, 1, 4), (4, 2, 16, 1)):
        layout = IndexerLayout(backend="b12x", compress_ratio=ratio, dcp_world_size=world, dcp_rank=rank,
                               cp_interleave=interleave, max_model_len=4096)
        kw = dict(max_num_reqs=8, max_num_tokens=32, max_pages_per_req=70)
        gpu = IndexerMetadataBuilder(layout, device=DEV, **kw)
        cpu = IndexerMetadataBuilder(layout, device="cpu", **kw)
        assert gpu._launch is not None
        for query_lens in ([1] * 8, [4, 0, 3, 1], [2, 2], [1]):
            lens = torch.tensor([int(torch.randint(q, 4097, (1,), generator=gen)) for q in query_lens],
                                dtype=torch.int32)
            starts = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
            table = torch.randint(-1, 9000, (len(query_lens), 70), generator=gen, dtype=torch.int32)
            shadow = SeqLenShadow(lens.clone(), authoritative=False)
            a = gpu.build(DecodeBatch(starts.to(DEV), starts, lens.to(DEV), shadow, table.to(DEV), 4096))
            b = cpu.build(DecodeBatch(starts.clone(), starts, lens.clone(), shadow, table, 4096))
            assert torch.equal(gpu.row_lens_buffer.cpu(), cpu.row_lens_buffer)
            assert torch.equal(a.block_table.cpu(), b.block_table)
            assert int(gpu.active_width_buffer[0]) == b.bound.value


def test_device_assertion_fires_when_a_hint_is_below_a_device_length():
    """Opt-in, no host sync: a lying max_seq_len trips a device-side assert (fatal to the CUDA
    context, so it runs in its own process)."""
    code = """
import torch
from vllm_sparse_sync import DecodeBatch, IndexerLayout, IndexerMetadataBuilder
lay = IndexerLayout(backend="b12x", compress_ratio=4, topk=8, max_model_len=1024)
b = IndexerMetadataBuilder(lay, max_num_reqs=4, max_num_tokens=4, max_pages_per_req=16, device="cuda",
                           check_bound=True)
qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
b.build(DecodeBatch(qsl.cuda(), qsl, torch.tensor([100, 900], dtype=torch.int32, device="cuda"), None,
                    torch.zeros(2, 16, dtype=torch.int32, device="cuda"), 200))
torch.cuda.synchronize()
print("NOT CAUGHT")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "NOT CAUGHT" not in proc.stdout, proc.stdout + proc.stderr
    assert "assert" in proc.stderr.lower()


@pytest.mark.parametrize("rows,max_len,values,taken", [
    (64, 16384, {}, "cluster"),  # the scorer, then the cluster top-k writing slots itself
    (2, 8192, {}, "fused"),  # the fused Triton step (no cluster top-k), then the transform
    (40, 4096, {"topk": "radix"}, "radix"),  # Triton's radix, then it
])
def test_the_step_writes_kv_cache_slots_captured_and_without_a_sync(rows, max_len, values, taken,
                                                                    monkeypatch):
    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG

    if taken == "fused":
        _steps_without_cluster(monkeypatch)
    k = 2048
    layout = IndexerLayout(backend="b12x", topk=k, max_model_len=max_len)
    pages = max_len // 64
    builder = IndexerMetadataBuilder(layout, max_num_reqs=rows, max_num_tokens=rows, max_pages_per_req=pages,
                                     device=DEV)
    step = IndexerStep.for_builder(builder, config=DEFAULT_CONFIG.with_values(**values))
    route = step.route(rows)
    if taken == "cluster" and not route.topk_cluster:
        pytest.skip("the cluster top-k needs sm_90+ and cuda-bindings")
    assert {"cluster": bool(route.topk_cluster), "fused": route.fused, "radix": route.kind == "radix"}[taken]
    d = DecodeRows(rows, max_len, seed=7, device=DEV)
    case, q, w, seq, batch = d.case, d.q, d.w, d.seq, d.batch
    attn_table = (case.block_table.flip(1) * 3 + 11).contiguous()  # the attention's own pages
    meta = builder.build(batch())
    pos = step.run(meta, q, w, case.k_cache)
    out = torch.empty_like(pos)
    step.run(meta, q, w, case.k_cache, out=out, slots=attn_table)  # warm every kernel
    assert torch.equal(out, ref.page_table_slots(pos, attn_table, 64))
    own = step.run(meta, q, w, case.k_cache, slots=True)
    assert torch.equal(own, ref.page_table_slots(pos, meta.block_table, 64))
    watch = device_tensors(builder, step.workspace, seq, case.block_table, q, w, case.k_cache, out,
                           attn_table)
    check = check_step(lambda: step.run(builder.build(batch()), q, w, case.k_cache, out=out,
                                        slots=attn_table), watch=watch, warmup=1)
    assert check.records == [] and check.touched
    graph = decode_graph(lambda: step.run(meta, q, w, case.k_cache, out=out, slots=attn_table), inputs=[q, w])
    d.set_lengths(torch.randint(1, max_len + 1, (rows,), dtype=torch.int32))
    live = builder.build(batch())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref.page_table_slots(step.run(live, q, w, case.k_cache), attn_table, 64))
    assert step.health().ok
