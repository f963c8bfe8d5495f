"""DCP on 2 GPUs over NCCL: exactness against the single-GPU step, no host sync under every GPU
layer, one CUDA graph per rank (builder output, scorer, local top-k, all-gather, merge, remap)
replayed with new lengths. Skipped, with the reason, where fewer than 2 CUDA GPUs exist."""

from __future__ import annotations

import pytest
import torch
from dcp_cases import Case, cross_rank_errors, run_cases

from vllm_sparse_sync.testing.multirank import nccl_unavailable_reason

WORLD = 2
_REASON = nccl_unavailable_reason(WORLD)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]
ENV = {"VLLM_SPARSE_SYNC_TRACE": "1"}  # the ranks are fresh processes: the trace layer may run there
TIMEOUT = 540


def _gpu_exact(ctx, cases):
    """The DCP step (Triton route) against the single-GPU step over the whole rows, as sets, and
    against the CPU reference within a tolerance (nothing selected below the k-th score)."""
    from dcp_cases import _batch, global_batch, layout_of

    from vllm_sparse_sync import DcpIndexerStep, IndexerMetadataBuilder, IndexerStep
    from vllm_sparse_sync.kernels import reference as ref
    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG
    from vllm_sparse_sync.kernels.synth import shard_k_cache
    from vllm_sparse_sync.kernels.verify import topk_violations

    out = []
    for case in cases:
        dev = ctx.device
        cache, table, q, w, qsl, seq = global_batch(case, dev)
        n, rows = len(case.seq_lens), sum(case.query_lens)
        glay = layout_of(case)
        gb = IndexerMetadataBuilder(glay, max_num_reqs=n, max_num_tokens=rows,
                                    max_pages_per_req=table.shape[1], device=dev)
        gmeta = gb.build(_batch(qsl, seq, table, case, dev))
        # the unfused single-GPU route as the comparison (the fused one broke threshold ties until
        # its programs took contiguous chunks: test_kernels_gpu::
        # test_fused_route_gives_threshold_ties_to_the_lowest_positions)
        unfused = DEFAULT_CONFIG.with_values(fused=False)
        single = IndexerStep.for_builder(gb, config=unfused).run(gmeta, q, w, cache)
        lay = layout_of(case, ctx.world_size, ctx.rank)
        cache_l, table_l = shard_k_cache(cache, table, ctx.world_size, ctx.rank, case.interleave)
        lb = IndexerMetadataBuilder(lay, max_num_reqs=n, max_num_tokens=rows,
                                    max_pages_per_req=table_l.shape[1], device=dev)
        step = DcpIndexerStep(lay, max_rows=rows, max_pages_per_req=table_l.shape[1], device=dev)
        res = step.run(lb.build(_batch(qsl, seq, table_l, case, dev)), q, w, cache_l)
        torch.cuda.synchronize()
        errors = []
        got, want = res.global_idx.cpu(), single.cpu()
        for r in range(rows):
            a, b = sorted(got[r].tolist()), sorted(want[r].tolist())
            if a != b:
                errors.append(f"{case} row {r}: DCP and single-GPU sets differ in "
                              f"{len(set(a) ^ set(b))} positions")
        width = table.shape[1] * 64
        logits = ref.paged_indexer_logits(q.cpu(), w.cpu(), cache.cpu(), gmeta.block_table.cpu(),
                                          gmeta.row_lens.cpu(), width)
        eff = ref.effective_lengths(gmeta.row_lens.cpu(), width)
        # DCP rows come in gathered order; topk_violations wants short rows in position order
        big = torch.iinfo(torch.int32).max
        ordered = torch.sort(torch.where(got >= 0, got, torch.full_like(got, big)), 1).values
        ordered = torch.where(ordered == big, torch.full_like(ordered, -1), ordered)
        errors += [str(v) for v in topk_violations(ordered, logits, eff, case.k, tol=1e-3)]
        owned = (got >= 0) & ((got // case.interleave) % ctx.world_size == ctx.rank)
        if not torch.equal(res.local_mask.cpu(), owned):
            errors.append(f"{case}: local mask is not the owned selected tokens")
        errors += _kernels_equal_torch(ctx, step, res, rows, case)
        out.append(errors)
    return out


def _kernels_equal_torch(ctx, step, res, rows, case) -> list[str]:
    """The step's send-key and merge + remap kernels against the torch ops on the same data
    (its local top-k and logits, its gathered buffer), element for element."""
    from vllm_sparse_sync import dcp

    world, rank, k, inter = ctx.world_size, ctx.rank, case.k, case.interleave
    errors = []
    from vllm_sparse_sync.kernels.cuda.dcp_merge import merge_fits, status

    want_merge = "cuda" if status(step.device)[0] and merge_fits(world, k) else "triton"
    if (step.send_route, step.merge_route) != ("triton", want_merge):
        errors.append(f"{case}: routes {step.send_route}/{step.merge_route}, not triton/{want_merge}")
    idx = step.local_topk[:rows]
    s = step.inner.workspace.logits[:rows].gather(1, idx.clamp_min(0).long())
    s = torch.where(idx >= 0, s, torch.full_like(s, float("-inf")))
    want_send = dcp.candidate_keys(s, dcp.local_to_global(idx, world, rank, inter))
    if not torch.equal(step.send[:rows * k].view(rows, k), want_send):
        errors.append(f"{case}: the send-key kernel differs from dcp.candidate_keys")
    gathered = step.gathered[:world * rows * k].view(world, rows, k)
    merged = dcp.merge_candidate_keys(gathered, k)
    local = dcp.global_to_local(merged, world, rank, inter)
    for name, a, b in (("global_idx", res.global_idx, merged), ("local_idx", res.local_idx, local),
                       ("local_mask", res.local_mask, local >= 0)):
        if not torch.equal(a, b):
            errors.append(f"{case}: the merge kernel's {name} differs from the torch merge in "
                          f"{int((a != b).sum())} slots")
    return errors


def _cases(k=2048, max_len=16384):
    return [
        Case(world=WORLD, seq_lens=(16000, 3000, 9000, 100), query_lens=(1, 1, 1, 1), k=k,
             max_model_len=max_len, seed=1),
        Case(world=WORLD, seq_lens=(16384, 5000), query_lens=(2, 1), k=k, interleave=64,
             backend="deepgemm", max_model_len=max_len, seed=2),
        Case(world=WORLD, seq_lens=(12000, 2047, 64), query_lens=(1, 1, 1), k=k, ties=True,
             max_model_len=max_len, seed=3),
        Case(world=WORLD, seq_lens=(4096,) * 40, query_lens=(1,) * 40, k=k, interleave=64,
             max_model_len=8192, seed=4),  # the unfused route of the single-GPU step too
    ]


def test_dcp2_equals_the_single_gpu_step(multirank):
    results = multirank.run(_gpu_exact, _cases(), world_size=WORLD, backend="nccl", env=ENV,
                            timeout=TIMEOUT)
    errors = [f"rank {r}: {e}" for r, res in enumerate(results) for case in res for e in case]
    assert errors == []


def test_dcp2_small_cases_equal_the_reference_exactly(multirank):
    """The small CPU cases (k of 1 to 256), on the GPUs: exact against torch_logits' top-k (same
    positions, in order) where the Triton and torch scores agree bit for bit (``ties``)."""
    cases = [Case(world=WORLD, seq_lens=s, query_lens=q, k=k, interleave=i, ratio=r, backend=b,
                  ties=True, seed=n)
             for n, (s, q, k, i, r, b) in enumerate([
                 ((700, 40, 1500), (1, 2, 1), 64, 1, 1, "b12x"),
                 ((700, 40, 150), (1, 1, 3), 64, 64, 1, "deepgemm"),
                 ((5, 1, 2000), (1, 1, 1), 100, 1, 4, "b12x"),
                 ((70, 130, 64), (1, 1, 1), 16, 64, 1, "b12x"),
                 ((2048,), (4,), 256, 2, 1, "deepgemm")])]
    per_rank = multirank.run(run_cases, cases, sentinel=False, world_size=WORLD, backend="nccl",
                             env=ENV, timeout=TIMEOUT)
    assert cross_rank_errors(per_rank) == []


def _capture_replay(ctx):
    """check_step under every layer, then one CUDA graph of the whole step, replayed with new
    lengths; each replay equal to an eager run on the same lengths."""
    from dcp_cases import HEAD_DIM, HEADS, PAGE

    from vllm_sparse_sync import (
        DcpIndexerStep,
        DecodeBatch,
        IndexerLayout,
        IndexerMetadataBuilder,
        SeqLenShadow,
    )
    from vllm_sparse_sync.kernels.synth import random_k_cache
    from vllm_sparse_sync.testing import check_step, device_tensors
    from vllm_sparse_sync.testing.layers import ALL_LAYERS

    dev = ctx.device
    k, max_len, n = 2048, 32768, 8
    lay = IndexerLayout(backend="b12x", topk=k, max_model_len=max_len, dcp_world_size=ctx.world_size,
                        dcp_rank=ctx.rank, num_heads=HEADS)
    pages = max_len // ctx.world_size // PAGE
    g = torch.Generator().manual_seed(11 + ctx.rank)
    cache = random_k_cache(n * pages, PAGE, HEAD_DIM, generator=g).to(dev)
    table = torch.arange(n * pages, dtype=torch.int32).view(n, pages).to(dev)
    q = (torch.randn(n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(5)) * 0.7).to(
        torch.float8_e4m3fn).to(dev)
    w = torch.randn(n, HEADS, generator=torch.Generator().manual_seed(6)).to(dev)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    seq = torch.full((n,), 20000, dtype=torch.int32, device=dev)
    shadow = SeqLenShadow(seq.cpu().clone())
    builder = IndexerMetadataBuilder(lay, max_num_reqs=n, max_num_tokens=n, max_pages_per_req=pages,
                                     device=dev)
    step = DcpIndexerStep(lay, max_rows=n, max_pages_per_req=pages, device=dev)
    qsl_dev = qsl.to(dev)

    def batch():
        return DecodeBatch(qsl_dev, qsl, seq, shadow, table, max_len)

    step.run(builder.build(batch()), q, w, cache)  # warm every kernel and the communicator
    torch.cuda.synchronize()
    watch = device_tensors(builder, step, seq, table, q, w, cache)
    check = check_step(lambda: step.run(builder.build(batch()), q, w, cache), watch=watch,
                       raise_on_sync=False)
    report = {"records": [str(r) for r in check.records], "ran": sorted(set(check.ran)),
              "layers": list(ALL_LAYERS), "touched": check.touched}

    meta = builder.build_for_capture(n, n)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step.run(meta, q, w, cache)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step.run(meta, q, w, cache)
    mismatches = []
    for lens in ([32768, 5, 2049, 2048, 100, 30000, 1, 4097], [9000] * 8, [1, 2, 3, 4, 5, 6, 7, 8]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        shadow.seq_lens_cpu.copy_(torch.tensor(lens, dtype=torch.int32))
        builder.build(batch())
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in (out.global_idx, out.local_idx, out.local_mask)]
        eager = step.run(builder.build(batch()), q, w, cache)
        torch.cuda.synchronize()
        for name, a, b in zip(("global", "local", "mask"), replayed,
                              (eager.global_idx, eager.local_idx, eager.local_mask)):
            if not torch.equal(torch.sort(a.long(), 1).values, torch.sort(b.long(), 1).values):
                mismatches.append(f"lens {lens}: replayed {name} differs from eager")
        valid = (eager.global_idx >= 0).sum(1).cpu().tolist()
        if valid != [min(L, k) for L in lens]:
            mismatches.append(f"lens {lens}: {valid} valid entries per row")
    report["mismatches"] = mismatches
    return report


def test_dcp2_step_is_sync_free_and_replays_in_one_cuda_graph(multirank):
    reports = multirank.run(_capture_replay, world_size=WORLD, backend="nccl", env=ENV, timeout=TIMEOUT)
    for rank, rep in enumerate(reports):
        assert rep["records"] == [], (rank, rep)
        assert rep["ran"] == sorted(rep["layers"]), (rank, rep)  # every layer ran, none skipped
        assert rep["touched"], (rank, rep)
        assert rep["mismatches"] == [], (rank, rep)
