"""The DCP send-key and merge + remap Triton kernels (``kernels.triton_dcp_merge``) in Triton's
CPU interpreter, against the torch path they replace on CUDA (``dcp.local_to_global`` +
``dcp.candidate_keys``; ``dcp.merge_candidate_keys`` + ``dcp.global_to_local`` + ``>= 0``):
identical output, element for element, on random and adversarial inputs (ties, NaN / -0.0 /
inf scores, padding, rows with fewer than k candidates, duplicate and arbitrary int64 keys,
world 2/4/8, interleave 1/2/64). Also: the wrappers never read device data on the host.
Sizes are small (k 16..128): the interpreter runs the bitonic sort in Python.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from interpret_env import CUDA, SKIP_WITH_CUDA

triton = pytest.importorskip("triton")

from vllm_sparse_sync import dcp  # noqa: E402
from vllm_sparse_sync.kernels.triton import dcp_merge as tm  # noqa: E402
from vllm_sparse_sync.testing import no_host_sync  # noqa: E402

pytestmark = [pytest.mark.interpret, pytest.mark.skipif(CUDA, reason=SKIP_WITH_CUDA)]

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECIAL = [float("nan"), -float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1.0, -1.0]


def _scores(gen, shape, style):
    """fp32 scores: ``plain`` random, ``ties`` (few distinct values), ``special`` (NaN, -0.0,
    inf mixed into ties)."""
    if style == "plain":
        return torch.randn(shape, generator=gen)
    s = torch.randint(-3, 4, shape, generator=gen).float() / 2
    if style == "special":
        pick = torch.randint(0, len(SPECIAL), shape, generator=gen)
        use = torch.rand(shape, generator=gen) < 0.5
        s = torch.where(use, torch.tensor(SPECIAL)[pick], s)
    return s


def _local_idx(gen, rows, k, span, pad_frac, dtype):
    """Distinct local positions per row (``span`` of them), ``-1`` in a ``pad_frac`` of the slots
    and in every slot past ``span`` (a row with fewer than k candidates)."""
    idx = torch.full((rows, k), -1, dtype=torch.int64)
    for r in range(rows):
        n = min(k, span)
        idx[r, :n] = torch.randperm(max(span, 1), generator=gen)[:n]
        idx[r] = idx[r, torch.randperm(k, generator=gen)]
    drop = torch.rand(rows, k, generator=gen) < pad_frac
    return torch.where(drop, torch.full_like(idx, -1), idx).to(dtype)


@st.composite
def send_cases(draw):
    world = draw(st.sampled_from([2, 4, 8]))
    return dict(world=world, rank=draw(st.integers(0, world - 1)),
                interleave=draw(st.sampled_from([1, 2, 64])), rows=draw(st.integers(1, 9)),
                k=draw(st.sampled_from([1, 16, 64, 128, 100])),
                span=draw(st.sampled_from([0, 5, 40, 300, 5000])),
                pad_frac=draw(st.sampled_from([0.0, 0.3, 1.0])),
                dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                style=draw(st.sampled_from(["plain", "ties", "special"])),
                row_pad=draw(st.sampled_from([0, 3])), seed=draw(st.integers(0, 2**31 - 1)))


def _torch_send(idx, scores, world, rank, interleave):
    return dcp.candidate_keys(scores, dcp.local_to_global(idx, world, rank, interleave))


@SETTINGS
@given(c=send_cases())
def test_send_keys_equal_the_torch_keys(c):
    gen = torch.Generator().manual_seed(c["seed"])
    rows, k, world, rank, inter = c["rows"], c["k"], c["world"], c["rank"], c["interleave"]
    idx = _local_idx(gen, rows, k, c["span"], c["pad_frac"], c["dtype"])
    # per-slot scores, in a buffer with a row stride wider than k (views, as the step passes)
    scores = _scores(gen, (rows, k + c["row_pad"]), c["style"])[:, :k]
    send = torch.full((rows * k,), 7, dtype=torch.int64)
    tm.dcp_send_keys(idx, scores, send, world=world, rank=rank, interleave=inter, gather=False)
    want = _torch_send(idx, scores, world, rank, inter)
    assert torch.equal(send.view(rows, k), want)
    # gathered from a logits buffer at each slot's local position (the step's Triton route)
    width = max(c["span"], 1)
    logits = _scores(gen, (rows, width + c["row_pad"]), c["style"])[:, :width]
    tm.dcp_send_keys(idx, logits, send, world=world, rank=rank, interleave=inter, gather=True)
    g = logits.gather(1, idx.clamp_min(0).long())
    g = torch.where(idx >= 0, g, torch.full_like(g, float("-inf")))
    assert torch.equal(send.view(rows, k), _torch_send(idx, g, world, rank, inter))


def _torch_merge(keys, k, world, rank, interleave):
    merged = dcp.merge_candidate_keys(keys, k)
    local = dcp.global_to_local(merged, world, rank, interleave)
    return merged, local, local >= 0


def _kernel_merge(keys, k, world, rank, interleave, row_pad=0):
    rows = keys.shape[1]
    # output buffers: views of wider persistent buffers, prefilled with junk
    gi = torch.full((rows + 2, k + row_pad), 5, dtype=torch.int32)[:rows, :k]
    li = torch.full((rows + 2, k + row_pad), 5, dtype=torch.int32)[:rows, :k]
    mk = torch.ones(rows + 2, k + row_pad, dtype=torch.bool)[:rows, :k]
    tm.dcp_merge(keys, k, gi, li, mk, world=world, rank=rank, interleave=interleave)
    return gi, li, mk


def _assert_same(got, want):
    for name, a, b in zip(("global_idx", "local_idx", "local_mask"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        bad = (a != b).nonzero().tolist()
        assert not bad, f"{name}: {len(bad)} slots differ, first {bad[:5]}: kernel " \
            f"{[a[i, j].item() for i, j in bad[:5]]} != torch {[b[i, j].item() for i, j in bad[:5]]}"


@st.composite
def merge_cases(draw):
    world = draw(st.sampled_from([2, 4, 8]))
    k = draw(st.sampled_from([1, 16, 64, 128, 48]))
    return dict(world=world, rank=draw(st.integers(0, world - 1)),
                interleave=draw(st.sampled_from([1, 2, 64])), rows=draw(st.integers(1, 9)),
                k=k, k_local=draw(st.sampled_from([k, k, max(1, k // 4), 2 * k])),
                span=draw(st.sampled_from([0, 3, 40, 300, 5000])),
                pad_frac=draw(st.sampled_from([0.0, 0.3, 1.0])),
                style=draw(st.sampled_from(["plain", "ties", "special", "raw"])),
                row_pad=draw(st.sampled_from([0, 3])), seed=draw(st.integers(0, 2**31 - 1)))


def _gathered(c, gen):
    """Gathered keys ``int64 [world, rows, k_local]``: every rank's send keys (as the step
    makes them), or with ``raw`` arbitrary int64 keys (duplicates, PAD_KEY, ids past int32)."""
    world, rows, kl = c["world"], c["rows"], c["k_local"]
    if c["style"] == "raw":
        keys = torch.randint(-(2**63), 2**63 - 1, (world, rows, kl), generator=gen, dtype=torch.int64)
        few = torch.tensor([dcp.PAD_KEY, 0, -1, 2**63 - 1, (5 << 32) + 0xFFFFFFFF, (5 << 32) + 3])
        pick = torch.randint(0, len(few), keys.shape, generator=gen)
        return torch.where(torch.rand(keys.shape, generator=gen) < 0.5, few[pick], keys)
    out = []
    for rank in range(world):
        idx = _local_idx(gen, rows, kl, c["span"], c["pad_frac"], torch.int32)
        out.append(_torch_send(idx, _scores(gen, (rows, kl), c["style"]), world, rank, c["interleave"]))
    return torch.stack(out)


@SETTINGS
@given(c=merge_cases())
def test_merge_equals_the_torch_merge_and_remap(c):
    gen = torch.Generator().manual_seed(c["seed"])
    keys = _gathered(c, gen)
    args = (c["k"], c["world"], c["rank"], c["interleave"])
    _assert_same(_kernel_merge(keys, *args, row_pad=c["row_pad"]), _torch_merge(keys, *args))


@pytest.mark.parametrize("world, interleave", [(2, 1), (4, 64), (8, 2)])
def test_merge_of_the_step_buffers_adversarial_rows(world, interleave):
    """The gathered buffer as the step views it (``[world * rows * k]`` flat, viewed
    ``[world, rows, k]``); rows: all padding, one candidate, all ties at one score (the lowest
    ids win), all NaN, -0.0 against +0.0, and a full row."""
    k, rows = 16, 6
    gen = torch.Generator().manual_seed(world * 100 + interleave)
    per_rank = []
    for rank in range(world):
        idx = _local_idx(gen, rows, k, 200, 0.0, torch.int32)
        s = torch.randn(rows, k, generator=gen)
        idx[0] = -1  # row 0: padding everywhere
        idx[1, 1:] = -1  # row 1: one candidate per rank
        s[2] = 0.5  # row 2: all tied
        s[3] = float("nan")  # row 3: all NaN
        s[4] = torch.where(torch.arange(k) % 2 == 0, torch.tensor(-0.0), torch.tensor(0.0))
        per_rank.append(_torch_send(idx, s, world, rank, interleave))
    flat = torch.stack(per_rank).reshape(-1)
    keys = flat.view(world, rows, k)
    for rank in range(world):
        args = (k, world, rank, interleave)
        got, want = _kernel_merge(keys, *args), _torch_merge(keys, *args)
        _assert_same(got, want)
    assert (got[0][0] == -1).all() and (got[0][1, world:] == -1).all()
    assert torch.equal(got[0][4, :world * k // 2].sort().values,
                       want[0][4, :world * k // 2].sort().values)


def test_merge_fits_and_its_limit():
    assert tm.merge_fits(2, 2048, 2048) and tm.merge_fits(4, 1024, 2048)
    assert not tm.merge_fits(4, 2048, 2048)  # 8192 keys: the step takes the torch merge
    assert tm.merge_width(3, 100, 100) == 512 and tm.merge_width(2, 4, 16) == 16
    keys = torch.zeros(4, 1, 2048, dtype=torch.int64)
    out = [torch.zeros(1, 2048, dtype=t) for t in (torch.int32, torch.int32, torch.bool)]
    with pytest.raises(ValueError, match="MAX_MERGE_KEYS"):
        tm.dcp_merge(keys, 2048, *out, world=4, rank=0, interleave=1)


def test_merge_rejects_bad_buffers():
    keys = torch.zeros(2, 3, 16, dtype=torch.int64)
    ok = [torch.zeros(3, 16, dtype=t) for t in (torch.int32, torch.int32, torch.bool)]
    with pytest.raises(ValueError, match="gathered"):
        tm.dcp_merge(keys.int(), 16, *ok, world=2, rank=0, interleave=1)
    with pytest.raises(ValueError, match="local_mask"):
        tm.dcp_merge(keys, 16, ok[0], ok[1], ok[1], world=2, rank=0, interleave=1)
    with pytest.raises(ValueError, match="send"):
        tm.dcp_send_keys(ok[0], ok[0].float(), torch.zeros(5, dtype=torch.int64), world=2, rank=0,
                         interleave=1, gather=False)


# ------------------------------------------------------------------ no host reads
def test_the_wrappers_never_read_device_data():
    world, rank, inter, rows, k = 4, 1, 2, 3, 16
    gen = torch.Generator().manual_seed(3)
    idx = _local_idx(gen, rows, k, 50, 0.2, torch.int32)
    logits = torch.randn(rows, 64, generator=gen)
    send = torch.empty(rows * k, dtype=torch.int64)
    keys = torch.stack([_torch_send(_local_idx(gen, rows, k, 50, 0.2, torch.int32),
                                    torch.randn(rows, k, generator=gen), world, r, inter)
                        for r in range(world)])
    gi, li = (torch.empty(rows, k, dtype=torch.int32) for _ in range(2))
    mk = torch.empty(rows, k, dtype=torch.bool)
    with no_host_sync(watch=[idx, logits, send, keys, gi, li, mk], layers="sentinel",
                      where="triton_dcp_merge") as check:
        tm.dcp_send_keys(idx, logits, send, world=world, rank=rank, interleave=inter, gather=True)
        tm.dcp_merge(keys, k, gi, li, mk, world=world, rank=rank, interleave=inter)
    assert check.touched > 0
    _assert_same((gi, li, mk), _torch_merge(keys, k, world, rank, inter))
