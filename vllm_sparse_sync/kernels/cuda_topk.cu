// CUDA top-k over per-row live prefixes of fp32 scores: one CTA per row, exact radix select.
//
// Compiled at run time by NVRTC (kernels/cuda_topk.py); the pure-torch emulation of the same
// algorithm is kernels/cuda_topk_emu.py and is the specification of this file:
//
//   key      u = bits ^ 0x80000000 for a positive float, ~bits for a negative one (unsigned order
//            = float order); nan_low != 0 maps every NaN to 0 (below every number).
//   pass A   2048-bin histogram of u >> 21 over the row's live prefix (n = the row's live length,
//            read on the device); the bin b holding the k-th largest; need = k - count above b.
//   refine   only while the bin's count != need (otherwise the whole bin is selected: early exit):
//            2048 bins of bits 20..10 over keys with u >> 21 == b, then 1024 bins of bits 9..0
//            over keys with u >> 10 == the 22-bit prefix. Keys come from registers (rows of at
//            most one tile), from a shared-memory list of the bin's keys (bin count <= cap), or
//            from the row again (global; exact whatever the data).
//   collect  with the resolved prefix P of r bits (r = 11, 22 or 32): positions whose top r bits
//            exceed P, in position order, then positions whose top r bits equal P, lowest
//            positions first, the first `need` of them. Order-preserving block scans per tile;
//            stops once both groups are complete.
//   short    a row of n <= k live scores writes 0..n-1 then -1.
//
// No global scratch, no atomics outside shared memory, nothing to reset: every launch is
// independent, so it replays in a CUDA graph. Host-only parameters are pointers, strides, the
// host width bound sel_width (a clamp), k and flags; the work per row follows n, not sel_width.

typedef unsigned int u32;
typedef long long i64;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ u32 order_key(float x, int nan_low) {
    u32 b = __float_as_uint(x);
    u32 u = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    if (nan_low && (b & 0x7fffffffu) > 0x7f800000u) u = 0u;  // NaN (bit test: no float compare)
    return u;
}

__device__ __forceinline__ int live_length(const void* lens, int lens64, const void* active,
                                           int active64, int row, int sel_width) {
    i64 n = lens64 ? ((const i64*)lens)[row] : (i64)((const int*)lens)[row];
    n = n < 0 ? 0 : n;
    n = n > (i64)sel_width ? (i64)sel_width : n;
    if (active != nullptr) {
        i64 a = active64 ? ((const i64*)active)[0] : (i64)((const int*)active)[0];
        a = a < 0 ? 0 : a;
        n = n > a ? a : n;
    }
    return (int)n;
}

// Keys of one tile slice of a warp: element (j, c) of lane `lane` is position
// base + j * 128 + lane * 4 + c; a position at or past n gets key 0 (callers test pos < n).
template <int VEC, bool ALIGNED>
__device__ __forceinline__ void load_keys(const float* __restrict__ x, int n, int base, int lane,
                                          int nan_low, u32 (&key)[VEC * 4]) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const int p = base + j * 128 + lane * 4;
        if (ALIGNED && p + 4 <= n) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(x + p));
            key[j * 4 + 0] = order_key(v.x, nan_low);
            key[j * 4 + 1] = order_key(v.y, nan_low);
            key[j * 4 + 2] = order_key(v.z, nan_low);
            key[j * 4 + 3] = order_key(v.w, nan_low);
        } else {
#pragma unroll
            for (int c = 0; c < 4; ++c)
                key[j * 4 + c] = (p + c < n) ? order_key(__ldg(x + p + c), nan_low) : 0u;
        }
    }
}

__device__ __forceinline__ u32 warp_incl_scan(u32 v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

// Exclusive prefix of per-warp totals over warps (every lane of a warp passes its warp's
// total); returns the warp's offset and sets `total` to the block's sum. Two barriers; must be
// reached by every thread of the block. s_warp holds WARPS + 1 ints.
template <int WARPS>
__device__ __forceinline__ u32 warps_excl_scan(u32 warp_total, u32* s_warp, u32& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncwarp();  // every lane of this warp has read s_warp from the previous call
    if (lane == 0) s_warp[warp] = warp_total;
    __syncthreads();
    if (warp == 0) {
        const u32 t = lane < WARPS ? s_warp[lane] : 0u;
        const u32 s = warp_incl_scan(t, lane);
        if (lane < WARPS) s_warp[lane] = s - t;
        if (lane == 31) s_warp[WARPS] = s;
    }
    __syncthreads();
    total = s_warp[WARPS];
    return s_warp[warp];
}

// The bin of an nbins histogram (counted from the top bin down) holding the need-th largest key:
// s_res = {bin, need left inside the bin, the bin's count}. Requires total >= need >= 1 and
// nbins a multiple of THREADS. Ends with a barrier after s_res is written.
template <int THREADS>
__device__ __forceinline__ void find_bin(const u32* hist, int nbins, u32 need, u32* s_warp,
                                         u32* s_res) {
    const int tid = threadIdx.x, lane = tid & 31;
    const int per = nbins / THREADS;
    const int hi = nbins - 1 - tid * per;  // this thread's bins: hi, hi-1, ..., hi-per+1
    u32 local = 0;
    for (int i = 0; i < per; ++i) local += hist[hi - i];
    const u32 incl = warp_incl_scan(local, lane);
    const u32 warp_total = __shfl_sync(FULL_MASK, incl, 31);
    u32 total;
    const u32 excl = warps_excl_scan<THREADS / 32>(warp_total, s_warp, total) + incl - local;
    if (excl < need && excl + local >= need) {
        u32 cum = excl;
        for (int i = 0; i < per; ++i) {
            const u32 h = hist[hi - i];
            if (cum + h >= need) {
                s_res[0] = (u32)(hi - i);
                s_res[1] = need - cum;
                s_res[2] = h;
                break;
            }
            cum += h;
        }
    }
    __syncthreads();
}

template <int THREADS, int VEC, bool ALIGNED>
__device__ __forceinline__ void topk_row(const float* __restrict__ logits, i64 stride_r,
                                         const void* lens, int lens64, const void* active,
                                         int active64, int sel_width, int k, int* __restrict__ out,
                                         i64 stride_o, int nan_low, int cap) {
    constexpr int ITEMS = 4 * VEC;
    constexpr int TILE = THREADS * ITEMS;
    constexpr int WARPS = THREADS / 32;
    constexpr int HIST_BINS = 2048;
    static_assert(TILE < 65536, "packed 16-bit tile counts");
    static_assert(HIST_BINS % THREADS == 0 && 1024 % THREADS == 0, "bins per thread");

    extern __shared__ u32 smem[];  // hist[2048], then cand[cap]
    __shared__ u32 s_warp[WARPS + 1];
    __shared__ u32 s_res[3];
    __shared__ u32 s_cnt;
    u32* hist = smem;
    u32* cand = smem + HIST_BINS;

    const int row = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = live_length(lens, lens64, active, active64, row, sel_width);
    const float* __restrict__ x = logits + (i64)row * stride_r;
    int* __restrict__ o = out + (i64)row * stride_o;

    if (n <= k) {  // block-uniform
        for (int i = tid; i < k; i += THREADS) o[i] = i < n ? i : -1;
        return;
    }
    for (int i = tid; i < HIST_BINS; i += THREADS) hist[i] = 0u;
    __syncthreads();

    const bool resident = n <= TILE;  // block-uniform: the whole row stays in registers
    const int wbase = warp * (32 * ITEMS);
    u32 key[ITEMS];

    // pass A: top 11 bits
    for (int t0 = 0; t0 < n; t0 += TILE) {
        load_keys<VEC, ALIGNED>(x, n, t0 + wbase, lane, nan_low, key);
#pragma unroll
        for (int j = 0; j < VEC; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (t0 + wbase + j * 128 + lane * 4 + c < n) atomicAdd(&hist[key[j * 4 + c] >> 21], 1u);
    }
    __syncthreads();
    find_bin<THREADS>(hist, HIST_BINS, (u32)k, s_warp, s_res);
    u32 prefix = s_res[0];
    u32 need = s_res[1];
    u32 cnt = s_res[2];
    int rbits = 11;

    if (cnt != need) {
        const u32 ncand = cnt;
        const bool use_cand = !resident && ncand <= (u32)cap;  // block-uniform
        if (use_cand) {
            if (tid == 0) s_cnt = 0u;
            __syncthreads();
            for (int t0 = 0; t0 < n; t0 += TILE) {
                load_keys<VEC, ALIGNED>(x, n, t0 + wbase, lane, nan_low, key);
#pragma unroll
                for (int j = 0; j < VEC; ++j)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const u32 u = key[j * 4 + c];
                        if (t0 + wbase + j * 128 + lane * 4 + c < n && (u >> 21) == prefix) {
                            const u32 slot = atomicAdd(&s_cnt, 1u);
                            if (slot < (u32)cap) cand[slot] = u;  // slot < ncand <= cap always
                        }
                    }
            }
            __syncthreads();
        }
        for (int pass = 1; pass <= 2 && cnt != need; ++pass) {  // cnt, need: block-uniform
            const int nbins = pass == 1 ? 2048 : 1024;
            const int shift = pass == 1 ? 10 : 0;
            const int pshift = pass == 1 ? 21 : 10;
            for (int i = tid; i < nbins; i += THREADS) hist[i] = 0u;
            __syncthreads();
            if (resident) {
#pragma unroll
                for (int j = 0; j < VEC; ++j)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const u32 u = key[j * 4 + c];
                        if (wbase + j * 128 + lane * 4 + c < n && (u >> pshift) == prefix)
                            atomicAdd(&hist[(u >> shift) & (u32)(nbins - 1)], 1u);
                    }
            } else if (use_cand) {
                for (u32 i = tid; i < ncand; i += THREADS) {
                    const u32 u = cand[i];
                    if ((u >> pshift) == prefix) atomicAdd(&hist[(u >> shift) & (u32)(nbins - 1)], 1u);
                }
            } else {
                for (int t0 = 0; t0 < n; t0 += TILE) {
                    load_keys<VEC, ALIGNED>(x, n, t0 + wbase, lane, nan_low, key);
#pragma unroll
                    for (int j = 0; j < VEC; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            const u32 u = key[j * 4 + c];
                            if (t0 + wbase + j * 128 + lane * 4 + c < n && (u >> pshift) == prefix)
                                atomicAdd(&hist[(u >> shift) & (u32)(nbins - 1)], 1u);
                        }
                }
            }
            __syncthreads();
            find_bin<THREADS>(hist, nbins, need, s_warp, s_res);
            prefix = (prefix << (pass == 1 ? 11 : 10)) | s_res[0];
            need = s_res[1];
            cnt = s_res[2];
            rbits += pass == 1 ? 11 : 10;
        }
    }

    // collect: above (top rbits > prefix) in position order, then the first `need` ties
    const int shift = 32 - rbits;  // 21, 10 or 0
    const u32 n_above = (u32)k - need;
    u32 above_base = 0, tie_base = 0;
    for (int t0 = 0; t0 < n; t0 += TILE) {
        if (!resident) load_keys<VEC, ALIGNED>(x, n, t0 + wbase, lane, nan_low, key);
        u32 flags_above = 0, flags_tie = 0;
        u32 my_off[VEC];
        u32 run = 0;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            u32 ca = 0, ct = 0;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int idx = j * 4 + c;
                if (t0 + wbase + j * 128 + lane * 4 + c < n) {
                    const u32 hi = key[idx] >> shift;
                    if (hi > prefix) {
                        flags_above |= 1u << idx;
                        ++ca;
                    } else if (hi == prefix) {
                        flags_tie |= 1u << idx;
                        ++ct;
                    }
                }
            }
            const u32 v = (ca << 16) | ct;
            const u32 incl = warp_incl_scan(v, lane);
            my_off[j] = run + incl - v;
            run += __shfl_sync(FULL_MASK, incl, 31);
        }
        u32 total;
        const u32 woff = warps_excl_scan<WARPS>(run, s_warp, total);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const u32 off = woff + my_off[j];
            u32 ra = above_base + (off >> 16);
            u32 rt = tie_base + (off & 0xffffu);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int idx = j * 4 + c;
                const int pos = t0 + wbase + j * 128 + lane * 4 + c;
                if (flags_above & (1u << idx)) {
                    if (ra < n_above) o[ra] = pos;  // always true; guards a broken invariant
                    ++ra;
                } else if (flags_tie & (1u << idx)) {
                    if (rt < need) o[n_above + rt] = pos;
                    ++rt;
                }
            }
        }
        above_base += total >> 16;
        tie_base += total & 0xffffu;
        if (above_base >= n_above && tie_base >= need) break;  // block-uniform
    }
}

#define TOPK_KERNEL(T, V, A)                                                                     \
    extern "C" __global__ void __launch_bounds__(T) topk_radix_t##T##_v##V##_a##A(                \
        const float* __restrict__ logits, i64 stride_r, const void* lens, int lens64,             \
        const void* active, int active64, int sel_width, int k, int* __restrict__ out,            \
        i64 stride_o, int nan_low, int cap) {                                                     \
        topk_row<T, V, (A) != 0>(logits, stride_r, lens, lens64, active, active64, sel_width, k,  \
                                 out, stride_o, nan_low, cap);                                    \
    }

TOPK_KERNEL(1024, 4, 1)
TOPK_KERNEL(1024, 4, 0)
TOPK_KERNEL(1024, 2, 1)
TOPK_KERNEL(1024, 2, 0)
TOPK_KERNEL(512, 4, 1)
TOPK_KERNEL(512, 4, 0)
TOPK_KERNEL(512, 8, 1)
TOPK_KERNEL(512, 8, 0)
