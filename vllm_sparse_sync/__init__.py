"""vllm-sparse-sync: sync-free sparse-attention indexer metadata, kernels, and a host-sync harness."""

from .bounds import BoundSource, DecodeTopkBound, SeqLenShadow, decode_topk_bound
from .distributed import DcpIndexerStep, DcpTopk, rank_layout
from .layout import IndexerBackend, IndexerLayout
from .metadata import DecodeBatch, IndexerDecodeMetadata, IndexerMetadataBuilder
from .step import IndexerStep, StepHealth

__version__ = "0.1.0"

__all__ = [
    "BoundSource",
    "DcpIndexerStep",
    "DcpTopk",
    "DecodeBatch",
    "DecodeTopkBound",
    "IndexerBackend",
    "IndexerDecodeMetadata",
    "IndexerLayout",
    "IndexerMetadataBuilder",
    "IndexerStep",
    "SeqLenShadow",
    "StepHealth",
    "decode_topk_bound",
    "rank_layout",
]
