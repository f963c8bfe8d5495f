"""Top-k positions as KV-cache slots (the page-table transform sparse attention needs next), on
a CPU host: the reference against a plain loop on random tables of every page size, the
step's ``slots=`` on every decode path, the checks that refuse bad tables, and the CUDA
cluster kernels' parameter list against what the host passes (the kernels run in
``test_cuda_topk_gpu.py``)."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_sparse_sync import IndexerMetadataBuilder, IndexerStep
from vllm_sparse_sync.kernels import page_table_slots
from vllm_sparse_sync.kernels.cuda import topk as cuda_topk
from vllm_sparse_sync.kernels import reference as ref
from vllm_sparse_sync.scenarios import PATHS, make_case, make_step_inputs


def _loop_slots(idx: list[list[int]], table: list[list[int]], size: int) -> list[list[int]]:
    out = []
    for r, row in enumerate(idx):
        res = []
        for p in row:
            page = p // size if p >= 0 else -1
            res.append(table[r][page] * size + p % size if 0 <= page < len(table[r]) else -1)
        out.append(res)
    return out


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), k=st.integers(1, 40), bits=st.integers(0, 7), pages=st.integers(0, 9),
       extra_rows=st.integers(0, 2), seed=st.integers(0, 2**31 - 1))
def test_slots_are_the_page_table_entry_times_the_page_plus_the_offset(rows, k, bits, pages, extra_rows,
                                                                      seed):
    g = torch.Generator().manual_seed(seed)
    size = 1 << bits
    idx = torch.randint(-1, (pages + 2) * size, (rows, k), generator=g, dtype=torch.int32)
    table = torch.randint(0, 1 << 20, (rows + extra_rows, pages), generator=g, dtype=torch.int32)
    got = page_table_slots(idx, table, size)
    assert got.dtype == torch.int32 and got.shape == idx.shape
    assert got.tolist() == _loop_slots(idx.tolist(), table.tolist(), size)


def test_a_position_past_the_table_or_padding_is_minus_one_and_others_keep_their_offset():
    table = torch.tensor([[5, 7], [9, 2]], dtype=torch.int32)
    idx = torch.tensor([[0, 63, 64, -1, 128], [70, 1, -1, -1, -1]], dtype=torch.int32)
    assert page_table_slots(idx, table, 64).tolist() == [[320, 383, 448, -1, -1], [134, 577, -1, -1, -1]]
    assert page_table_slots(idx, table[:, :0], 64).eq(-1).all()


@pytest.mark.parametrize("table, size, match", [
    (torch.zeros(2, 4, dtype=torch.int64), 64, "int32"),
    (torch.zeros(8, dtype=torch.int32), 64, "2-D"),
    (torch.zeros(1, 4, dtype=torch.int32), 64, "rows=2"),
    (torch.zeros(2, 4, dtype=torch.int32)[:, ::2], 64, "contiguous rows"),
    (torch.zeros(2, 4, dtype=torch.int32), 48, "power of two"),
    (torch.zeros(2, 4, dtype=torch.int32), 2 ** 21, "power of two"),
    ("table", 64, "must be a tensor"),
])
def test_bad_page_tables_are_refused_naming_the_field(table, size, match):
    with pytest.raises((ValueError, TypeError), match=match):
        page_table_slots(torch.zeros(2, 3, dtype=torch.int32), table, size)


def test_a_page_size_that_is_not_an_int_is_a_type_error():
    with pytest.raises(TypeError, match="page_size"):
        page_table_slots(torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 64.0)


def test_topk_indices_with_a_table_are_the_slots_of_its_positions():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 500, generator=g)
    lens = torch.tensor([500, 7, 300], dtype=torch.int32)
    table = torch.randperm(64, generator=g)[:24].reshape(3, 8).to(torch.int32)
    pos = ref.topk_indices(x, lens, 20)
    assert torch.equal(ref.topk_indices(x, lens, 20, page_table=table, page_size=64),
                       page_table_slots(pos, table, 64))
    with pytest.raises(ValueError, match="page_size"):
        ref.topk_indices(x, lens, 20, page_table=table, page_size=3)


def _step_on(path, seed):
    gen = torch.Generator().manual_seed(seed)
    case = make_case(path, "cpu", gen)
    lay = path.layout
    builder = IndexerMetadataBuilder(lay, max_num_reqs=8, max_num_tokens=16,
                                     max_pages_per_req=case.batch.block_table.shape[1], device="cpu")
    meta = builder.build(case.batch)
    inputs = make_step_inputs(path, case, "cpu", gen)
    step = IndexerStep.for_builder(builder)
    return step, meta, (inputs.q_fp8, inputs.weights, inputs.k_cache)


@pytest.mark.parametrize("path", [p for p in PATHS if p.layout.dcp_world_size == 1], ids=lambda p: p.name)
def test_the_step_writes_slots_through_its_block_table_or_the_one_given(path):
    step, meta, args = _step_on(path, seed=3)
    pos = step.run(meta, *args)
    size = path.layout.page_size
    assert torch.equal(step.run(meta, *args, slots=True), page_table_slots(pos, meta.block_table, size))
    assert (pos >= 0).any()
    other = (meta.block_table.flip(1) + 1000).contiguous()  # the attention's own table
    out = torch.empty_like(pos)
    got = step.run(meta, *args, slots=other, out=out)
    assert got is out and torch.equal(out, page_table_slots(pos, other, size))


def test_the_step_refuses_slots_on_a_dcp_rank_and_a_table_of_the_wrong_kind():
    dcp = next(p for p in PATHS if p.layout.dcp_world_size > 1)
    step, meta, args = _step_on(dcp, seed=4)
    with pytest.raises(ValueError, match="global merge"):
        step.run(meta, *args, slots=True)
    plain = next(p for p in PATHS if p.layout.dcp_world_size == 1)
    step, meta, args = _step_on(plain, seed=4)
    with pytest.raises(TypeError, match="slots"):
        step.run(meta, *args, slots="yes")
    with pytest.raises(ValueError, match="int32"):
        step.run(meta, *args, slots=meta.block_table.to(torch.int64))


def _kernel_params(slots: bool = False) -> list[str]:
    """The cluster kernels' parameter declarations, from the source's kernel macro (``slots``:
    the slots entries')."""
    src = cuda_topk.source()
    name = "_slots" if slots else "SUF"
    m = re.search(r"topk_cluster_c##C##_t##T##_a##A##" + name + r"\((.*?)\)\s*\{", src, re.S)
    assert m, "the cluster kernel macro moved"
    return [p.replace("\\", " ").strip() for p in m.group(1).split(",")]


def _ctype_of(decl: str):
    if "*" in decl:
        return ctypes.c_void_p
    return ctypes.c_longlong if decl.split()[0] == "i64" else ctypes.c_int


@pytest.mark.parametrize("with_table", [False, True])
def test_the_host_passes_every_cluster_kernel_parameter_in_order(with_table, monkeypatch):
    seen = {}
    monkeypatch.setattr(cuda_topk, "launch_values", lambda *a, **kw: seen.setdefault("values", a[5]))
    x = torch.zeros(2, 64)
    lens = torch.zeros(2, dtype=torch.int32)
    out = torch.zeros(2, 8, dtype=torch.int32)
    table = torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)
    unmapped = torch.zeros(1, dtype=torch.int32)
    tail = cuda_topk.cluster_tail(64, False, table if with_table else None, 5, unmapped if with_table else None)
    cuda_topk._launch(None, None, (1, 2, 1), 512, 0, x, 64, lens, None, out, 8, 64, True, tail)
    values = seen["values"]
    params = _kernel_params(slots=with_table)
    assert [type(v) for v in values] == [_ctype_of(p) for p in params], params
    named = dict(zip([p.split()[-1] for p in params], values))
    if with_table:
        assert named["page_table"].value == table.data_ptr()
        assert (named["page_stride"].value, named["page_bits"].value, named["pages"].value) == (2, 5, 2)
        assert named["unmapped"].value == unmapped.data_ptr()
    else:
        assert named["page_table"].value is None and named["pages"].value == 0


@pytest.mark.parametrize("table, bits, match", [
    (torch.zeros(2, 4, dtype=torch.int64), 6, "page_table: must be int32"),
    (torch.zeros(1, 4, dtype=torch.int32), 6, "rows=2"),
    (torch.zeros(2, 4, dtype=torch.int32), 21, "page_bits"),
    (torch.zeros(2, 4, dtype=torch.int32), -1, "page_bits"),
])
def test_the_cluster_launch_refuses_a_bad_table_before_anything_compiles(table, bits, match, monkeypatch):
    monkeypatch.setattr(cuda_topk, "module_for", lambda *a, **k: pytest.fail("reached the module"))
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match=match):
        cuda_topk.launch_cuda_topk_cluster(x, 64, torch.zeros(2, dtype=torch.int32), None,
                                           torch.zeros(2, 8, dtype=torch.int32), 8, 64, page_table=table,
                                           page_bits=bits)
