import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import kernel_row_len, local_count, rows_of_batch

from vllm_sparse_sync import (
    BoundSource,
    IndexerBackend,
    IndexerLayout,
    SeqLenShadow,
    decode_topk_bound,
)
from vllm_sparse_sync.bounds import SOURCE_RULES, capture_stable_bound

MAX_MODEL_LEN = 8192


@st.composite
def layouts(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    return IndexerLayout(
        backend=draw(st.sampled_from(list(IndexerBackend))),
        compress_ratio=draw(st.sampled_from([1, 4])),
        dcp_world_size=world,
        dcp_rank=draw(st.integers(0, world - 1)),
        cp_interleave=draw(st.sampled_from([1, 64])),
        max_model_len=MAX_MODEL_LEN,
    )


@st.composite
def decode_batches(draw):
    """(query_lens, device seq_lens, shadow seq_lens, authoritative, max_seq_len)."""
    n = draw(st.integers(1, 6))
    query_lens = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    if draw(st.booleans()):  # a padded request with no tokens this step
        query_lens[draw(st.integers(0, n - 1))] = 0
    true = [draw(st.integers(q, MAX_MODEL_LEN - 4)) for q in query_lens]
    authoritative = draw(st.booleans())
    if authoritative:
        shadow = list(true)
    else:  # optimistic shadow: drafts assumed accepted, so >= the device lengths
        shadow = [t + draw(st.integers(0, 3)) for t in true]
    max_seq_len = min(MAX_MODEL_LEN, max(shadow) + draw(st.integers(0, 64)))
    return query_lens, true, shadow, authoritative, max_seq_len


def _qsl(query_lens):
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return torch.tensor(starts, dtype=torch.int32)


def _true_max(layout, query_lens, true):
    rows = rows_of_batch(true, query_lens, layout.compress_ratio, layout.dcp_world_size,
                         layout.dcp_rank, layout.cp_interleave)
    return max(rows, default=0)


ALL_LAYOUTS = [
    IndexerLayout(backend=backend, compress_ratio=ratio, dcp_world_size=world, dcp_rank=rank,
                  cp_interleave=interleave, max_model_len=MAX_MODEL_LEN)
    for backend in IndexerBackend for ratio in (1, 4) for world in (1, 2, 4) for rank in range(world)
    for interleave in (1, 64)
]


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda lay: (
    f"{lay.backend.value}-r{lay.compress_ratio}-w{lay.dcp_world_size}-k{lay.dcp_rank}-i{lay.cp_interleave}"))
@settings(max_examples=25)
@given(batch=decode_batches(), with_local=st.booleans())
def test_bound_never_below_true_max_and_exact_sources_equal_it(layout, batch, with_local):
    query_lens, true, shadow_lens, authoritative, max_seq_len = batch
    local = None
    if with_local:
        local = torch.tensor([local_count(s, layout.dcp_world_size, layout.dcp_rank, layout.cp_interleave)
                              for s in shadow_lens], dtype=torch.int32)
    shadow = SeqLenShadow(torch.tensor(shadow_lens, dtype=torch.int32), authoritative, local)
    bound = decode_topk_bound(layout, max_seq_len=max_seq_len, query_start_loc_cpu=_qsl(query_lens),
                              shadow=shadow)
    true_max = _true_max(layout, query_lens, true)
    assert bound.value >= true_max
    if bound.source.is_exact:
        assert bound.value == true_max
    ratio, w, r, i = layout.compress_ratio, layout.dcp_world_size, layout.dcp_rank, layout.cp_interleave
    ceil_rows = local_count(-(-max_seq_len // ratio), w, r, i)
    if layout.backend is IndexerBackend.B12X and ratio > 1:
        assert bound.source is BoundSource.ACTIVE_WIDTH and bound.value == ceil_rows
    if layout.backend is IndexerBackend.DEEPGEMM and ratio > 1:
        assert bound.source is BoundSource.METADATA_UPPER_BOUND and bound.value <= ceil_rows
    if ratio == 1 and authoritative:
        want = BoundSource.CPU_DCP_LOCAL if w > 1 else BoundSource.CPU_EXACT
        assert bound.source is want
    if ratio == 1 and not authoritative:
        assert bound.source in (BoundSource.ACTIVE_WIDTH, BoundSource.METADATA_UPPER_BOUND)


@given(layout=layouts(), a=decode_batches(), b=decode_batches())
def test_capture_value_depends_on_the_layout_alone(layout, a, b):
    values = set()
    for query_lens, _, shadow_lens, auth, max_seq_len in (a, b):
        shadow = SeqLenShadow(torch.tensor(shadow_lens, dtype=torch.int32), auth)
        bound = decode_topk_bound(layout, max_seq_len=max_seq_len, query_start_loc_cpu=_qsl(query_lens),
                                  shadow=shadow, capturing=True)
        assert bound.source is BoundSource.CAPTURE_STABLE
        values.add(bound.value)
    assert values == {capture_stable_bound(layout)}
    assert capture_stable_bound(layout) >= kernel_row_len(
        MAX_MODEL_LEN, layout.compress_ratio, layout.dcp_world_size, layout.dcp_rank, layout.cp_interleave)


def test_rule_table_covers_every_case():
    assert len(SOURCE_RULES) == len(IndexerBackend) * 2 * 2
    assert BoundSource.LEGACY_DEVICE_SYNC not in SOURCE_RULES.values()


def test_missing_shadow_falls_back_to_a_host_bound():
    for backend, want in ((IndexerBackend.B12X, BoundSource.ACTIVE_WIDTH),
                          (IndexerBackend.DEEPGEMM, BoundSource.METADATA_UPPER_BOUND)):
        lay = IndexerLayout(backend=backend, max_model_len=4096)
        bound = decode_topk_bound(lay, max_seq_len=1000, query_start_loc_cpu=_qsl([1, 1]))
        assert bound.source is want and bound.value == 1000


def test_padded_requests_are_ignored_by_the_exact_max():
    lay = IndexerLayout(backend="b12x", max_model_len=4096)
    shadow = SeqLenShadow(torch.tensor([100, 900], dtype=torch.int32))
    bound = decode_topk_bound(lay, max_seq_len=900, query_start_loc_cpu=_qsl([1, 0]), shadow=shadow)
    assert bound == bound.__class__(100, BoundSource.CPU_EXACT)


LAY = IndexerLayout(backend="b12x", max_model_len=4096, dcp_world_size=2, dcp_rank=0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32, device="meta")),
         "query_start_loc_cpu"),
        (dict(shadow=SeqLenShadow(torch.tensor([5], dtype=torch.int32, device="meta"))),
         "shadow.seq_lens_cpu"),
        (dict(shadow=SeqLenShadow(torch.tensor([-3], dtype=torch.int32))), r"shadow.seq_lens_cpu\[0\]"),
        (dict(shadow=SeqLenShadow(torch.tensor([600], dtype=torch.int32))), r"exceeds max_seq_len"),
        (dict(shadow=SeqLenShadow(torch.tensor([50], dtype=torch.int32),
                                  dcp_local_seq_lens_cpu=torch.tensor([7], dtype=torch.int32))),
         "dcp_local_seq_lens_cpu"),
        (dict(max_seq_len=-1), "max_seq_len"),
        (dict(max_seq_len=5000), "max_seq_len"),
        (dict(query_start_loc_cpu=torch.tensor([1, 2], dtype=torch.int32)), "query_start_loc_cpu"),
        (dict(query_start_loc_cpu=torch.tensor([0, 3, 2], dtype=torch.int32)), "query_start_loc_cpu"),
        (dict(query_start_loc_cpu=[0, 1]), "query_start_loc_cpu"),
    ],
)
def test_bad_input_is_refused_naming_the_field(kwargs, field):
    args = dict(max_seq_len=500, query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32)) | kwargs
    with pytest.raises((ValueError, TypeError), match=field):
        decode_topk_bound(LAY, **args)


def test_non_authoritative_shadow_may_exceed_max_seq_len_without_error():
    lay = IndexerLayout(backend="deepgemm", max_model_len=4096)
    shadow = SeqLenShadow(torch.tensor([700], dtype=torch.int32), authoritative=False)
    bound = decode_topk_bound(lay, max_seq_len=600, query_start_loc_cpu=_qsl([1]), shadow=shadow)
    assert bound.source is BoundSource.METADATA_UPPER_BOUND
