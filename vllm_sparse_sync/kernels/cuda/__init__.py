"""The NVRTC-compiled CUDA routes: the wgmma scorer, the one-CTA and cluster top-k, the DCP merge."""
