"""The Triton routes: the paged scorer, the radix and sampled top-k, the fused small-batch step."""
