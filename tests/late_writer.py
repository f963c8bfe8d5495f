"""A previous kernel that writes late: it lets the stream's next (dependent) launch start at once,
then copies 4-byte words ``wait_ns`` later. The GPU tests use it to prove that a dependent launch
waits for its predecessor before it reads what that predecessor writes."""

from __future__ import annotations

import ctypes

_LATE_COPY = r"""
extern "C" __global__ void late_copy(unsigned int* dst, const unsigned int* src, int n,
                                     unsigned long long wait_ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < wait_ns);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"""


def late_copier(device):
    """``copy(dst, src, wait_ns)``: launches ``_LATE_COPY`` (one CTA) on the current stream; it
    copies ``src`` into ``dst`` (same shape, contiguous, 4-byte elements) ``wait_ns`` after its
    start."""
    from vllm_sparse_sync.kernels.cuda import topk as cuda_topk

    mod = cuda_topk.module_for(device)
    cubin, _ = cuda_topk.compile_source(mod.arch, text=_LATE_COPY, name="late_copy.cu")
    module = cuda_topk._check(mod.driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    fn = cuda_topk._check(mod.driver.cuModuleGetFunction(module, b"late_copy"), "cuModuleGetFunction")

    def copy(dst, src, wait_ns):
        if dst.shape != src.shape or dst.element_size() != 4 or src.element_size() != 4:
            raise ValueError(f"late_copy copies 4-byte words between equal shapes: {dst.shape} {src.shape}")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("late_copy needs contiguous tensors")
        values = (ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(src.data_ptr()), ctypes.c_int(dst.numel()),
                  ctypes.c_ulonglong(wait_ns))
        cuda_topk.launch_values(mod, fn, (1, 1, 1), 128, 0, values, dst.device)

    return copy
