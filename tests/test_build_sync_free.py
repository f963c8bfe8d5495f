"""Property-based proof that the builder never reads device data on the host.

Every bound path (backend x ratio x shadow kind x DCP) is a parameter, so no path is left to
chance; within each, hypothesis draws the DCP world, rank and interleave, capacities and two
random batches. `build()` and `build_for_capture()` run under the sentinel watching every
device-standing input and every builder buffer (`device_tensors`): a host read of device data
on any path fails here, and the results match an independent computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import rows_of_batch

from vllm_sparse_sync import (
    BoundSource,
    DecodeBatch,
    IndexerBackend,
    IndexerLayout,
    IndexerMetadataBuilder,
    SeqLenShadow,
)
from vllm_sparse_sync.bounds import SOURCE_RULES, capture_stable_bound
from vllm_sparse_sync.lengths import compress_ceil, dcp_localize
from vllm_sparse_sync.testing import HostSyncError, device_tensors, no_host_sync

SHADOWS = ("authoritative", "optimistic", "missing", "dcp_local")
PATHS = [(b, r, s, d) for b in IndexerBackend for r in (1, 2, 4) for s in SHADOWS for d in (False, True)]
MAX_REQS, MAX_TOKENS = 64, 256
PER_PATH = settings(max_examples=max(4, settings().max_examples // 12), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Drawn:
    batch: DecodeBatch
    true_lens: list[int]
    query_lens: list[int]


def _layout(draw, backend, ratio, dcp) -> IndexerLayout:
    world = draw(st.integers(2, 8)) if dcp else 1
    return IndexerLayout(
        backend=backend, compress_ratio=ratio, dcp_world_size=world,
        dcp_rank=draw(st.integers(0, world - 1)),
        cp_interleave=draw(st.one_of(st.just(1), st.sampled_from([2, 4, 8, 16, 32, 64]))),
        max_model_len=draw(st.sampled_from([64, 1000, 8192])), page_size=64,
    )


def _pages_for(layout: IndexerLayout, max_seq_len: int) -> int:
    rows = dcp_localize(compress_ceil(max_seq_len, layout.compress_ratio), layout.dcp_world_size,
                        layout.dcp_rank, layout.cp_interleave)
    return max(1, math.ceil(rows / layout.page_size))


def _batch(draw, layout: IndexerLayout, shadow_kind: str, max_reqs: int, max_tokens: int,
           max_pages: int) -> Drawn:
    n = draw(st.one_of(st.just(0), st.integers(1, 4), st.integers(min(5, max_reqs), max_reqs)))
    query_lens = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    while sum(query_lens) > max_tokens:
        query_lens[query_lens.index(max(query_lens))] -= 1
    max_seq_len = draw(st.integers(max(query_lens, default=0), layout.max_model_len))
    true_lens = [draw(st.integers(q, max_seq_len)) for q in query_lens]
    if shadow_kind == "optimistic":  # async spec decode: the shadow counts every draft accepted
        shadow_lens = [min(t + draw(st.integers(0, 3)), max_seq_len) for t in true_lens]
    else:
        shadow_lens = list(true_lens)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    pages = draw(st.integers(_pages_for(layout, max_seq_len), max_pages))
    seed = draw(st.integers(0, 2**31 - 1))
    bt = torch.randint(-1, 1 << 20, (n, pages), dtype=torch.int32,
                       generator=torch.Generator().manual_seed(seed))
    if shadow_kind == "missing":
        shadow = None
    else:
        local = None
        if shadow_kind == "dcp_local":
            local = torch.tensor([dcp_localize(s, layout.dcp_world_size, layout.dcp_rank,
                                               layout.cp_interleave) for s in shadow_lens],
                                 dtype=torch.int32)
        shadow = SeqLenShadow(torch.tensor(shadow_lens, dtype=torch.int32),
                              authoritative=shadow_kind != "optimistic", dcp_local_seq_lens_cpu=local)
    qsl_cpu = torch.tensor(starts, dtype=torch.int32)
    batch = DecodeBatch(query_start_loc=qsl_cpu.clone(), query_start_loc_cpu=qsl_cpu,
                        seq_lens=torch.tensor(true_lens, dtype=torch.int32), shadow=shadow,
                        block_table=bt, max_seq_len=max_seq_len)
    return Drawn(batch, true_lens, query_lens)


@st.composite
def cases(draw, backend, ratio, shadow_kind, dcp):
    layout = _layout(draw, backend, ratio, dcp)
    max_reqs = draw(st.integers(4, MAX_REQS))
    max_tokens = draw(st.integers(max_reqs, MAX_TOKENS))
    max_pages = _pages_for(layout, layout.max_model_len) + draw(st.integers(0, 2))
    batches = [_batch(draw, layout, shadow_kind, max_reqs, max_tokens, max_pages) for _ in range(2)]
    return layout, (max_reqs, max_tokens, max_pages), batches


def _check(meta, layout: IndexerLayout, drawn: Drawn, shadow_kind: str, legacy: bool = False) -> None:
    want = rows_of_batch(drawn.true_lens, drawn.query_lens, layout.compress_ratio,
                         layout.dcp_world_size, layout.dcp_rank, layout.cp_interleave)
    assert meta.num_rows == len(want)
    assert meta.row_lens.tolist() == want
    token_req = [i for i, q in enumerate(drawn.query_lens) for _ in range(q)]
    pages = drawn.batch.block_table.shape[1]
    assert torch.equal(meta.block_table[:, :pages], drawn.batch.block_table[token_req])
    assert bool(meta.block_table[:, pages:].eq(-1).all())
    assert meta.bound.value >= max(want, default=0)
    exact_usable = shadow_kind in ("authoritative", "dcp_local")
    source = SOURCE_RULES[(layout.backend, layout.is_compressed, exact_usable)]
    if source is BoundSource.CPU_EXACT and layout.uses_dcp:
        source = BoundSource.CPU_DCP_LOCAL
    if legacy:
        source = BoundSource.LEGACY_DEVICE_SYNC
    assert meta.bound.source is source
    if source.is_exact:
        live = [w for w, q in zip(want, [q for q in drawn.query_lens for _ in range(q)])]
        assert meta.bound.value == max(live, default=0)
    assert int(meta.active_width[0]) == meta.bound.value


def _prove(builder, layout, batches, shadow_kind) -> None:
    a, b = batches
    watch = device_tensors(builder, a.batch, b.batch)
    with no_host_sync(watch=watch, layers="sentinel", where="build()") as check:
        meta = builder.build(a.batch)
    assert check.touched > 0, "the sentinel saw no watched tensor in use: a vacuous check"
    _check(meta, layout, a, shadow_kind, builder.legacy_device_sync)
    n_reqs = len(b.query_lens)
    with no_host_sync(watch=watch, layers="sentinel", where="build_for_capture(), build()"):
        cap = builder.build_for_capture(n_reqs, max(n_reqs, sum(b.query_lens)))
        meta = builder.build(b.batch)  # reads buffers the capture build and build(a) wrote
    assert cap.bound.source is BoundSource.CAPTURE_STABLE
    assert cap.bound.value == capture_stable_bound(layout)
    _check(meta, layout, b, shadow_kind, builder.legacy_device_sync)


def _builder(cls, layout, caps, **kw):
    max_reqs, max_tokens, max_pages = caps
    return cls(layout, max_num_reqs=max_reqs, max_num_tokens=max_tokens, max_pages_per_req=max_pages,
               device="cpu", **kw)


@pytest.mark.parametrize("backend, ratio, shadow_kind, dcp", PATHS,
                         ids=[f"{b.value}-r{r}-{s}-{'dcp' if d else 'nodcp'}" for b, r, s, d in PATHS])
def test_build_never_reads_device_data_on_any_path(backend, ratio, shadow_kind, dcp):
    @PER_PATH
    @given(case=cases(backend, ratio, shadow_kind, dcp))
    def prove(case):
        layout, caps, batches = case
        _prove(_builder(IndexerMetadataBuilder, layout, caps), layout, batches, shadow_kind)

    prove()


# -- the proof is not vacuous: host reads planted behind path conditions are caught ----------
class _Planted(IndexerMetadataBuilder):
    condition = staticmethod(lambda self, batch: False)

    def build(self, batch):
        if self.condition(self, batch):
            batch.seq_lens.tolist()  # planted host read
        return super().build(batch)


# condition on (self, batch); the paths (backend, ratio, shadow kind, dcp) on which every
# batch meets it, where that is known from the path alone
PLANTS = {
    "shadow missing": (lambda self, batch: batch.shadow is None,
                       lambda b, r, s, d: s == "missing"),
    "above 4 requests": (lambda self, batch: batch.seq_lens.shape[0] > 4, None),
    "cp_interleave > 1": (lambda self, batch: self.layout.cp_interleave > 1, None),
    "deepgemm, compressed, DCP": (
        lambda self, batch: (self.layout.backend is IndexerBackend.DEEPGEMM
                             and self.layout.is_compressed and self.layout.uses_dcp),
        lambda b, r, s, d: b is IndexerBackend.DEEPGEMM and r > 1 and d),
}


def _has_rows(case) -> bool:
    """Whether a case's builds have rows to read (a batch of no query tokens builds none)."""
    return any(sum(drawn.query_lens) > 0 for drawn in case[2])


def _prove_path(path, make_builder, examples: int, *, with_rows: bool = False) -> None:
    """Run the proof over `examples` random cases of one path (no shrinking); `with_rows`: only
    cases where some build has rows."""
    strategy = cases(*path).filter(_has_rows) if with_rows else cases(*path)

    @settings(PER_PATH, phases=["generate"], max_examples=examples)
    @given(case=strategy)
    def prove(case):
        layout, caps, batches = case
        _prove(make_builder(layout, caps), layout, batches, path[2])

    prove()


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_read_planted_behind_a_path_condition_is_caught(plant):
    condition, always_on = PLANTS[plant]
    planted = type("Planted", (_Planted,), {"condition": staticmethod(condition)})
    caught = []
    for path in PATHS:
        try:
            _prove_path(path, lambda layout, caps: _builder(planted, layout, caps), examples=4)
        except HostSyncError as exc:
            assert "planted host read" in str(exc)
            caught.append(path)
    assert caught, f"a read planted behind '{plant}' went unseen on every path"
    if always_on is not None:
        assert caught == [p for p in PATHS if always_on(*p)]


def test_the_legacy_device_read_is_caught_on_every_path():
    def legacy(layout, caps):
        return _builder(IndexerMetadataBuilder, layout, caps, legacy_device_sync=True)

    for path in PATHS[::5]:  # the legacy read needs rows: a build of none reads nothing, rightly
        with pytest.raises(HostSyncError, match=r"int\(seq_lens.max\(\).item\(\)\)"):
            _prove_path(path, legacy, examples=4, with_rows=True)
