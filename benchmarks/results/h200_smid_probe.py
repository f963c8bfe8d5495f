"""Which SM each CTA of a (1, S) grid lands on, at a given occupancy (threads, smem)."""
import ctypes, json, os, sys
import torch
sys.path.insert(0, os.getcwd())
from vllm_sparse_sync.kernels import cuda_scorer, cuda_topk
SRC = r'''
extern "C" __global__ void probe(int* out, long long spin_ns, int live) {
    extern __shared__ char sm[];
    if (threadIdx.x == 0) {
        unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
        out[blockIdx.y] = (int)s;
        if ((int)blockIdx.y < live) {
            unsigned long long t0, t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)spin_ns);
        }
    }
    __syncthreads();
}
'''
mod = cuda_scorer.module_for(0)
d = mod.driver
cubin, _ = cuda_topk.compile_source("sm_90a", text=SRC, name="probe.cu")
m = cuda_topk._check(d.cuModuleLoadData(cubin), "load")
fn = cuda_topk._check(d.cuModuleGetFunction(m, b"probe"), "fn")
attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
cuda_topk._check(d.cuFuncSetAttribute(fn, attr, 200 * 1024), "attr")
res = {}
for per_sm, smem in ((1, 120 * 1024), (2, 100 * 1024), (3, 70 * 1024), (4, 52 * 1024)):
    S = 132 * per_sm
    for live in (S, 64, 128):
        out = torch.full((S,), -1, dtype=torch.int32, device="cuda")
        vals = (ctypes.c_void_p(out.data_ptr()), ctypes.c_longlong(20000), ctypes.c_int(live))
        cuda_topk.launch_values(mod, fn, (1, S, 1), 288, smem, vals, out.device)
        torch.cuda.synchronize()
        sm = out.tolist()
        first = {n: len(set(sm[:n])) for n in (32, 64, 128, 132)}
        even = [sm[y] for y in range(0, S, per_sm)]
        spread = {n: len(set(even[:n])) for n in (64, 128, 132)}
        key = f"per_sm{per_sm}_live{live}"
        res[key] = dict(first_blocks_distinct_sms=first, every_kth_block_distinct_sms=spread, smid=sm)
        print(key, "distinct SMs of the first n blocks:", first, "| of every", per_sm, "th:", spread, "| first 16:", sm[:16], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "smid.json"), "w"))
