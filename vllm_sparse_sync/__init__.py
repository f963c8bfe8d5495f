"""vllm-sparse-sync: sync-free sparse-attention indexer metadata, kernels, and a host-sync harness."""

__version__ = "0.1.0"
