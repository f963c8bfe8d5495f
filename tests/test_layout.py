import dataclasses

import pytest

from vllm_sparse_sync import IndexerBackend, IndexerLayout


def test_defaults_and_backend_coercion():
    lay = IndexerLayout(backend="b12x", max_model_len=4096)
    assert lay.backend is IndexerBackend.B12X
    assert (lay.compress_ratio, lay.dcp_world_size, lay.dcp_rank, lay.cp_interleave) == (1, 1, 0, 1)
    assert (lay.page_size, lay.topk, lay.num_heads, lay.head_dim) == (64, 2048, 64, 128)
    assert not lay.is_compressed and not lay.uses_dcp


def test_frozen():
    lay = IndexerLayout(backend=IndexerBackend.DEEPGEMM, max_model_len=4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.topk = 512  # type: ignore[misc]


def test_max_model_len_is_required():
    with pytest.raises(TypeError, match="max_model_len"):
        IndexerLayout(backend=IndexerBackend.B12X)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(compress_ratio=0), "compress_ratio"),
        (dict(dcp_world_size=0), "dcp_world_size"),
        (dict(dcp_world_size=2, dcp_rank=2), "dcp_rank"),
        (dict(dcp_rank=-1), "dcp_rank"),
        (dict(cp_interleave=0), "cp_interleave"),
        (dict(page_size=0), "page_size"),
        (dict(topk=-5), "topk"),
        (dict(num_heads=0), "num_heads"),
        (dict(head_dim=0), "head_dim"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(compress_ratio=3, page_size=64), "page_size"),
        (dict(backend="flashmla"), "backend"),
    ],
)
def test_invalid_combinations_name_the_field(kwargs, field):
    args = dict(backend=IndexerBackend.B12X, max_model_len=4096) | kwargs
    with pytest.raises(ValueError, match=field):
        IndexerLayout(**args)


def test_non_int_sizes_are_type_errors():
    with pytest.raises(TypeError, match="page_size"):
        IndexerLayout(backend="b12x", max_model_len=4096, page_size=64.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dcp_rank"):
        IndexerLayout(backend="b12x", max_model_len=4096, dcp_rank=True)  # type: ignore[arg-type]


def test_ratio_dividing_page_is_accepted():
    lay = IndexerLayout(backend="deepgemm", compress_ratio=4, page_size=64, max_model_len=8192)
    assert lay.is_compressed
