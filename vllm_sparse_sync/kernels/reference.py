"""Torch reference kernels of the decode indexer: the oracle for every other kernel.

They run on any device (the CPU included) and favour clarity over speed: work is bounded by
the live lengths, so they stay usable for small and medium shapes. Layouts and semantics are
those of docs/design.md section 5:

* K cache page (``page_size`` tokens): ``uint8 [num_pages, page_size * (head_dim + 4)]``,
  planar: ``page_size x head_dim`` e4m3 bytes, then ``page_size`` fp32 per-token scales.
* ``logit[r, t] = k_scale[t] * sum_h w[r, h] * relu(q[r, h, :] . k[t, :])``, fp32; ``relu`` is
  IEEE maxNum (a NaN dot product counts as 0, as the GPU's max instruction does); NaN weights or
  scales make NaN scores.
* A position is live when ``t < min(row_len[r], active_width[0], pages * page_size)`` and its
  page id is in ``[0, num_pages)``; other positions score ``-inf``.
* Top-k: ``int32 [rows, k]``, the set of the ``k`` best positions first, then ``-1``
  padding; a row of effective length ``<= k`` gives exactly ``0..len-1``. Scores order as the
  sortable int32 keys of the Triton kernels (``sortable_keys``): NaN below every number, ``-0.0``
  below ``+0.0``; ties at the k-th score go to the lower positions. Here valid entries come in
  descending key order; other routes may order them otherwise (the contract is the set).
* K-cache writes skip slots ``< 0`` and slots past the cache, on every route.
* KV-cache slots of top-k positions (``page_table=``, ``page_table_slots``): position ``p`` of
  row ``r`` becomes ``page_table[r, p // page_size] * page_size + p % page_size`` (int32), the
  form sparse attention reads; ``-1`` stays ``-1``. A slot is a valid slot or ``-1``: a position
  past the table, or whose page entry is negative or gives a slot past ``2**31 - 1``, becomes
  ``-1`` and is counted (``unmapped``, reported by ``IndexerStep.health()``).
* Host arguments are checked up front (``ValueError``/``TypeError`` naming the argument);
  integer tensors are int32 or int64, never cast from floats; all tensors of a call share one
  device.
"""

from __future__ import annotations

import os

import torch

from .. import checks

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BYTES = 4


DEVICE_CHECKS_ENV = "VLLM_SPARSE_SYNC_DEVICE_CHECKS"


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what}")


def _host_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as a host int in ``[low, high]`` (``checks.host_int``)."""
    return checks.host_int(name, value, low=low, high=high)


def check_k(k: object) -> int:
    """The top-k as a positive host int, at most ``checks.MAX_KERNEL_ROWS``."""
    return _host_int("k", k, 1, checks.MAX_KERNEL_ROWS)


def check_width(width: object) -> int:
    """A logits width as a host int in ``[0, checks.MAX_KERNEL_ROWS]``."""
    return _host_int("width", width, 0, checks.MAX_KERNEL_ROWS)


def check_lengths(name: str, t: object, rows: int, device: torch.device) -> torch.Tensor:
    """``t`` as int32/int64 lengths ``[rows]`` on ``device``."""
    t = checks.int_tensor(name, t)
    _check(t.shape == (rows,), name, f"must be [rows={rows}], got {tuple(t.shape)}")
    checks.same_device(name, t, device)
    return t


def check_active_width(active_width: object, device: torch.device) -> torch.Tensor | None:
    """``active_width`` as None or an int32/int64 tensor of one element on ``device``."""
    if active_width is None:
        return None
    t = checks.int_tensor("active_width", active_width)
    _check(t.numel() == 1, "active_width", f"must hold one element, got {tuple(t.shape)}")
    checks.same_device("active_width", t, device)
    return t


def device_checks_enabled() -> bool:
    """Whether the opt-in device-side assertions run (``VLLM_SPARSE_SYNC_DEVICE_CHECKS=1``)."""
    return os.environ.get(DEVICE_CHECKS_ENV, "") == "1"


def device_check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Opt-in device-side assertion that every non-negative slot lies in the cache (no sync)."""
    if device_checks_enabled() and slot_mapping.numel():
        ok = ((slot_mapping < 0) | (slot_mapping < num_slots)).all()
        torch._assert_async(ok, f"slot_mapping: a slot lies past the cache of {num_slots} slots")


def sortable_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered as the float32 scores: the Triton kernels' ``sortable_key``."""
    bits = x.float().contiguous().view(torch.int32)
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return torch.where(torch.isnan(x), torch.full_like(keys, -(2**31)), keys)


def page_bytes(page_size: int, head_dim: int = 128) -> int:
    """Bytes of one K cache page."""
    return page_size * (head_dim + SCALE_BYTES)


def page_size_of(k_cache: torch.Tensor, head_dim: int = 128) -> int:
    """Tokens per page of a ``[num_pages, page_size * (head_dim + 4)]`` uint8 cache.

    ``head_dim`` is a multiple of 8 and the page size a power of two, so a row's bytes name one
    page size: a key of another head dim does not fit a cache made for this one."""
    checks.tensor("k_cache", k_cache)
    _check(k_cache.dtype == torch.uint8, "k_cache", f"must be uint8, got {k_cache.dtype}")
    _check(k_cache.dim() == 2, "k_cache", f"must be 2-D [num_pages, page_bytes], got {tuple(k_cache.shape)}")
    _check(head_dim > 0 and head_dim % 8 == 0, "head_dim", f"must be a positive multiple of 8, got {head_dim}")
    row = k_cache.shape[1]
    page = row // (head_dim + SCALE_BYTES)
    _check(row % (head_dim + SCALE_BYTES) == 0 and page > 0 and page & (page - 1) == 0, "k_cache",
           f"a row of {row} bytes is not a power-of-two number of tokens of head_dim {head_dim} + 4 "
           f"scale bytes (is the key's head dim the cache's?)")
    return page


def quantize_index_k(k: torch.Tensor, *, pow2_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization of indexer keys ``[T, D]`` -> ``(k_fp8 [T, D], k_scale [T] fp32)``.

    ``scale = max(amax, 1e-4) / 448``, rounded up to a power of two when ``pow2_scale`` (ue8m0,
    as vLLM stores it); ``k ~= k_fp8 * scale``.
    """
    checks.tensor("k", k)
    pow2_scale = checks.flag("pow2_scale", pow2_scale)
    _check(k.dim() == 2, "k", f"must be 2-D [tokens, head_dim], got {tuple(k.shape)}")
    _check(k.is_floating_point(), "k", f"must be floating point, got {k.dtype}")
    kf = k.float()
    finite = torch.isfinite(kf).all()
    if kf.device.type == "cpu":
        if not bool(finite):
            bad = (~torch.isfinite(kf)).nonzero()[0].tolist()
            raise ValueError(f"k: non-finite value {kf[bad[0], bad[1]].item()} at {tuple(bad)}")
    else:  # no host read: the device asserts (asynchronously, capturable)
        torch._assert_async(finite, "k: non-finite values (NaN or inf) in the keys to quantize")
    scale = kf.abs().amax(dim=1).clamp_min(1e-4) / FP8_MAX
    if pow2_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    k_fp8 = (kf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return k_fp8, scale.contiguous()


def split_index_k_cache(k_cache: torch.Tensor, head_dim: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a K cache as ``(k_fp8 [pages, page, D], k_scale [pages, page] fp32)`` (copies)."""
    page = page_size_of(k_cache, head_dim)
    n = k_cache.shape[0]
    values = k_cache[:, : page * head_dim].reshape(n, page, head_dim).contiguous().view(FP8_DTYPE)
    scales = k_cache[:, page * head_dim :].contiguous().view(torch.float32).reshape(n, page)
    return values, scales


def write_index_k_cache(
    k_cache: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter quantized keys into the planar page layout, in place; slots ``< 0`` or past the
    cache are skipped."""
    check_cache_write(k_cache, k_fp8, k_scale, slot_mapping)
    head_dim = k_fp8.shape[1]
    page = page_size_of(k_cache, head_dim)
    _check(k_cache.is_contiguous(), "k_cache", "must be contiguous")
    device_check_slots(slot_mapping, k_cache.shape[0] * page)
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < k_cache.shape[0] * page)
    slots, vals, scales = slots[keep], k_fp8[keep], k_scale[keep]
    row_bytes = k_cache.shape[1]
    base = (slots // page) * row_bytes
    off = slots % page
    flat = k_cache.view(-1)
    d = torch.arange(head_dim, device=k_cache.device)
    flat[(base + off * head_dim)[:, None] + d] = vals.contiguous().view(torch.uint8)
    s = torch.arange(SCALE_BYTES, device=k_cache.device)
    scale_bytes = scales.contiguous().view(torch.uint8).view(-1, SCALE_BYTES)
    flat[(base + page * head_dim + off * SCALE_BYTES)[:, None] + s] = scale_bytes


def check_cache_write(k_cache, k_fp8, k_scale, slot_mapping) -> int:
    """The page size of ``write_index_k_cache``'s arguments once checked (metadata only)."""
    k_fp8 = checks.tensor("k_fp8", k_fp8)
    _check(k_fp8.dim() == 2, "k_fp8", f"must be 2-D [tokens, head_dim], got {tuple(k_fp8.shape)}")
    _check(k_fp8.dtype == FP8_DTYPE, "k_fp8", f"must be {FP8_DTYPE}, got {k_fp8.dtype}")
    _check(k_fp8.shape[1] > 0 and k_fp8.shape[1] % 8 == 0, "k_fp8",
           f"head_dim must be a positive multiple of 8, got {k_fp8.shape[1]}")
    page = page_size_of(k_cache, k_fp8.shape[1])
    k_scale = checks.tensor("k_scale", k_scale)
    _check(k_scale.dtype == torch.float32 and k_scale.shape == (k_fp8.shape[0],), "k_scale",
           f"must be float32 [{k_fp8.shape[0]}], got {k_scale.dtype} {tuple(k_scale.shape)}")
    slot_mapping = checks.int_tensor("slot_mapping", slot_mapping)
    _check(slot_mapping.shape == (k_fp8.shape[0],), "slot_mapping",
           f"must have one slot per token ({k_fp8.shape[0]}), got {tuple(slot_mapping.shape)}")
    for name, t in (("k_fp8", k_fp8), ("k_scale", k_scale), ("slot_mapping", slot_mapping)):
        checks.same_device(name, t, k_cache.device)
    return page


def effective_lengths(
    row_lens: torch.Tensor, width: int, active_width: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row live length ``min(row_len, active_width[0], width)``, clamped at 0 (int64)."""
    eff = row_lens.long().clamp(min=0, max=width)
    if active_width is not None:
        eff = torch.minimum(eff, active_width.long().reshape(-1)[:1].clamp_min(0))
    return eff


def _check_scorer_inputs(q_fp8, weights, k_cache, block_table, row_lens, active_width) -> None:
    for name, t in (("q_fp8", q_fp8), ("weights", weights), ("k_cache", k_cache),
                    ("block_table", block_table), ("row_lens", row_lens)):
        checks.tensor(name, t)
    _check(q_fp8.dim() == 3, "q_fp8", f"must be 3-D [rows, heads, head_dim], got {tuple(q_fp8.shape)}")
    _check(q_fp8.dtype == FP8_DTYPE, "q_fp8", f"must be {FP8_DTYPE}, got {q_fp8.dtype}")
    rows, heads, _ = q_fp8.shape
    dev = q_fp8.device
    _check(weights.shape == (rows, heads), "weights",
           f"must be [rows, heads] = {(rows, heads)}, got {tuple(weights.shape)}")
    _check(weights.dtype == torch.float32, "weights", f"must be float32, got {weights.dtype}")
    checks.int_tensor("block_table", block_table)
    _check(block_table.dim() == 2 and block_table.shape[0] == rows, "block_table",
           f"must be [rows={rows}, pages], got {tuple(block_table.shape)}")
    check_lengths("row_lens", row_lens, rows, dev)
    check_active_width(active_width, dev)
    for name, t in (("weights", weights), ("k_cache", k_cache), ("block_table", block_table)):
        checks.same_device(name, t, dev)


def paged_indexer_logits(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_lens: torch.Tensor,
    width: int,
    *,
    active_width: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer scores ``fp32 [rows, width]`` over a paged fp8 K cache; ``-inf`` past live lengths."""
    _check_scorer_inputs(q_fp8, weights, k_cache, block_table, row_lens, active_width)
    width = check_width(width)
    head_dim = q_fp8.shape[2]
    page = page_size_of(k_cache, head_dim)
    values, scales = split_index_k_cache(k_cache, head_dim)
    num_pages = k_cache.shape[0]
    rows = q_fp8.shape[0]
    out = torch.full((rows, int(width)), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    eff = effective_lengths(row_lens, min(int(width), block_table.shape[1] * page), active_width)
    for r, n in enumerate(eff.tolist()):
        if n == 0:
            continue
        t = torch.arange(n, device=q_fp8.device)
        pages = block_table[r, t // page].long()
        ok = (pages >= 0) & (pages < num_pages)
        safe = pages.clamp(0, max(num_pages - 1, 0))
        k = values[safe, t % page].float()  # [n, D]
        s = scales[safe, t % page]
        dots = q_fp8[r].float() @ k.T  # [H, n]
        relu = torch.where(torch.isnan(dots), torch.zeros_like(dots), dots).clamp_min(0)  # maxNum
        logit = (weights[r][:, None] * relu).sum(0) * s
        out[r, :n] = torch.where(ok, logit, torch.full_like(logit, float("-inf")))
    return out


def check_topk_inputs(logits, row_lens, k, active_width) -> None:
    """``topk_indices``'s argument checks (metadata only)."""
    checks.tensor("logits", logits)
    _check(logits.dim() == 2, "logits", f"must be 2-D [rows, width], got {tuple(logits.shape)}")
    _check(logits.dtype == torch.float32, "logits", f"must be float32, got {logits.dtype}")
    _check(logits.shape[1] <= checks.MAX_KERNEL_ROWS, "logits",
           f"a width of {logits.shape[1]} exceeds the kernels' limit of {checks.MAX_KERNEL_ROWS}")
    check_lengths("row_lens", row_lens, logits.shape[0], logits.device)
    check_active_width(active_width, logits.device)
    check_k(k)


def topk_indices(
    logits: torch.Tensor, row_lens: torch.Tensor, k: int, *, active_width: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None, page_size: int | None = None,
    unmapped: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-``k`` positions per row ``int32 [rows, k]`` among the row's live positions, ``-1`` padded
    (with ``page_table``: their KV-cache slots, ``page_table_slots``; ``unmapped``: see there)."""
    check_topk_inputs(logits, row_lens, k, active_width)
    k = check_k(k)
    if page_table is not None:
        check_page_table(page_table, page_size, logits.shape[0], logits.device)
        positions = topk_indices(logits, row_lens, k, active_width=active_width)
        return page_table_slots(positions, page_table, page_size, unmapped=unmapped)
    rows, width = logits.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    eff = effective_lengths(row_lens, width, active_width)
    for r, n in enumerate(eff.tolist()):
        if n <= k:
            out[r, :n] = torch.arange(n, dtype=torch.int32, device=logits.device)
        else:
            keys = sortable_keys(logits[r, :n])
            order = torch.sort(keys, descending=True, stable=True).indices
            out[r] = order[:k].to(torch.int32)
    return out


MAX_PAGE_BITS = 20


def check_page_table(page_table: object, page_size: object, rows: int, device: torch.device) -> int:
    """log2 of ``page_size`` once ``page_table`` can map ``rows`` rows of positions to slots:
    int32 ``[>= rows, pages]`` with contiguous rows on ``device``; ``page_size`` a power of two
    up to ``2 ** MAX_PAGE_BITS``."""
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(f"page_table: must be a tensor, got {type(page_table).__name__}")
    _check(page_table.dim() == 2 and page_table.shape[0] >= rows, "page_table",
           f"must be 2-D [>= rows={rows}, pages], got {tuple(page_table.shape)}")
    _check(page_table.dtype == torch.int32, "page_table", f"must be int32, got {page_table.dtype}")
    _check(page_table.shape[1] <= 1 or page_table.stride(1) == 1, "page_table", "must have contiguous rows")
    _check(page_table.device == torch.device(device), "page_table",
           f"must be on {device} (the output's device), got {page_table.device}")
    return page_size_bits(page_size)


def page_size_bits(page_size: object) -> int:
    """log2 of ``page_size``, a host int power of two up to ``2 ** MAX_PAGE_BITS``."""
    size = _host_int("page_size", page_size, 1)
    _check(size & (size - 1) == 0 and size <= 2 ** MAX_PAGE_BITS, "page_size",
           f"must be a power of two up to {2 ** MAX_PAGE_BITS}, got {size}")
    return size.bit_length() - 1


def check_slot_inputs(indices: object, page_table: object, page_size: object) -> int:
    """log2 of ``page_size`` once ``indices`` (int32 ``[rows, k]``) and ``page_table`` can be mapped."""
    checks.tensor("indices", indices)
    _check(indices.dim() == 2 and indices.dtype == torch.int32, "indices",
           f"must be int32 [rows, k], got {indices.dtype} {tuple(indices.shape)}")
    return check_page_table(page_table, page_size, indices.shape[0], indices.device)


def check_unmapped(unmapped: object, device: torch.device) -> torch.Tensor | None:
    """``unmapped`` as None or a one-element int32 counter on ``device``."""
    if unmapped is None:
        return None
    t = checks.int_tensor("unmapped", unmapped, (torch.int32,))
    _check(t.numel() == 1, "unmapped", f"must be a one-element counter, got {tuple(t.shape)}")
    checks.same_device("unmapped", t, device)
    return t


UNMAPPED_MESSAGE = ("slots: a selected position has no slot (its page entry is negative or gives a slot "
                    "past 2**31 - 1, or its page is past the table); it was written as -1")


def assert_mapped(unmapped: torch.Tensor | None) -> None:
    """With ``VLLM_SPARSE_SYNC_DEVICE_CHECKS=1``, a device-side assertion (no host sync) that the
    counter of positions without a slot is still 0."""
    if unmapped is not None and device_checks_enabled():
        torch._assert_async(unmapped.reshape(-1)[0].eq(0), UNMAPPED_MESSAGE)


def page_table_slots(indices: torch.Tensor, page_table: torch.Tensor, page_size: int, *,
                     unmapped: torch.Tensor | None = None) -> torch.Tensor:
    """KV-cache slots of top-k positions ``int32 [rows, k]``: ``page_table[r, p // page_size] *
    page_size + p % page_size`` for each position ``p >= 0`` of row ``r`` whose page is in the
    table and whose slot is an int32 ``>= 0``; ``-1`` elsewhere. Each position ``p >= 0`` written
    as ``-1`` adds one to ``unmapped`` (int32 ``[1]``, optional); with
    ``VLLM_SPARSE_SYNC_DEVICE_CHECKS=1`` a device-side assertion (no host sync) fires once the
    counter (or, without one, this call's count) is not 0."""
    bits = check_slot_inputs(indices, page_table, page_size)
    unmapped = check_unmapped(unmapped, indices.device)
    pos = indices.to(torch.int64)
    page = torch.where(pos >= 0, pos >> bits, 0)
    ok = (pos >= 0) & (page < page_table.shape[1])
    if page_table.shape[1]:
        base = page_table[: indices.shape[0]].to(torch.int64).gather(1, torch.where(ok, page, 0))
    else:
        base = torch.zeros_like(pos)
    ok &= (base >= 0) & (base <= (checks.INT32_MAX >> bits))
    slots = (base << bits) | (pos & ((1 << bits) - 1))
    lost = (pos >= 0) & ~ok
    if unmapped is not None:
        unmapped.add_(lost.sum().to(unmapped.dtype))
        assert_mapped(unmapped)
    elif device_checks_enabled() and lost.numel():
        torch._assert_async(~lost.any(), UNMAPPED_MESSAGE)
    return torch.where(ok, slots, -1).to(torch.int32)


def indexer_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_lens: torch.Tensor,
    k: int,
    *,
    active_width: torch.Tensor | None = None,
    width: int | None = None,
    page_table: torch.Tensor | None = None,
    page_size: int | None = None,
    unmapped: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole decode indexer step: score, then select (``int32 [rows, k]``). With
    ``page_table`` the output holds KV-cache slots (``page_table_slots``; ``page_size``
    defaults to the K cache's; ``unmapped`` counts positions without a slot)."""
    _check_scorer_inputs(q_fp8, weights, k_cache, block_table, row_lens, active_width)
    k = check_k(k)
    page = page_size_of(k_cache, q_fp8.shape[2])
    width = check_width(block_table.shape[1] * page if width is None else width)
    if page_table is not None:
        check_page_table(page_table, page if page_size is None else page_size, q_fp8.shape[0], q_fp8.device)
    logits = paged_indexer_logits(
        q_fp8, weights, k_cache, block_table, row_lens, width, active_width=active_width
    )
    return topk_indices(logits, row_lens, k, active_width=active_width, page_table=page_table,
                        page_size=page if page_size is None else page_size, unmapped=unmapped)
