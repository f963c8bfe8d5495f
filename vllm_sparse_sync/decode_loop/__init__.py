"""A synthetic but honest decode loop: the project's builder and kernels inside a serving
runner's step (async scheduling, CUDA graphs), under variants that differ only in how the
indexer's host bound is found. ``benchmarks/decode_loop.py`` runs it."""

from .model import ModelShape, SyntheticModel, ffn_width
from .runner import VARIANT_NAMES, VARIANTS, DecodeLoop, RunStats, Variant, spin, variant_named

__all__ = [
    "VARIANTS",
    "VARIANT_NAMES",
    "DecodeLoop",
    "ModelShape",
    "RunStats",
    "SyntheticModel",
    "Variant",
    "ffn_width",
    "spin",
    "variant_named",
]
