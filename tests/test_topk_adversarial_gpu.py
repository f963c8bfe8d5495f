"""Every top-k route on a CUDA device against the torch reference on adversarial scores
(``adversarial.py``: ties, NaN, infinities, signed zeros, denormals, the largest floats, sorted
runs, one outlier), at every row count the route planner splits on, at lengths 0, 1, k - 1, k,
k + 1 and the full width (and past it, and negative), on logits that are views of a wider buffer,
and in CUDA-graph replays with new data in the same buffers. Then the device-data contract where
the GPU route differs from the CPU's: KV-cache slots of bad page entries (the CUDA cluster top-k's
slots entries and the Triton transform), negative device lengths in the Triton metadata kernel,
and the device-side assertions (fatal to a CUDA context, so each in its own process)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from adversarial import ALL_ROWS, KINDS, adversarial_rows, sets

from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.kernels.cuda import topk_emu as emu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"
K = 2048
INT32_MAX = 2**31 - 1


def _cuda_topk_status() -> tuple[bool, str]:
    from vllm_sparse_sync.kernels.cuda.topk import status

    return status(DEV)


def _need_cuda_topk(cluster: bool = False) -> None:
    ok, why = _cuda_topk_status()
    if not ok:
        pytest.skip(f"CUDA top-k: {why}")
    if cluster and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster route needs sm_90+")


CONFIGS = {"auto": {}, "radix": {"topk": "radix", "fused": False},
           "sample": {"topk": "sample", "fused": False}, "cuda-cta": {"topk": "cuda"}, "fused": {}}
"""each workspace route's config fields; "cuda-cta" and "fused" plan as on a device without the
cluster top-k (the one-CTA CUDA top-k; calls of few rows fused)"""


def _ws(route: str, rows: int, width: int = 0, k: int = K):
    from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG
    from vllm_sparse_sync.kernels.device import device_info
    from vllm_sparse_sync.kernels.workspace import IndexerTopkWorkspace

    config = DEFAULT_CONFIG.with_values(**CONFIGS[route])
    info = replace(device_info(DEV, config), cluster_smem=0) if route in ("cuda-cta", "fused") else None
    return IndexerTopkWorkspace(rows, k, width, DEV, config=config, device_info=info)


ROUTES = ["radix", "sample", "cuda-cta", "cluster-1", "cluster-2", "cluster-4", "cluster-8", "cluster-16",
          "cluster-auto", "auto"]
"""Triton's radix and sampled top-k, the one-CTA CUDA top-k, the cluster top-k at each size and at
the planner's, and whatever the planner picks (``kernels.topk_indices`` on a workspace)."""


def _run(route: str, x: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, ws=None) -> torch.Tensor:
    """``route``'s top-``out.shape[1]`` of ``x`` (any row stride) into ``out``."""
    from vllm_sparse_sync.kernels import ops

    rows, width = x.shape
    k = out.shape[1]
    if route.startswith("cluster-"):
        from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk_cluster

        size = route.split("-")[1]
        launch_cuda_topk_cluster(x, x.stride(0), lens, None, out, k, width,
                                 cluster=None if size == "auto" else int(size))
        return out
    if ws is None:
        ws = _ws(route, rows, k=k)
    return ops.topk_indices(x, lens, k, workspace=ws, out=out)


def _prepare(route: str) -> None:
    if route.startswith("cluster-"):
        _need_cuda_topk(cluster=True)
    elif route == "cuda-cta":
        _need_cuda_topk()


def _device_rows(rows: int, width: int, seed: int, *, offset: int, pad: int):
    """The adversarial rows (tiled past ``ALL_ROWS``) as a view of a wider device buffer."""
    g = torch.Generator().manual_seed(seed)
    base, _, base_lens = adversarial_rows(min(rows, ALL_ROWS), width, K, g, offset=offset, pad=pad)
    reps = -(-rows // base.shape[0])
    buf = base.repeat(reps, 1)[:rows].to(DEV)
    lens = base_lens.repeat(reps)[:rows].to(DEV)
    return buf, buf[:, offset:offset + width], lens


VIEWS = {"whole": (0, 0), "aligned": (4, 12), "unaligned": (5, 3)}
"""(first column, columns after) of the logits inside their buffer: a plain tensor, a view with
16-byte aligned rows, a view of unaligned rows."""


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("width", [4096, 70000])
@pytest.mark.parametrize("route", ROUTES)
def test_every_route_equals_the_reference_on_adversarial_scores(route, width, view):
    _prepare(route)
    offset, pad = VIEWS[view]
    _, x, lens = _device_rows(ALL_ROWS, width, seed=width + offset, offset=offset, pad=pad)
    got = _run(route, x, lens, torch.full((ALL_ROWS, K), -7, dtype=torch.int32, device=DEV))
    want = ref.topk_indices(x, lens, K)
    bad = [r for r in range(ALL_ROWS) if not torch.equal(sets(got[r:r + 1]), sets(want[r:r + 1]))]
    assert not bad, [(r, KINDS[r % len(KINDS)], int(lens[r])) for r in bad[:8]]
    if route.startswith(("cluster", "cuda")):  # the CUDA top-k writes the specification's row order
        assert torch.equal(got.cpu(), emu.topk_indices(x.cpu(), lens.cpu(), K))


def _split_row_counts(width: int) -> list[int]:
    """Every row count the planner changes its mind at, and the one past it: the cluster sizes
    (``cuda_topk.plan_cluster`` on this device), the Triton sampled top-k, the one-CTA CUDA top-k,
    the fused step, the CUDA scorer, and the most rows a cluster launch takes."""
    from vllm_sparse_sync.kernels import planner
    from vllm_sparse_sync.kernels.cuda.topk import plan_cluster
    from vllm_sparse_sync.kernels.device import device_sm_count

    sms = device_sm_count(DEV)
    try:
        from vllm_sparse_sync.kernels.cuda.topk import cluster_smem_limit

        smem = cluster_smem_limit(torch.device(DEV).index or 0)
    except Exception:
        smem = 0
    smem = smem or 227 * 1024 - 1536  # no cluster route here: an H100's, for the row counts only
    counts = {1, 2}
    last = None
    for rows in range(1, 2 * sms + 2):
        plan = plan_cluster(rows, width, sms, smem)
        size = plan.cluster if plan else None
        if size != last:
            counts |= {rows - 1, rows}
            last = size
    for t in (planner.SAMPLE_MIN_ROWS, planner.CUDA_TOPK_MIN_ROWS, planner.FUSED_MAX_ROWS + 1,
              planner.CUDA_SCORER_MIN_ROWS):
        counts |= {t - 1, t}
    counts |= {65535, 65536}
    return sorted(c for c in counts if c >= 1)


@pytest.mark.parametrize("width", [4096, 70000])
@pytest.mark.parametrize("route", ["auto", "cluster-auto", "radix", "sample", "cuda-cta"])
def test_every_row_count_the_planner_splits_on(route, width):
    _prepare(route)
    for rows in _split_row_counts(width):
        if rows > 4096 and (width > 4096 or route in ("radix", "sample")):
            continue  # the largest counts: the CUDA routes at the narrow width (1 GiB of logits)
        if rows > 65535 and route == "cluster-auto":
            continue  # past the cluster launch's grid: the planner takes one CTA a row ("auto")
        _, x, lens = _device_rows(rows, width, seed=rows, offset=0, pad=0)
        got = _run(route, x, lens, torch.empty(rows, K, dtype=torch.int32, device=DEV))
        want = ref.topk_indices(x, lens, K)
        assert torch.equal(sets(got), sets(want)), (route, rows, width)


@pytest.mark.parametrize("route", ["auto", "cluster-auto", "cluster-16", "radix", "sample", "cuda-cta"])
def test_graph_replays_with_new_adversarial_data_in_the_same_buffers(route):
    _prepare(route)
    rows, width = 24, 70000
    buf, x, lens = _device_rows(rows, width, seed=1, offset=4, pad=12)
    out = torch.empty(rows, K, dtype=torch.int32, device=DEV)
    ws = None if route.startswith("cluster") else _ws(route, rows)
    _run(route, x, lens, out, ws=ws)  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(route, x, lens, out, ws=ws)
    for seed in (2, 3, 4):
        new_buf, _, new_lens = _device_rows(rows, width, seed=seed * 7, offset=4, pad=12)
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)).to(DEV)
        buf.copy_(new_buf[perm])  # other kinds on other rows, the same addresses
        lens.copy_(new_lens[perm])
        graph.replay()
        want = ref.topk_indices(x, lens, K)
        assert torch.equal(sets(out), sets(want)), (route, seed)


def _degenerate_step_inputs(rows: int, kind: str):
    """A step's inputs whose scores are degenerate: all equal (zero queries) or all NaN (NaN
    weights), on rows of the edge lengths."""
    from vllm_sparse_sync.kernels.synth import make_case

    lens = [0, 1, K - 1, K, K + 1, 8192][:rows] + [8192] * max(0, rows - 6)
    case = make_case(lens, heads=64, table_pages=8192 // 64, device=DEV, seed=rows)
    if kind == "equal":
        case.q_fp8.zero_()
    else:
        case.weights.fill_(float("nan"))
    return case


@pytest.mark.parametrize("kind", ["equal", "nan"])
@pytest.mark.parametrize("rows", [1, 8, 9, 33])
@pytest.mark.parametrize("route", ["auto", "fused", "radix", "sample"])
def test_the_whole_step_on_degenerate_scores(route, rows, kind):
    from vllm_sparse_sync.kernels import ops

    case = _degenerate_step_inputs(rows, kind)
    ws = _ws(route, rows, 8192)
    got = ops.indexer_topk(*case.args, K, width=8192, workspace=ws)
    want = ref.indexer_topk(*case.args, K, width=8192)
    assert torch.equal(sets(got), sets(want)), (route, rows, kind)


# --------------------------------------------------------------------- the device-data contract
def _bad_table(rows: int, pages: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 1 << 20, (rows, pages), generator=g, dtype=torch.int32)
    table[:, 1::3] = -1  # unallocated pages
    table[:, 2::5] = 2**30  # slots past int32 at any page size of 2 or more
    table[:, 0] = INT32_MAX >> 6  # the largest entry whose slots fit int32 at pages of 64
    return table.to(DEV)


@pytest.mark.parametrize("route", ["cluster-1", "cluster-2", "cluster-4", "cluster-8", "cluster-16", "cluster-auto",
                                   "radix", "cuda-cta"])
def test_slots_of_bad_page_entries_are_minus_one_and_counted(route):
    """The cluster top-k's slots entries and the Triton transform (every other route): a slot is a
    valid slot or -1, and the counter holds the reference's count."""
    from vllm_sparse_sync.kernels import ops
    from vllm_sparse_sync.kernels.cuda.topk import launch_cuda_topk_cluster

    _prepare(route)
    rows, width = 24, 70000
    _, x, lens = _device_rows(rows, width, seed=5, offset=0, pad=0)
    lens[:4] = torch.tensor([100, K, 5000, width], dtype=torch.int32)  # live rows of every body
    table = _bad_table(rows, width // 64 + 1, seed=6)
    pos = ref.topk_indices(x, lens, K)
    want_counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    want = ref.page_table_slots(pos, table, 64, unmapped=want_counter)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    got = torch.full((rows, K), -7, dtype=torch.int32, device=DEV)
    if route.startswith("cluster-"):
        size = route.split("-")[1]
        launch_cuda_topk_cluster(x, x.stride(0), lens, None, got, K, width, cluster=None if size == "auto" else int(size),
                                 page_table=table, page_bits=6, unmapped=counter)
    else:
        ops.topk_indices(x, lens, K, workspace=_ws(route, rows), out=got, page_table=table, page_size=64,
                         unmapped=counter)
    assert torch.equal(sets(got), sets(want))
    assert bool(((got >= 0) | (got == -1)).all())
    assert int(counter) == int(want_counter) > 0
    assert bool((want == INT32_MAX).any())  # the largest entry's last slot, reached


def test_the_step_reports_unmapped_slots_on_the_device():
    from vllm_sparse_sync import DecodeBatch, IndexerLayout, IndexerMetadataBuilder, IndexerStep, SeqLenShadow
    from vllm_sparse_sync.kernels.synth import make_case

    lens = [9000, 60, 40]
    layout = IndexerLayout(backend="b12x", topk=64, max_model_len=16384)
    builder = IndexerMetadataBuilder(layout, max_num_reqs=4, max_num_tokens=4, max_pages_per_req=256, device=DEV)
    step = IndexerStep.for_builder(builder)
    c = make_case(lens, heads=64, table_pages=256, device=DEV, seed=2)
    table = c.block_table.clone()
    table[1, 0], table[2, 0] = -1, 2**30
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    meta = builder.build(DecodeBatch(qsl.to(DEV), qsl, seq.to(DEV), SeqLenShadow(seq), table, 9000))
    slots = step.run(meta, c.q_fp8, c.weights, c.k_cache, slots=True)
    assert bool(((slots >= 0) | (slots == -1)).all()) and bool((slots[1:] == -1).all())
    assert step.health().unmapped_slots == 100 and step.health().ok


def test_the_metadata_kernel_reads_negative_device_lengths_as_zero():
    from vllm_sparse_sync import DecodeBatch, IndexerLayout, IndexerMetadataBuilder

    for world, ratio in ((1, 1), (2, 1), (1, 4)):
        layout = IndexerLayout(backend="b12x", compress_ratio=ratio, dcp_world_size=world, max_model_len=4096)
        kw = dict(max_num_reqs=4, max_num_tokens=12, max_pages_per_req=70)
        gpu = IndexerMetadataBuilder(layout, device=DEV, **kw)
        cpu = IndexerMetadataBuilder(layout, device="cpu", **kw)
        for query_lens in ([1, 1, 1, 1], [2, 2, 2, 2], [1, 3, 2, 1]):
            seq = torch.tensor([3000, -7, -(2**31), 5], dtype=torch.int32)
            starts = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
            table = torch.zeros(4, 70, dtype=torch.int32)
            a = gpu.build(DecodeBatch(starts.to(DEV), starts, seq.to(DEV), None, table.to(DEV), 4096))
            b = cpu.build(DecodeBatch(starts.clone(), starts, seq.clone(), None, table, 4096))
            assert torch.equal(a.row_lens.cpu(), b.row_lens) and int(b.row_lens.min()) >= 0


ASSERT_CASES = {
    "negative seq_lens": ("b.build(batch([500, -7], [0, 1, 2], [0, 1, 2]))", True),
    "query_start_loc differs (plain decode)": ("b.build(batch([500, 600], [0, 1, 2], [0, 1, 3]))", True),
    "query_start_loc differs (MTP, ragged)": ("b.build(batch([500, 600, 700], [0, 2, 3, 6], [0, 1, 4, 6]))", True),
    "honest batch": ("b.build(batch([500, 600, 700], [0, 1, 4, 6], [0, 1, 4, 6]))", False),
    "slots without a page (device checks)": ("slots_without_a_page()", True),
}
ASSERT_SCRIPT = """
import os, torch
from vllm_sparse_sync import DecodeBatch, IndexerLayout, IndexerMetadataBuilder, kernels
lay = IndexerLayout(backend="b12x", topk=8, max_model_len=1024)
b = IndexerMetadataBuilder(lay, max_num_reqs=4, max_num_tokens=8, max_pages_per_req=16, device="cuda",
                           check_bound=True)
def batch(seq, host_qsl, dev_qsl):
    host = torch.tensor(host_qsl, dtype=torch.int32)
    return DecodeBatch(torch.tensor(dev_qsl, dtype=torch.int32, device="cuda"), host,
                       torch.tensor(seq, dtype=torch.int32, device="cuda"), None,
                       torch.zeros(len(seq), 16, dtype=torch.int32, device="cuda"), 1000)
def slots_without_a_page():
    os.environ["VLLM_SPARSE_SYNC_DEVICE_CHECKS"] = "1"
    kernels.page_table_slots(torch.tensor([[3]], dtype=torch.int32, device="cuda"),
                             torch.tensor([[-1]], dtype=torch.int32, device="cuda"), 64)
CALL
torch.cuda.synchronize()
print("NOT CAUGHT")
"""


@pytest.mark.parametrize("case", sorted(ASSERT_CASES))
def test_device_side_assertions_fire_without_a_host_sync(case):
    call, fires = ASSERT_CASES[case]
    proc = subprocess.run([sys.executable, "-c", ASSERT_SCRIPT.replace("CALL", call)], capture_output=True,
                          text=True, timeout=300)
    if fires:
        assert proc.returncode != 0 and "NOT CAUGHT" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
        assert "assert" in proc.stderr.lower()
    else:
        assert proc.returncode == 0 and "NOT CAUGHT" in proc.stdout, proc.stderr[-2000:]
