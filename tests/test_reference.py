import math

import pytest
import torch

from vllm_sparse_sync.kernels import reference as R

PAGE, D = 64, 128


def _cache(num_pages, gen):
    k = torch.randn(num_pages * PAGE, D, generator=gen) * 2
    k8, ks = R.quantize_index_k(k)
    cache = torch.zeros(num_pages, R.page_bytes(PAGE, D), dtype=torch.uint8)
    slots = torch.randperm(num_pages * PAGE, generator=gen)
    R.write_index_k_cache(cache, k8, ks, slots)
    return cache


def _brute_logits(q8, w, cache, bt, lens, width, active=None):
    """float64, one position at a time, straight from the page bytes."""
    page = cache.shape[1] // (D + 4)
    rows = q8.shape[0]
    out = torch.full((rows, width), -math.inf, dtype=torch.float64)
    qf = q8.double()
    for r in range(rows):
        n = min(int(lens[r]), width, bt.shape[1] * page)
        if active is not None:
            n = min(n, int(active[0]))
        for t in range(max(n, 0)):
            p = int(bt[r, t // page])
            if not 0 <= p < cache.shape[0]:
                continue
            s = t % page
            kb = cache[p, s * D:(s + 1) * D].view(torch.float8_e4m3fn).double()
            scale = cache[p, page * D + 4 * s: page * D + 4 * s + 4].view(torch.float32).double()
            out[r, t] = float(scale * (w[r].double() * (qf[r] @ kb).clamp_min(0)).sum())
    return out


def _inputs(rows, heads, gen):
    q8 = (torch.randn(rows, heads, D, generator=gen) * 3).to(torch.float8_e4m3fn)
    w = torch.randn(rows, heads, generator=gen)
    return q8, w


def test_quantize_round_trip_and_pow2_scales(gen):
    k = torch.randn(50, D, generator=gen) * 10
    k8, ks = R.quantize_index_k(k)
    assert k8.dtype == torch.float8_e4m3fn and ks.dtype == torch.float32 and ks.shape == (50,)
    assert torch.equal(torch.exp2(torch.log2(ks).round()), ks)
    err = (k8.float() * ks[:, None] - k).norm() / k.norm()
    assert err < 0.05
    _, plain = R.quantize_index_k(k, pow2_scale=False)
    assert torch.allclose(plain, k.abs().amax(1) / 448)


def test_write_cache_places_bytes_and_skips_negative_slots(gen):
    cache = torch.zeros(3, R.page_bytes(PAGE, D), dtype=torch.uint8)
    k8, ks = R.quantize_index_k(torch.randn(4, D, generator=gen))
    R.write_index_k_cache(cache, k8, ks, torch.tensor([0, 65, -1, 191]))
    vals, scales = R.split_index_k_cache(cache)
    assert torch.equal(vals[0, 0].view(torch.uint8), k8[0].view(torch.uint8))
    assert torch.equal(vals[1, 1].view(torch.uint8), k8[1].view(torch.uint8))
    assert torch.equal(vals[2, 63].view(torch.uint8), k8[3].view(torch.uint8))
    assert scales[0, 0] == ks[0] and scales[1, 1] == ks[1] and scales[2, 63] == ks[3]
    assert int((scales != 0).sum()) == 3  # slot -1 wrote nothing


@pytest.mark.parametrize("heads", [64, 32])
def test_logits_match_float64_brute_force(gen, heads):
    rows, pages = 4, 5
    cache = _cache(20, gen)
    bt = torch.randperm(20, generator=gen)[: rows * pages].view(rows, pages).to(torch.int32)
    bt[3, 2:] = -1  # holes past the live pages of row 3
    lens = torch.tensor([0, 64, 317, 128], dtype=torch.int32)  # empty, one page, ragged, 2 pages
    q8, w = _inputs(rows, heads, gen)
    width = pages * PAGE + 40  # a host width past the table
    got = R.paged_indexer_logits(q8, w, cache, bt, lens, width)
    want = _brute_logits(q8, w, cache, bt, lens, width)
    assert got.dtype == torch.float32 and got.shape == (rows, width)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert ((got.double()[fin] - want[fin]).norm() / want[fin].norm()) < 1e-6


def test_active_width_clamps_and_holes_inside_score_minus_inf(gen):
    cache = _cache(4, gen)
    bt = torch.tensor([[0, -1, 2, 3]], dtype=torch.int32)
    q8, w = _inputs(1, 64, gen)
    lens = torch.tensor([250], dtype=torch.int32)
    active = torch.tensor([200], dtype=torch.int32)
    got = R.paged_indexer_logits(q8, w, cache, bt, lens, 256, active_width=active)
    want = _brute_logits(q8, w, cache, bt, lens, 256, active)
    assert torch.isinf(got[0, 64:128]).all() and torch.isinf(got[0, 200:]).all()
    assert torch.isfinite(got[0, 128:200]).all()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert ((got.double()[fin] - want[fin]).norm() / want[fin].norm()) < 1e-6


def _check_topk(out, logits, lens, k):
    for r in range(out.shape[0]):
        n = min(int(lens[r]), logits.shape[1])
        row = out[r].tolist()
        valid = [i for i in row if i >= 0]
        assert row[: len(valid)] == valid and all(i == -1 for i in row[len(valid):])
        if n <= k:
            assert valid == list(range(n))
            continue
        assert len(valid) == k and len(set(valid)) == k and max(valid) < n
        kth = torch.topk(logits[r, :n], k).values[-1]
        assert logits[r, valid].min() >= kth


@pytest.mark.parametrize("k", [8, 64])
def test_topk_edge_cases(gen, k):
    logits = torch.randn(6, 300, generator=gen)
    lens = torch.tensor([0, 1, k, k + 1, 300, 299], dtype=torch.int32)
    out = R.topk_indices(logits, lens, k)
    assert out.dtype == torch.int32 and out.shape == (6, k)
    _check_topk(out, logits, lens, k)
    assert out[0].eq(-1).all()


def test_topk_ties_go_to_the_lower_position_and_are_deterministic():
    logits = torch.zeros(2, 100)
    logits[1, 50:] = 1.0
    lens = torch.tensor([100, 100], dtype=torch.int32)
    out = R.topk_indices(logits, lens, 10)
    assert out[0].tolist() == list(range(10))
    assert out[1].tolist() == list(range(50, 60))
    assert torch.equal(out, R.topk_indices(logits, lens, 10))


def test_bound_far_above_live_lengths_changes_nothing(gen):
    cache = _cache(8, gen)
    bt = torch.arange(8, dtype=torch.int32).view(2, 4)
    q8, w = _inputs(2, 64, gen)
    lens = torch.tensor([200, 90], dtype=torch.int32)
    exact = R.indexer_topk(q8, w, cache, bt, lens, 32, width=200)
    wide_host = R.indexer_topk(q8, w, cache, bt, lens, 32, width=131072)
    wide = torch.tensor([131072], dtype=torch.int32)
    wide_dev = R.indexer_topk(q8, w, cache, bt, lens, 32, active_width=wide)
    assert torch.equal(exact, wide_host) and torch.equal(exact, wide_dev)
    logits = R.paged_indexer_logits(q8, w, cache, bt, lens, 256)
    _check_topk(exact, logits, lens, 32)


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda q, w, c, bt, n: R.paged_indexer_logits(q.float(), w, c, bt, n, 64), "q_fp8"),
        (lambda q, w, c, bt, n: R.paged_indexer_logits(q, w[:, :3], c, bt, n, 64), "weights"),
        (lambda q, w, c, bt, n: R.paged_indexer_logits(q, w, c.float(), bt, n, 64), "k_cache"),
        (lambda q, w, c, bt, n: R.paged_indexer_logits(q, w, c, bt[:1], n, 64), "block_table"),
        (lambda q, w, c, bt, n: R.paged_indexer_logits(q, w, c, bt, n[:1], 64), "row_lens"),
        (lambda q, w, c, bt, n: R.topk_indices(torch.zeros(2, 5), n, 0), "k"),
    ],
)
def test_bad_kernel_input_names_the_argument(gen, call, field):
    cache = _cache(2, gen)
    q8, w = _inputs(2, 8, gen)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=field):
        call(q8, w, cache, bt, torch.tensor([5, 5], dtype=torch.int32))
