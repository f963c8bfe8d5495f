// CUDA top-k over per-row live prefixes of fp32 scores: one CTA per row, exact radix select.
//
// Compiled at run time by NVRTC (kernels/cuda/topk.py); the pure-torch emulation of the same
// algorithm is kernels/cuda/topk_emu.py and is the specification of this file:
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
//   collect  with the resolved prefix P of r bits (r = 11, 22 or 32) the selection is the
//            positions whose top r bits exceed P and the first `need` positions whose top r bits
//            equal P, written in ascending position order: a position's slot is the count of
//            selected positions before it (order-preserving block scans per tile). Stops once
//            every selected position is written.
//   short    a row of n <= k live scores writes 0..n-1 then -1.
//
// No global scratch, no atomics outside shared memory, nothing to reset: every launch is
// independent, so it replays in a CUDA graph. Host-only parameters are pointers, strides, the
// host width bound sel_width (a clamp), k and flags; the work per row follows n, not sel_width.

typedef unsigned int u32;
typedef long long i64;

#define FULL_MASK 0xffffffffu
#ifndef TOPK_SLOTS_MODULE
#define TOPK_SLOTS_MODULE 0  // 1: the module of the cluster kernels' slots entries (kernels/cuda/topk.py)
#endif

__device__ __forceinline__ u32 order_key(float x, int nan_low) {
    u32 b = __float_as_uint(x);
    u32 u = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    if (nan_low && (b & 0x7fffffffu) > 0x7f800000u) u = 0u;  // NaN (bit test: no float compare)
    return u;
}

// min(row_len, sel_width, active[0]), at least 0. The second read is unconditional (without an
// active width it reads the row's length again, which clamps nothing), so both are in flight
// together: a read behind a branch on the first's value would cost a second round trip.
__device__ __forceinline__ int live_length(const void* lens, int lens64, const void* active,
                                           int active64, int row, int sel_width) {
    const bool has = active != nullptr;
    const void* ap = has ? active : lens;
    const int ai = has ? 0 : row, a64 = has ? active64 : lens64;
    i64 n = lens64 ? ((const i64*)lens)[row] : (i64)((const int*)lens)[row];
    i64 a = a64 ? ((const i64*)ap)[ai] : (i64)((const int*)ap)[ai];
    n = n < 0 ? 0 : n;
    n = n > (i64)sel_width ? (i64)sel_width : n;
    a = a < 0 ? 0 : a;
    return (int)(n > a ? a : n);
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

// a barrier of the CTA's first THREADS threads: __syncthreads when BAR == 0, else the named
// barrier BAR for THREADS threads (a part of the CTA whose other warps have left)
template <int THREADS, int BAR>
__device__ __forceinline__ void block_bar() {
    if (BAR == 0) {
        __syncthreads();
    } else {
        asm volatile("bar.sync %0, %1;" ::"n"(BAR), "n"(THREADS) : "memory");
    }
}

// the sum of v over the warp's 32 lanes, in every lane: redux on sm_80+, shuffles before
__device__ __forceinline__ u32 warp_sum(u32 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
#else
    return __reduce_add_sync(FULL_MASK, v);
#endif
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
// nbins a power of two (any, against THREADS). Two barriers (every warp scans the warps' totals
// itself); ends with a barrier after s_res is written. s_warp holds THREADS / 32 words.
template <int THREADS, int BAR = 0>
__device__ __forceinline__ void find_bin(const u32* hist, int nbins, u32 need, u32* s_warp,
                                         u32* s_res) {
    constexpr int WARPS = THREADS / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int per = nbins > THREADS ? nbins / THREADS : (tid < nbins ? 1 : 0);
    const int hi = nbins - 1 - tid * per;  // this thread's bins: hi, hi-1, ..., hi-per+1
    if (nbins == 4 * THREADS || nbins == 8 * THREADS) {  // block-uniform: the bins stay in registers
        u32 h[8];  // h[i]: bin hi - i
        const uint4 q0 = *reinterpret_cast<const uint4*>(hist + hi - 3);
        h[0] = q0.w, h[1] = q0.z, h[2] = q0.y, h[3] = q0.x;
        h[4] = h[5] = h[6] = h[7] = 0u;
        if (nbins == 8 * THREADS) {
            const uint4 q1 = *reinterpret_cast<const uint4*>(hist + hi - 7);
            h[4] = q1.w, h[5] = q1.z, h[6] = q1.y, h[7] = q1.x;
        }
        const u32 local = ((h[0] + h[1]) + (h[2] + h[3])) + ((h[4] + h[5]) + (h[6] + h[7]));
        const u32 wsum = warp_sum(local);
        __syncwarp();  // every lane of this warp has read s_warp in an earlier call
        if (lane == 0) s_warp[warp] = wsum;
        block_bar<THREADS, BAR>();
        const u32 t = lane < WARPS ? s_warp[lane] : 0u;
        const u32 base = warp_sum(lane < warp ? t : 0u);  // the warps above this one
        if (base < need && base + wsum >= need) {  // warp-uniform: this warp holds the need-th
            const u32 excl = base + warp_incl_scan(local, lane) - local;
            if (excl < need && excl + local >= need) {
                u32 cum = excl;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if (cum + h[i] >= need) {
                        s_res[0] = (u32)(hi - i);
                        s_res[1] = need - cum;
                        s_res[2] = h[i];
                        break;
                    }
                    cum += h[i];
                }
            }
        }
        block_bar<THREADS, BAR>();
        return;
    }
    u32 local = 0;
    if (per % 4 == 0) {  // the thread's bins [hi - per + 1, hi] start at a multiple of 4
        for (int i = hi - per + 1; i <= hi; i += 4) {
            const uint4 q = *reinterpret_cast<const uint4*>(hist + i);
            local += (q.x + q.y) + (q.z + q.w);
        }
    } else {
        for (int i = 0; i < per; ++i) local += hist[hi - i];
    }
    const u32 incl = warp_incl_scan(local, lane);
    __syncwarp();  // every lane of this warp has read s_warp in an earlier call
    if (lane == 31) s_warp[warp] = incl;
    block_bar<THREADS, BAR>();
    const u32 t = lane < WARPS ? s_warp[lane] : 0u;
    const u32 warp_base = __shfl_sync(FULL_MASK, warp_incl_scan(t, lane) - t, warp);
    const u32 excl = warp_base + incl - local;
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
    block_bar<THREADS, BAR>();
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
                if (flags_above & (1u << idx)) {  // after every selected position before it
                    const u32 d = ra + (rt < need ? rt : need);
                    if (d < (u32)k) o[d] = pos;  // always true; guards a broken invariant
                    ++ra;
                } else if (flags_tie & (1u << idx)) {
                    if (rt < need) o[ra + rt] = pos;
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
    extern "C" __global__ void __launch_bounds__(T, 1) topk_radix_t##T##_v##V##_a##A(                \
        const float* __restrict__ logits, i64 stride_r, const void* lens, int lens64,             \
        const void* active, int active64, int sel_width, int k, int* __restrict__ out,            \
        i64 stride_o, int nan_low, int cap) {                                                     \
        topk_row<T, V, (A) != 0>(logits, stride_r, lens, lens64, active, active64, sel_width, k,  \
                                 out, stride_o, nan_low, cap);                                    \
    }

#if !TOPK_SLOTS_MODULE  // (the slots module: the cluster kernels' slots entries only)
TOPK_KERNEL(1024, 4, 1)
TOPK_KERNEL(1024, 4, 0)
TOPK_KERNEL(1024, 2, 1)
TOPK_KERNEL(1024, 2, 0)
TOPK_KERNEL(512, 4, 1)
TOPK_KERNEL(512, 4, 0)
TOPK_KERNEL(512, 8, 1)
TOPK_KERNEL(512, 8, 0)
#endif

// ---------------------------------------------------------------------------------------------
// DCP merge (any arch): one CTA of 1024 threads per row merges the world * k_local gathered
// int64 candidate keys (dcp.candidate_keys: score, then lowest global id; dcp.PAD_KEY padding)
// into the exact global top-k, as dcp.merge_candidate_keys + dcp.global_to_local specify:
//
//   keys     thread t holds gathered elements t * PER .. t * PER + PER - 1 (gathered order is
//            thread order), as u = key ^ 2^63 (unsigned order = signed order; padding is 0).
//   select   radix passes of 11 bits from the top (11 x 5, then 9) over keys still matching
//            the resolved prefix; the bin of the take-th largest (take = min(k, n)); stop once
//            the bin holds exactly the keys still needed (usually after the score's 32 bits:
//            real keys are unique per row).
//   write    keys above the prefix, and the first `need` keys equal to it in gathered order,
//            except padding, go to consecutive slots in gathered order (two block scans); their
//            ids, this rank's local positions and the ownership mask are written, then -1 / -1
//            / 0 up to k.
// ---------------------------------------------------------------------------------------------
typedef unsigned long long u64;

// exclusive prefix of per-thread counts over the block in thread order (THREADS threads);
// `total` gets the block's sum. Three barriers' worth (warps_excl_scan); every thread calls it.
template <int THREADS>
__device__ __forceinline__ u32 block_excl_scan(u32 v, u32* s_warp, u32& total) {
    const int lane = threadIdx.x & 31;
    const u32 incl = warp_incl_scan(v, lane);
    const u32 warp_total = __shfl_sync(FULL_MASK, incl, 31);
    return warps_excl_scan<THREADS / 32>(warp_total, s_warp, total) + incl - v;
}

template <int PER>
__device__ __forceinline__ void dcp_merge_row(const i64* __restrict__ keys, i64 stride_w, i64 stride_r,
                                              int world, int k_local, int k, int il, int rank,
                                              int* __restrict__ gidx, int* __restrict__ lidx,
                                              unsigned char* __restrict__ lmask, i64 stride_o) {
    constexpr int THREADS = 1024;
    constexpr int BINS = 2048;
    __shared__ u32 hist[2][BINS];  // passes alternate: each clears the next one's
    __shared__ u32 s_warp[THREADS / 32 + 1];
    __shared__ u32 s_res[3];
    const int row = blockIdx.x, tid = threadIdx.x;
    const int n = world * k_local;
    const int j0 = tid * PER;

    u64 u[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const int j = j0 + e;
        u[e] = 0ull;
        if (j < n) {
            const int w = j / k_local, c = j - w * k_local;
            u[e] = (u64)keys[(i64)w * stride_w + (i64)row * stride_r + c] ^ 0x8000000000000000ull;
        }
    }
    const u32 take = (u32)(k < n ? k : n);
    u64 prefix = 0ull;
    int rbits = 0;
    u32 need = take, cnt = 0xffffffffu;
    for (int i = tid; i < BINS; i += THREADS) hist[0][i] = 0u;
    __syncthreads();
    for (int pass = 0; take > 0u && rbits < 64 && cnt != need; ++pass) {  // block-uniform
        const int width = rbits + 11 <= 64 ? 11 : 64 - rbits;
        const int shift = 64 - rbits - width;
        const u32 mask = (1u << width) - 1u;
        u32* h = hist[pass & 1];
        u32* next = hist[(pass + 1) & 1];  // the previous pass's: its find_bin's reads are done
        for (int i = tid; i < BINS; i += THREADS) next[i] = 0u;
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            const bool alive = j0 + e < n && (rbits == 0 || (u[e] >> (64 - rbits)) == prefix);
            if (alive) atomicAdd(&h[(u32)(u[e] >> shift) & mask], 1u);
        }
        __syncthreads();
        find_bin<THREADS>(h, BINS, need, s_warp, s_res);
        prefix = (prefix << width) | (u64)s_res[0];
        rbits += width;
        need = s_res[1];
        cnt = s_res[2];
    }

    // which of this thread's keys are taken, in gathered order
    const int shift = 64 - rbits;
    bool above[PER], tie[PER];
    u32 n_tie = 0;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const bool live = take > 0u && j0 + e < n;
        const u64 hi = shift >= 64 ? 0ull : (u[e] >> shift);
        above[e] = live && hi > prefix;
        tie[e] = live && hi == prefix;
        n_tie += tie[e] ? 1u : 0u;
    }
    u32 total;
    u32 tie_rank = block_excl_scan<THREADS>(n_tie, s_warp, total);
    u32 n_sel = 0;
    bool sel[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        bool s = above[e];
        if (tie[e]) {
            s = tie_rank < need;
            ++tie_rank;
        }
        sel[e] = s && u[e] != 0ull;  // padding is never an id
        n_sel += sel[e] ? 1u : 0u;
    }
    u32 count;
    u32 slot = block_excl_scan<THREADS>(n_sel, s_warp, count);
    const i64 base = (i64)row * stride_o;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        if (!sel[e]) continue;
        // dcp.key_ids, then dcp.global_to_local on the int32 id
        const int id = (int)(0xffffffffu - (u32)(u[e] & 0xffffffffull));
        const i64 g = (i64)id;
        const bool owned = g >= 0 && (g / il) % world == rank;
        const int lp = owned ? (int)((g / ((i64)il * world)) * il + g % il) : -1;
        gidx[base + slot] = id;
        lidx[base + slot] = lp;
        lmask[base + slot] = lp >= 0 ? 1 : 0;
        ++slot;
    }
    for (int i = (int)count + tid; i < k; i += THREADS) {
        gidx[base + i] = -1;
        lidx[base + i] = -1;
        lmask[base + i] = 0;
    }
}

#define DCP_MERGE_KERNEL(P)                                                                        \
    extern "C" __global__ void __launch_bounds__(1024) dcp_merge_p##P(                             \
        const i64* __restrict__ keys, i64 stride_w, i64 stride_r, int world, int k_local, int k,  \
        int il, int rank, int* __restrict__ gidx, int* __restrict__ lidx,                          \
        unsigned char* __restrict__ lmask, i64 stride_o) {                                         \
        dcp_merge_row<P>(keys, stride_w, stride_r, world, k_local, k, il, rank, gidx, lidx, lmask, \
                         stride_o);                                                                \
    }

#if !TOPK_SLOTS_MODULE
DCP_MERGE_KERNEL(1)
DCP_MERGE_KERNEL(2)
DCP_MERGE_KERNEL(4)
DCP_MERGE_KERNEL(8)
DCP_MERGE_KERNEL(16)
#endif

// ---------------------------------------------------------------------------------------------
// Cluster route (sm_90+): C CTAs of one thread-block cluster share a row. The same selection
// and output as topk_row above (topk_emu.py stays the specification: cluster_topk_row
// models the steps below):
//
//   split    the live prefix n is cut on the device into C chunks of `chunk` = ceil(n / C)
//            rounded up to 4 positions; CTA r (its cluster rank) owns positions
//            [r * chunk, min(n, (r + 1) * chunk)). A row of at most SOLO_MAX live keys that fits
//            one CTA's keys runs on rank 0 alone, as the C = 1 kernel (the others leave at once);
//            one of at most 4 * CLUSTER_UNROLL * THREADS keys runs from registers on rank 0
//            (any C, any cap): every thread of the C = 1 kernel and of rank 0 loads its first
//            CLUSTER_UNROLL 16-byte groups beside the live length (topk_reg_body).
//            The first `cap` keys of the chunk are read once into shared memory; the rest (a
//            chunk longer than the host sized for) are read from global memory again on each
//            sweep: exact whatever the length, fast up to `cap`.
//   passes   each CTA counts its chunk into a local histogram, then adds its nonzero bins into
//            the pass's histogram of every CTA of the cluster (distributed shared memory
//            reductions: traffic follows the occupied bins, not the bin count); after a cluster
//            barrier every CTA holds the same totals and resolves the same prefix, need and early
//            exit. Each pass has its own target histogram, cleared before a split barrier at the
//            start, so no pass clears memory another CTA may still write. Passes stop once the
//            k-th key's bin is taken whole or holds at most TIE_MAX keys. A row on one CTA
//            (C = 1, or a short row) takes 4096 bins of solo_bin (64 per octave of |x|) in pass A
//            and lists bins of at most SOLO_TIE_MAX keys; every refine pass takes the next (at
//            most 11) bits in which the keys of the bin [klo, khi] vary.
//   collect  thread t owns the chunk positions [t * per, t * per + per) (per: a multiple of 8),
//            kept in shared memory with RANGE_PAD words after each range so that the threads'
//            16-byte reads hit distinct banks; each thread counts (and marks in bit masks) the
//            keys above the bin (A) and in it (T) in its range; a listed bin's keys (more than
//            needed, at most TIE_MAX) go to every CTA's list; one block scan (and every CTA's
//            totals written into the higher ranks) gives the counts before the range; one warp
//            ranks a listed bin by (key, position). Each selected key of the range goes to
//            ra + tb (A keys and selected T keys before it): the ascending order of topk_row.
//            No remote access follows the exchange's barrier.
//   slots    the slots entries (`_slots`, the slots module: TOPK_SLOTS_MODULE) take a page table
//            (int32 rows of `pages` pages of 2^page_bits slots) and write each selected position p
//            as its KV-cache slot, table[row][p >> page_bits] << page_bits | (p's offset in its
//            page), or -1 where its page is past the table, its entry is negative or the slot
//            would pass 2^31 - 1: the top-k and the page-table transform in one launch
//            (reference.page_table_slots). Padding stays -1; each selected position written as
//            -1 adds one to the launch's `unmapped` counter (when given: the entries' last
//            parameter).
//
// Dynamic shared memory (words): the local counts of the three passes hist[2048], hist1[2048],
// hist2[1024] (all cleared at the start; one CTA: hist[4096], hist1[2048], hist2[2048], and a
// third refine pass reuses hist); for C > 1 the targets glob0[2048], glob1[2048],
// glob2[1024]; then the keys: cap of them, cap a multiple of 4, with RANGE_PAD words after each
// thread's range (cap + RANGE_PAD * THREADS words). Nothing global beyond the output: a launch
// replays in a CUDA graph as is.
// ---------------------------------------------------------------------------------------------
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

// Wait until the kernel before this one in the stream has completed and its writes are visible
// (a no-op unless this kernel was launched as a programmatic dependent launch).
__device__ __forceinline__ void grid_dependency_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ u32 cl_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cl_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void cl_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void cl_sync() {
    cl_arrive();
    cl_wait();
}

// the address of this CTA's shared word `p` in CTA `rank` of the cluster
__device__ __forceinline__ u32 cl_map(const u32* p, u32 rank) {
    u32 local = (u32)__cvta_generic_to_shared(p), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}

__device__ __forceinline__ void cl_add(const u32* p, u32 rank, u32 v) {
    asm volatile("red.relaxed.cluster.shared::cluster.add.u32 [%0], %1;" ::"r"(cl_map(p, rank)), "r"(v) : "memory");
}

__device__ __forceinline__ void cl_store(const u32* p, u32 rank, u32 v) {
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(cl_map(p, rank)), "r"(v) : "memory");
}

// add the nonzero bins of the local histogram into `glob` of every CTA, then a cluster barrier
template <int C, int THREADS>
__device__ __forceinline__ void cl_push_hist(const u32* hist, u32* glob, int nbins) {
    for (int b = threadIdx.x; b < nbins; b += THREADS) {
        const u32 v = hist[b];
        if (v != 0u) {
#pragma unroll
            for (int r = 0; r < C; ++r) cl_add(glob + b, (u32)r, v);
        }
    }
    cl_sync();
}

__device__ __forceinline__ u32 cl_load(const u32* p, u32 rank) {
    u32 v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(cl_map(p, rank)) : "memory");
    return v;
}

// find_bin over one bin per thread: thread t holds v, the count of bin `bin` (bins in thread
// order from the top down, none past the last); writes s_res as find_bin. Two barriers.
template <int THREADS, int BAR = 0>
__device__ __forceinline__ void find_bin_of_threads(u32 v, u32 bin, u32 need, u32* s_warp, u32* s_res) {
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 incl = warp_incl_scan(v, lane);
    __syncwarp();
    if (lane == 31) s_warp[warp] = incl;
    block_bar<THREADS, BAR>();
    const u32 t = lane < WARPS ? s_warp[lane] : 0u;
    const u32 excl = __shfl_sync(FULL_MASK, warp_incl_scan(t, lane) - t, warp) + incl - v;
    if (excl < need && excl + v >= need) {
        s_res[0] = bin;
        s_res[1] = need - excl;
        s_res[2] = v;
    }
    block_bar<THREADS, BAR>();
}

// find_bin on the cluster's totals of this CTA's counts `hist` (complete; nbins = 2^bits, at
// least 32 * C, at most C * THREADS): bin b's count goes to its owner only (CTA b / (nbins / C),
// into `glob`), a range's count to every CTA (`part`, C words; `rng`: C local words; both
// cleared); after one cluster barrier each CTA reads the range that holds the need-th key from
// its owner. The same s_res as find_bin on the totals.
template <int C, int THREADS>
__device__ __forceinline__ void cl_find_bin(const u32* hist, u32* glob, u32* rng, u32* part, int bits, u32 need,
                                            u32* s_warp, u32* s_res) {
    static_assert(C == 1 || C == 2 || C == 4 || C == 8 || C == 16, "cluster size");  // (C == 1: not called)
    constexpr int LOG_C = C == 16 ? 4 : C == 8 ? 3 : (C == 4 ? 2 : (C == 2 ? 1 : 0));
    const int tid = threadIdx.x, lane = tid & 31;
    const int rbits = bits - LOG_C;  // a range's 2^rbits bins (a warp's share an owner)
    const int nbins = 1 << bits, rs = 1 << rbits;
    for (int b = tid; b < nbins; b += THREADS) {  // warp-uniform
        const u32 v = hist[b], r = (u32)(b >> rbits);
        if (v != 0u) cl_add(glob + b, r, v);
        const u32 w = warp_sum(v);
        if (lane == 0 && w != 0u) atomicAdd(&rng[r], w);
    }
    __syncthreads();
    if (tid < C * C && rng[tid % C] != 0u) cl_add(&part[tid % C], (u32)(tid / C), rng[tid % C]);
    cl_sync();
    u32 above = 0u;
    int own = C - 1;  // the range of the need-th key from the top
    for (; own > 0 && above + part[own] < need; --own) above += part[own];
    const u32 bin = (u32)(own * rs + rs - 1 - tid);
    const u32 v = tid < rs ? cl_load(glob + bin, (u32)own) : 0u;
    find_bin_of_threads<THREADS>(v, bin, need - above, s_warp, s_res);
}

// the raw bits of positions i..i+3 of the chunk (0 at or past lim); x points at its first position
template <bool ALIGNED>
__device__ __forceinline__ uint4 chunk_bits4(const float* __restrict__ x, int i, int lim) {
    if (ALIGNED && i + 4 <= lim) return __ldg(reinterpret_cast<const uint4*>(x + i));
    const u32* __restrict__ b = reinterpret_cast<const u32*>(x);
    uint4 q;
    q.x = i + 0 < lim ? __ldg(b + i + 0) : 0u;
    q.y = i + 1 < lim ? __ldg(b + i + 1) : 0u;
    q.z = i + 2 < lim ? __ldg(b + i + 2) : 0u;
    q.w = i + 3 < lim ? __ldg(b + i + 3) : 0u;
    return q;
}

// keys of positions i..i+3 of the chunk (0 at or past lim); x points at the chunk's first position
template <bool ALIGNED>
__device__ __forceinline__ uint4 chunk_keys4(const float* __restrict__ x, int i, int lim, int nan_low) {
    if (ALIGNED && i + 4 <= lim) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(x + i));
        return make_uint4(order_key(v.x, nan_low), order_key(v.y, nan_low), order_key(v.z, nan_low),
                          order_key(v.w, nan_low));
    }
    uint4 q;
    q.x = i + 0 < lim ? order_key(__ldg(x + i + 0), nan_low) : 0u;
    q.y = i + 1 < lim ? order_key(__ldg(x + i + 1), nan_low) : 0u;
    q.z = i + 2 < lim ? order_key(__ldg(x + i + 2), nan_low) : 0u;
    q.w = i + 3 < lim ? order_key(__ldg(x + i + 3), nan_low) : 0u;
    return q;
}

#define RANGE_PAD 4  // topk_emu.RANGE_PAD
#define PASS_WORDS (2 * 2048 + 1024)  // the three passes' counts: hist, hist1, hist2 (and glob0..glob2)

// f(p, key) for the positions p of [r_lo, r_hi) (this thread's range, r_lo a multiple of 4), in
// order: shared memory (padded slot p + RANGE_PAD * tid) below lim, global memory from lim on
template <bool ALIGNED, typename F>
__device__ __forceinline__ void range_sweep(const u32* keys, int lim, const float* __restrict__ x,
                                            int nan_low, int r_lo, int r_hi, F f) {
    const u32* mine = keys + RANGE_PAD * threadIdx.x;
    int b = r_lo;
    for (; b + 4 < r_hi && b + 8 <= lim; b += 8) {  // two 16-byte reads in flight
        const uint4 q0 = *reinterpret_cast<const uint4*>(mine + b);
        const uint4 q1 = *reinterpret_cast<const uint4*>(mine + b + 4);
        f(b, q0.x);
        f(b + 1, q0.y);
        f(b + 2, q0.z);
        f(b + 3, q0.w);
        if (b + 4 < r_hi) f(b + 4, q1.x);
        if (b + 5 < r_hi) f(b + 5, q1.y);
        if (b + 6 < r_hi) f(b + 6, q1.z);
        if (b + 7 < r_hi) f(b + 7, q1.w);
    }
    for (; b < r_hi; b += 4) {
        const uint4 q = b < lim ? *reinterpret_cast<const uint4*>(mine + b)
                                : chunk_keys4<ALIGNED>(x, b, r_hi, nan_low);
        f(b, q.x);
        if (b + 1 < r_hi) f(b + 1, q.y);
        if (b + 2 < r_hi) f(b + 2, q.z);
        if (b + 3 < r_hi) f(b + 3, q.w);
    }
}

// exclusive prefixes of two per-thread counts over the block in thread order, and their totals;
// one barrier; every thread calls it once (s_scan: 2 * WARPS words of its own)
template <int THREADS, int BAR = 0>
__device__ __forceinline__ void block_excl_scan2(u32& a, u32& b, u32* s_scan, u32& ta, u32& tb) {
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ia = warp_incl_scan(a, lane), ib = warp_incl_scan(b, lane);
    if (lane == 31) {
        s_scan[warp] = ia;
        s_scan[WARPS + warp] = ib;
    }
    block_bar<THREADS, BAR>();
    const u32 wa = lane < WARPS ? s_scan[lane] : 0u, wb = lane < WARPS ? s_scan[WARPS + lane] : 0u;
    ta = warp_sum(wa);
    tb = warp_sum(wb);
    const u32 ba = warp_sum(lane < warp ? wa : 0u);  // the warps before this one
    const u32 bb = warp_sum(lane < warp ? wb : 0u);
    a = ba + ia - a;
    b = bb + ib - b;
}

#ifndef TOPK_TRIGGER
#define TOPK_TRIGGER 1  // 0: experiments only (the next kernel launches when this one's CTAs leave)
#endif
#define SOLO_MAX 16384  // topk_emu.SOLO_MAX
#define TIE_MAX 32  // topk_emu.TIE_MAX
#define SOLO_TIE_MAX 128  // topk_emu.SOLO_TIE_MAX
#define SOLO_EXP_LO 113  // topk_emu.SOLO_EXP_LO
#define SOLO_WORDS (4096 + 2 * 2048)  // a one-CTA row's counts: hist[4096], hist1[2048], hist2[2048]
#define CLUSTER_UNROLL 4  // 16-byte loads in flight per thread in the first sweep
#ifndef SHORT_ACT
#define SHORT_ACT 512  // the threads that run a row of at most 4 * CLUSTER_UNROLL * SHORT_ACT keys
#endif

// The one-CTA pass-A bin of key u (topk_emu.solo_bin): 2048 bins per sign, 64 per binary
// octave of |x| from 2^(SOLO_EXP_LO - 127) to 2^(SOLO_EXP_LO - 95); each sign's first and last
// bins also hold the magnitudes below and above. Non-decreasing in u; a bin is an interval of keys.
__device__ __forceinline__ u32 solo_bin(u32 u) {
    const int s = (int)(u >> 17);
    const bool pos = s >= 0x4000;
    int j = s - (pos ? 0x4000 + SOLO_EXP_LO * 64 : 0x3800 - SOLO_EXP_LO * 64);
    j = j < 0 ? 0 : (j > 2047 ? 2047 : j);
    return (u32)j + (pos ? 2048u : 0u);
}

// the keys [lo, hi] of solo_bin's bin b (topk_emu.solo_bin_keys)
__device__ __forceinline__ void solo_bin_keys(u32 b, u32& lo, u32& hi) {
    const bool pos = b >= 2048u;
    const u32 j = b & 2047u, base = pos ? 0x4000u + SOLO_EXP_LO * 64 : 0x3800u - SOLO_EXP_LO * 64;
    const u32 s_lo = j == 0u ? (pos ? 0x4000u : 0u) : base + j;
    const u32 s_hi = j == 2047u ? (pos ? 0x7fffu : 0x3fffu) : base + j;
    lo = s_lo << 17;
    hi = (s_hi << 17) | 0x1ffffu;
}

// the old value of the shared word `p` of CTA `rank` after adding v to it
__device__ __forceinline__ u32 cl_atomic_add(const u32* p, u32 rank, u32 v) {
    u32 old;
    asm volatile("atom.shared::cluster.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(cl_map(p, rank)), "r"(v) : "memory");
    return old;
}

// the raw bits of the first CLUSTER_UNROLL 16-byte groups a thread loads (the C = 1 kernel and a
// cluster's rank 0: read beside the live length, before it is known)
struct FirstKeys {
    uint4 q[CLUSTER_UNROLL];
};

// the static shared words of a cluster-route row, declared once per kernel (its bodies share them)
struct BodyScratch {
    u32 warp[1024 / 32 + 1];
    u32 scan[CLUSTER_UNROLL * (1024 / 32)];
    u32 res[3];
    u32 sel[2];
    u32 cnt[2 * 16];
    u32 tn;
    u32 rng[2][16];  // cl_find_bin's local range counts of the refine passes (cleared at the start)
    u32 part[2][16];  // and the cluster's
    // a slots kernel's page table: the row's (two words: the struct keeps 4-byte alignment, so a
    // positions kernel's code, which never reads these, is the one without them), log2 of the page
    // size, the table's width in pages
    u32 page_row[2];
    int page_bits, pages;
    u32 unmapped[2];  // a slots kernel's counter of selected positions without a slot (or null)
};

// the KV-cache slot of row position p >= 0 whose page's table entry is e (pages of 2^bits slots);
// -1 for an entry that is negative (no page) or whose slots would pass 2^31 - 1
__device__ __forceinline__ int entry_slot(int e, int bits, int p) {
    return (e < 0 || e > (0x7fffffff >> bits)) ? -1 : ((e << bits) | (p & ((1 << bits) - 1)));
}

// the KV-cache slot of row position p >= 0 through the row's page table t of `pages` pages of
// 2^bits slots: t[p >> bits] << bits | p's offset in its page; -1 past the table
__device__ __forceinline__ int page_slot(const int* t, int bits, int pages, int p) {
    const int g = p >> bits;
    return g < pages ? entry_slot(__ldg(t + g), bits, p) : -1;
}

// a slots kernel's row of the page table (BodyScratch keeps the pointer as two words)
__device__ __forceinline__ const int* page_row_of(const BodyScratch& sc) {
    return reinterpret_cast<const int*>(((unsigned long long)sc.page_row[1] << 32) | sc.page_row[0]);
}

// a slots kernel's counter of unmapped positions (BodyScratch keeps the pointer as two words)
__device__ __forceinline__ u32* unmapped_of(const BodyScratch& sc) {
    return reinterpret_cast<u32*>(((unsigned long long)sc.unmapped[1] << 32) | sc.unmapped[0]);
}

// slot v of a selected position: a -1 (the position has no slot) counts once into `unmapped`
__device__ __forceinline__ int count_unmapped(u32* unmapped, int v) {
    if (v < 0 && unmapped != nullptr) atomicAdd(unmapped, 1u);
    return v;
}

// what the output holds for row position p >= 0: p itself, or (SLOTS: a kernel given a page
// table) its slot, a -1 counted; a positions kernel's code has no trace of the table
template <bool SLOTS>
__device__ __forceinline__ int out_index(const BodyScratch& sc, int p) {
    if (!SLOTS) return p;
    return count_unmapped(unmapped_of(sc), page_slot(page_row_of(sc), sc.page_bits, sc.pages, p));
}

// one row (`logits` at its first score) of n > k live keys, on this CTA (`rank` of C) of a
// cluster whose dynamic shared memory is cleared (hist..hist2, and glob0..glob2 for C > 1);
// C == 1 also serves a short row on rank 0 of a larger cluster (whose allocation is larger).
// PRE: `first` holds the raw bits of the thread's first-sweep groups below min(n, cap) (C == 1).
template <int C, int THREADS, bool ALIGNED, bool PRE, bool SLOTS>
__device__ __forceinline__ void topk_cluster_body(const float* __restrict__ logits, int n, int k,
                                                  int* __restrict__ o, int nan_low, int cap, u32 rank,
                                                  const FirstKeys& first, BodyScratch& sc) {
    constexpr bool multi = C > 1;
    constexpr int BINS_A = multi ? 2048 : 4096;  // pass A: u >> 21, or solo_bin (one CTA)
    constexpr int TIE = multi ? TIE_MAX : SOLO_TIE_MAX;  // the largest bin resolved from a list
    constexpr int UNROLL = CLUSTER_UNROLL;
    static_assert(1024 % THREADS == 0 && THREADS % TIE == 0 && THREADS / TIE <= 32, "threads");
    static_assert(C >= 1 && C <= 16, "cluster size");

    extern __shared__ __align__(16) u32 smem[];
    u32* s_warp = sc.warp;
    u32* s_scan = sc.scan;
    u32* s_res = sc.res;
    u32* s_cnt = sc.cnt;  // (above, tie) counts of each lower rank
    u32& s_tn = sc.tn;  // the listed bin's keys so far (rank 0's counts for the cluster)
    u32* hist = smem;  // this CTA's counts of pass A, then of the refine passes
    u32* hist1 = hist + BINS_A;
    u32* hist2 = hist1 + 2048;
    u32* glob0 = hist2 + (multi ? 1024 : 2048);  // C > 1: the cluster's totals of each pass
    u32* glob1 = glob0 + 2048;
    u32* glob2 = glob1 + 2048;
    u32* keys = multi ? glob2 + 1024 : glob0;
    // the listed bin (in hist, free once pass A is found): its keys and row positions, whether
    // its j-th key in position order is selected, selected keys among its first j
    u32* s_tkey = hist;
    u32* s_tpos = hist + TIE;
    u32* s_taken = hist + 2 * TIE;
    u32* s_before = hist + 3 * TIE;  // TIE + 1 words

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (multi && tid == 0) s_tn = 0u;
    const int chunk = ((n + C - 1) / C + 3) & ~3;
    const int lo = (int)rank * chunk;
    const int len = n - lo < 0 ? 0 : (n - lo > chunk ? chunk : n - lo);
    const int lim = len < cap ? len : cap;  // keys [0, lim) in shared memory, [lim, len) global
    const float* __restrict__ x = logits + lo;
    // thread t's range [t * per, t * per + per) (topk_emu.thread_range); the slot of
    // position p is p + RANGE_PAD * (p / per), p / per = umulhi(p, magic) exactly (p * per < 2^32)
    const int per = (((len + THREADS - 1) / THREADS) + 7) & ~7 | 8 * (len == 0);
    const u32 magic = 0xffffffffu / (u32)per + 1u;
    const int r_lo = tid * per < len ? tid * per : len;
    const int r_hi = r_lo + per < len ? r_lo + per : len;

    if (multi) cl_arrive();  // after the clears; waited for before the first remote add
    __syncthreads();  // cleared before the first add

    // load + pass A in one sweep; the next sweep's 16-byte groups are in flight while this one's
    // are stored and counted
    constexpr int STRIDE = THREADS * 4 * UNROLL;
    uint4 q[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
        q[u] = PRE ? first.q[u] : chunk_bits4<ALIGNED>(x, tid * 4 + u * THREADS * 4, lim);
    for (int i0 = tid * 4; i0 < lim; i0 += STRIDE) {
        uint4 nq[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int np = i0 + STRIDE + u * THREADS * 4;
            nq[u] = np < lim ? chunk_bits4<ALIGNED>(x, np, lim) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int p = i0 + u * THREADS * 4;
            if (p >= lim) continue;
            const uint4 k4 = make_uint4(
                order_key(__uint_as_float(q[u].x), nan_low), order_key(__uint_as_float(q[u].y), nan_low),
                order_key(__uint_as_float(q[u].z), nan_low), order_key(__uint_as_float(q[u].w), nan_low));
            *reinterpret_cast<uint4*>(keys + p + RANGE_PAD * __umulhi((u32)p, magic)) = k4;
            const u32 b0 = multi ? k4.x >> 21 : solo_bin(k4.x), b1 = multi ? k4.y >> 21 : solo_bin(k4.y);
            const u32 b2 = multi ? k4.z >> 21 : solo_bin(k4.z), b3 = multi ? k4.w >> 21 : solo_bin(k4.w);
            atomicAdd(&hist[b0], 1u);
            if (p + 1 < lim) atomicAdd(&hist[b1], 1u);
            if (p + 2 < lim) atomicAdd(&hist[b2], 1u);
            if (p + 3 < lim) atomicAdd(&hist[b3], 1u);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) q[u] = nq[u];
    }
    for (int i = lim + tid; i < len; i += THREADS) {  // the chunk past cap, from global memory
        const u32 u = order_key(__ldg(x + i), nan_low);
        atomicAdd(&hist[multi ? u >> 21 : solo_bin(u)], 1u);
    }
    __syncthreads();
    const u32* totals = hist;
    if (multi) {
        cl_wait();
        cl_push_hist<C, THREADS>(hist, glob0, BINS_A);
        totals = glob0;
    }
    find_bin<THREADS>(totals, BINS_A, (u32)k, s_warp, s_res);
    // the keys [klo, khi] of the k-th key's bin hold the threshold: those above khi are taken
    u32 klo, khi;
    if (multi) {
        klo = s_res[0] << 21;
        khi = klo | 0x1fffffu;
    } else {
        solo_bin_keys(s_res[0], klo, khi);
    }
    u32 need = s_res[1];
    u32 cnt = s_res[2];

    // refine on the next (at most 11) bits below those klo and khi share, until the bin is
    // taken whole, holds at most TIE keys or one key value (cluster-uniform)
    for (int pass = 1; cnt != need && cnt > (u32)TIE && klo != khi; ++pass) {
        const int sh = 32 - __clz(klo ^ khi);  // the bits that vary in [klo, khi]
        const int bits = sh < 11 ? sh : 11;
        const int dsh = sh - bits;
        const int nbins = 1 << bits;
        const u32 mask = (u32)(nbins - 1), l = klo, r = khi;
        u32* h = pass == 1 ? hist1 : (pass == 2 ? hist2 : hist);  // cleared at the start but hist
        if (pass == 3) {  // one CTA only (a cluster's pass A leaves 21 bits: two passes)
            for (int i = tid; i < nbins; i += THREADS) h[i] = 0u;
            __syncthreads();
        }
        range_sweep<ALIGNED>(keys, lim, x, nan_low, r_lo, r_hi, [&](int, u32 u) {
            if (u >= l && u <= r) atomicAdd(&h[(u >> dsh) & mask], 1u);
        });
        __syncthreads();
        totals = h;
        if (multi) {
            u32* glob = pass == 1 ? glob1 : glob2;
            cl_push_hist<C, THREADS>(h, glob, nbins);
            totals = glob;
        }
        find_bin<THREADS>(totals, nbins, need, s_warp, s_res);
        const u32 base = sh >= 32 ? 0u : (klo >> sh) << sh;
        const u32 dlo = base | (s_res[0] << dsh), dhi = dlo | ((1u << dsh) - 1u);
        klo = klo > dlo ? klo : dlo;
        khi = khi < dhi ? khi : dhi;
        need = s_res[1];
        cnt = s_res[2];
    }
    // listed: the bin's keys (more than needed, at most TIE) are ranked by (key, position)
    const bool listed = cnt != need && cnt <= (u32)TIE;

    // collect: count this range's keys above the bin (A) and in it (T), listing T keys when
    // listed; scan; write the selected keys of the range at the count of selected keys before
    const bool use_mask = per <= 32;  // CTA-uniform: the range's A and T keys as bit masks
    const u32 l = klo, r = khi;
    u32 ra = 0, rt = 0, amask = 0, tmask = 0;
    range_sweep<ALIGNED>(keys, lim, x, nan_low, r_lo, r_hi, [&](int p, u32 u) {
        if (u > r) {
            ++ra;
            if (use_mask) amask |= 1u << (p - r_lo);
        } else if (u >= l) {
            ++rt;
            if (use_mask) tmask |= 1u << (p - r_lo);
        }
    });
    const u32 mine_t = rt;
    if (multi && listed && rt != 0u) {  // the bin's keys into every CTA's list (at most TIE in the row)
        range_sweep<ALIGNED>(keys, lim, x, nan_low, r_lo, r_hi, [&](int p, u32 u) {
            if (u < l || u > r) return;
            const u32 slot = cl_atomic_add(&s_tn, 0u, 1u);
            if (slot >= (u32)TIE) return;  // never: the bin holds at most TIE keys
            for (int q = 0; q < C; ++q) {
                cl_store(&s_tkey[slot], (u32)q, u);
                cl_store(&s_tpos[slot], (u32)q, (u32)(lo + p));
            }
        });
    }
    const bool any = ra + rt != 0u;
    u32 ta, tt;
    block_excl_scan2<THREADS>(ra, rt, s_scan, ta, tt);  // its barrier orders the local list
    if (multi) {  // this CTA's totals into the higher ranks' slots
        if (tid > (int)rank && tid < C) {
            cl_store(&s_cnt[2 * rank], (u32)tid, ta);
            cl_store(&s_cnt[2 * rank + 1], (u32)tid, tt);
        }
        cl_sync();  // the last remote access: CTAs may leave after it
        for (int q = 0; q < (int)rank; ++q) {
            ra += s_cnt[2 * q];
            rt += s_cnt[2 * q + 1];
        }
    }
    if (listed) {  // block-uniform
        if (!multi) {  // one CTA: the list in position order, each range at its scan offset
            if (mine_t != 0u) {
                u32 slot = rt;
                range_sweep<ALIGNED>(keys, lim, x, nan_low, r_lo, r_hi, [&](int p, u32 u) {
                    if (u < l || u > r || slot >= (u32)TIE) return;
                    s_tkey[slot] = u;
                    s_tpos[slot] = (u32)(lo + p);
                    ++slot;
                });
            }
            __syncthreads();
        }
        // G threads per listed key count the keys ranked before it by (key descending, position
        // ascending) and the positions before it (positions are unique)
        constexpr int G = THREADS / TIE;
        const u32 m = cnt, c = (u32)(tid / G);
        u32 vrank = 0, prank = 0;
        if (c < m) {
            const u32 key = s_tkey[c], pos = s_tpos[c];
            for (u32 j = (u32)(tid % G); j < m; j += G) {
                const u32 kj = s_tkey[j], pj = s_tpos[j];
                vrank += (kj > key || (kj == key && pj < pos)) ? 1u : 0u;
                prank += pj < pos ? 1u : 0u;
            }
        }
#pragma unroll
        for (int d = 1; d < G; d <<= 1) {
            vrank += __shfl_xor_sync(FULL_MASK, vrank, d);
            prank += __shfl_xor_sync(FULL_MASK, prank, d);
        }
        if (c < m && tid % G == 0) s_taken[prank] = vrank < need ? 1u : 0u;
        __syncthreads();
        if (warp == 0) {  // s_before[j]: the selected keys among the first j in position order
            u32 run = 0;
            for (int g = 0; g < TIE; g += 32) {
                const u32 taken = __ballot_sync(FULL_MASK, (u32)(g + lane) < m && s_taken[g + lane] != 0u);
                s_before[g + lane] = run + __popc(taken & ((1u << lane) - 1u));
                run += __popc(taken);
            }
            if (lane == 0) s_before[TIE] = run;
        }
        __syncthreads();
    }
    if (!any) return;
    u32 tb = listed ? s_before[rt < (u32)TIE ? rt : (u32)TIE] : (rt < need ? rt : need);  // taken T before
    auto put = [&](int p, bool is_a) {
        if (is_a) {
            const u32 d = ra + tb;
            if (d < (u32)k) o[d] = out_index<SLOTS>(sc, lo + p);  // always true; guards a broken invariant
            ++ra;
        } else {
            const bool taken = listed ? (rt < (u32)TIE && s_taken[rt] != 0u) : rt < need;
            if (taken) {
                const u32 d = ra + tb;
                if (d < (u32)k) o[d] = out_index<SLOTS>(sc, lo + p);
                ++tb;
            }
            ++rt;
        }
    };
    if (use_mask) {
        for (u32 m = amask | tmask; m != 0u; m &= m - 1u) {
            const int b = __ffs(m) - 1;
            put(r_lo + b, (amask >> b) & 1u);
        }
        return;
    }
    range_sweep<ALIGNED>(keys, lim, x, nan_low, r_lo, r_hi, [&](int p, u32 u) {
        if (u >= l) put(p, u > r);
    });
}

// bit 4 * j + c set for each of thread tid's register slots (group j < J, c < 4: position
// j * 4 * ACT + 4 * tid + c) at a position <= lim (lim >= -1)
template <int J, int ACT>
__device__ __forceinline__ u32 reg_slots_upto(int lim, int tid) {
    u32 m = 0u;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        int r = lim + 1 - (j * 4 * ACT + 4 * tid);
        r = r < 0 ? 0 : (r > 4 ? 4 : r);
        m |= ((1u << r) - 1u) << (4 * j);
    }
    return m;
}

// per group j of a slot mask: its count, two groups per word (16-bit fields)
template <int W>
__device__ __forceinline__ void reg_group_counts(u32 mask, u32 (&v)[W]) {
#pragma unroll
    for (int w = 0; w < W; ++w)
        v[w] = (u32)__popc((mask >> (8 * w)) & 15u) | ((u32)__popc((mask >> (8 * w + 4)) & 15u) << 16);
}

// the 16-bit field j of packed words v
template <int W>
__device__ __forceinline__ u32 reg_field(const u32 (&v)[W], int j) {
    return (v[j >> 1] >> (16 * (j & 1))) & 0xffffu;
}

// exclusive prefix over the ACT threads, in thread order, of packed counts v[w] and the block's
// totals; one barrier (BAR). Each field's prefix and total stay below 2^16. s_scan holds
// W * ACT / 32 words. Every word is scanned, dead groups' zeros too: the warp collectives
// under a block-uniform branch on the live words came out wrong from ptxas's optimizer (right
// at -O0) once the live length reached the body through a select (docs/performance.md)
template <int ACT, int BAR, int W>
__device__ __forceinline__ void reg_packed_scan(const u32 (&v)[W], u32 (&excl)[W], u32 (&total)[W],
                                                u32* s_scan) {
    constexpr int WARPS = ACT / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 incl[W];
#pragma unroll
    for (int w = 0; w < W; ++w) {
        incl[w] = warp_incl_scan(v[w], lane);
        if (lane == 31) s_scan[w * WARPS + warp] = incl[w];
    }
    block_bar<ACT, BAR>();
#pragma unroll
    for (int w = 0; w < W; ++w) {
        const u32 t = lane < WARPS ? s_scan[w * WARPS + lane] : 0u;
        excl[w] = warp_sum(lane < warp ? t : 0u) + incl[w] - v[w];  // warps before
        total[w] = warp_sum(t);
    }
}

// one row of k < n live keys held in registers: C == 1, a row of at most 4 * CLUSTER_UNROLL *
// ACT keys on the first ACT of the CTA's THREADS threads (topk_emu.in_registers); C > 1, this
// CTA's chunk [lo, lo + len) of at most 4 * CLUSTER_UNROLL * THREADS keys, on every thread
// (topk_emu.chunks_in_registers). Active thread t holds the chunk positions
// j * 4 * ACT + 4 * t + c (group j < CLUSTER_UNROLL, c < 4). `first` holds the raw bits of positions
// u * 4 * THREADS + 4 * t + c (C == 1 and a cluster's rank 0; the other ranks load their chunk
// from `x`, its first key); with ACT < THREADS the others hand theirs over through `spare`
// ((THREADS - ACT) * 16 * ACT / THREADS words) and leave after one barrier (BAR: the named
// barrier of the ACT threads). Shared memory: SOLO_WORDS words (C == 1) or 2 * PASS_WORDS, cleared.
// The passes of a one-CTA row (solo_bin) or of a cluster (u >> 21, every CTA's counts added into
// every CTA's totals), then refine passes over the keys of [klo, khi] (a cluster's: each bin's
// counts added at its owner only, cl_find_bin: its bins are many, mostly of one key); a listed
// bin's keys are gathered unordered (into every CTA's list) and ranked by (key, position), and a
// single key value's keys are counted in position order (after the lower ranks' counts): either way the
// last selected key (kv, kp) closes the selection, keys above kv and kv itself at positions up
// to kp. The output order comes from one block scan of the selected keys per (group, thread),
// which is position order, after the lower ranks' totals.
template <int C, int THREADS, int ACT, int BAR, bool ALIGNED, bool SLOTS>
__device__ __forceinline__ void topk_reg_body(const float* __restrict__ x, int n, int lo, int len, int k,
                                              int* __restrict__ o, int nan_low, u32 rank,
                                              const FirstKeys& first, u32* spare, BodyScratch& sc) {
    constexpr bool multi = C > 1;
    constexpr int J = CLUSTER_UNROLL, TIE = multi ? TIE_MAX : SOLO_TIE_MAX, WARPS = ACT / 32, G = ACT / TIE;
    constexpr int W = J / 2, BINS_A = multi ? 2048 : 4096;
    constexpr int R = THREADS / ACT, OWN = J / R;  // OWN: groups of `first` an active thread keeps
    static_assert(ACT % TIE == 0 && G <= 32 && W * WARPS <= (int)(sizeof(sc.scan) / 4), "threads");
    static_assert(THREADS % ACT == 0 && J % R == 0 && J % 2 == 0 && (R == 1) == (BAR == 0), "active threads");
    static_assert(!multi || R == 1, "a cluster's chunk runs on every thread");
    extern __shared__ __align__(16) u32 smem[];
    u32* hist = smem;  // pass A's counts, then a third refine pass's (C == 1), then the listed bin
    u32* hist1 = hist + BINS_A;
    u32* hist2 = hist1 + 2048;
    u32* glob0 = hist2 + (multi ? 1024 : 2048);  // C > 1: the cluster's totals of each pass
    u32* glob1 = glob0 + 2048;
    u32* glob2 = glob1 + 2048;
    u32* s_tkey = hist;
    u32* s_tpos = hist + TIE;
    const int tid = threadIdx.x;
    // active group j is `first` group j / R of thread tid + ACT * (j % R)
    if (R > 1 && tid >= ACT) {
#pragma unroll
        for (int u = 0; u < OWN; ++u)
            reinterpret_cast<uint4*>(spare)[((tid / ACT - 1) * OWN + u) * ACT + tid % ACT] = first.q[u];
    }
    if (tid == 0) sc.tn = 0u;  // (a cluster's list counts on rank 0's)
    constexpr int RANGE_WORDS = (int)(sizeof(sc.rng) / sizeof(u32));  // == sizeof(sc.part) / 4
    if (multi && tid < 2 * RANGE_WORDS)
        (tid < RANGE_WORDS ? &sc.rng[0][0] : &sc.part[0][0])[tid % RANGE_WORDS] = 0u;
    if (multi) cl_arrive();  // after the clears; waited for before the first remote access
    __syncthreads();  // the clears (and the hand-over) before the first add
    if (R > 1 && tid >= ACT) return;
    const int jn = (len + 4 * ACT - 1) / (4 * ACT);  // the groups that hold live keys (block-uniform)
    u32 key[4 * J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        uint4 b = make_uint4(0u, 0u, 0u, 0u);
        if (j < jn) {
            if (multi)
                b = rank == 0u ? first.q[j] : chunk_bits4<ALIGNED>(x, j * 4 * ACT + 4 * tid, len);
            else
                b = j % R == 0 ? first.q[j / R]
                               : reinterpret_cast<const uint4*>(spare)[((j % R - 1) * OWN + j / R) * ACT + tid];
        }
        key[4 * j + 0] = order_key(__uint_as_float(b.x), nan_low);
        key[4 * j + 1] = order_key(__uint_as_float(b.y), nan_low);
        key[4 * j + 2] = order_key(__uint_as_float(b.z), nan_low);
        key[4 * j + 3] = order_key(__uint_as_float(b.w), nan_low);
    }
    const u32 live = reg_slots_upto<J, ACT>(len - 1, tid);
#define REG_POS(i) (((i) >> 2) * 4 * ACT + 4 * tid + ((i) & 3))
// every slot i = 4 * j + c of this thread's live groups, group by group (the dead groups skipped)
#define FOR_GROUP_SLOTS(BODY)                            \
    _Pragma("unroll") for (int j = 0; j < J; ++j) {      \
        if (j >= jn) break;                              \
        _Pragma("unroll") for (int c = 0; c < 4; ++c) {  \
            const int i = 4 * j + c;                     \
            BODY                                         \
        }                                                \
    }
// the slots of this thread in MASK
#define FOR_SLOTS(MASK, BODY) FOR_GROUP_SLOTS(if (((MASK) >> i) & 1u) { BODY })
    // pass A without a branch per key: a dead slot of the live groups counts into bin 0, and
    // thread 0 takes those counts back
    FOR_GROUP_SLOTS(const u32 b = multi ? key[i] >> 21 : solo_bin(key[i]);
                    atomicAdd(&hist[((live >> i) & 1u) ? b : 0u], 1u);)
    if (tid == 0 && jn * 4 * ACT > len) atomicSub(&hist[0], (u32)(jn * 4 * ACT - len));
    block_bar<ACT, BAR>();
    const u32* totals = hist;
    if (multi) {
        cl_wait();
        cl_push_hist<C, THREADS>(hist, glob0, BINS_A);  // (few bins: cheaper than cl_find_bin)
        totals = glob0;
    }
    find_bin<ACT, BAR>(totals, BINS_A, (u32)k, sc.warp, sc.res);
    u32 klo, khi;
    if (multi) {
        klo = sc.res[0] << 21;
        khi = klo | 0x1fffffu;
    } else {
        solo_bin_keys(sc.res[0], klo, khi);
    }
    u32 need = sc.res[1];
    u32 cnt = sc.res[2];

    // refine on the next (at most 11) bits below those klo and khi share (as the one-CTA body)
    for (int pass = 1; cnt != need && cnt > (u32)TIE && klo != khi; ++pass) {
        const int sh = 32 - __clz(klo ^ khi);
        const int bits = sh < 11 ? sh : 11;
        const int dsh = sh - bits;
        const int nbins = 1 << bits;
        const u32 mask = (u32)(nbins - 1), span = khi - klo;
        u32* h = pass == 1 ? hist1 : (pass == 2 ? hist2 : hist);
        if (pass == 3) {  // one CTA only (a cluster's pass A leaves 21 bits: two passes)
            for (int i = tid; i < nbins; i += ACT) h[i] = 0u;
            block_bar<ACT, BAR>();
        }
        FOR_SLOTS(live, if (key[i] - klo <= span) atomicAdd(&h[(key[i] >> dsh) & mask], 1u);)
        block_bar<ACT, BAR>();
        totals = h;
        if (multi) {  // 2048 bins, then 1024 (pass A leaves 21 bits): at least 32 * C
            cl_find_bin<C, THREADS>(h, pass == 1 ? glob1 : glob2, sc.rng[pass - 1], sc.part[pass - 1], bits, need,
                                    sc.warp, sc.res);
        } else {
            find_bin<ACT, BAR>(totals, nbins, need, sc.warp, sc.res);
        }
        const u32 base = sh >= 32 ? 0u : (klo >> sh) << sh;
        const u32 dlo = base | (sc.res[0] << dsh), dhi = dlo | ((1u << dsh) - 1u);
        klo = klo > dlo ? klo : dlo;
        khi = khi < dhi ? khi : dhi;
        need = sc.res[1];
        cnt = sc.res[2];
    }
    // listed: the bin's keys (more than needed, at most TIE) are ranked by (key, position).
    // The selection: keys above kv and kv itself at chunk positions up to kp (the whole bin:
    // kv = klo and every position; a single key value kv = klo, more of it than needed: its
    // need-th position in row order, or none or every one of this chunk's)
    u32 kv = klo;
    int kp = len - 1;
    u32 v[W], excl[W], total[W];
    if (cnt != need && cnt <= (u32)TIE) {  // cluster-uniform
        const u32 span = khi - klo;
        u32 mine = 0u;  // this thread's slots in the bin: one shared add reserves their places
        FOR_SLOTS(live, if (key[i] - klo <= span) mine |= 1u << i;)
        if (mine != 0u) {
            u32 slot = multi ? cl_atomic_add(&sc.tn, 0u, (u32)__popc(mine)) : atomicAdd(&sc.tn, (u32)__popc(mine));
#pragma unroll
            for (int j = 0; j < J; ++j) {
                if (((mine >> (4 * j)) & 15u) == 0u) continue;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int i = 4 * j + c;
                    if (!((mine >> i) & 1u)) continue;
                    if (slot < (u32)TIE) {  // always: the bin holds at most TIE keys
                        if (multi) {  // into every CTA's list
#pragma unroll
                            for (int q = 0; q < C; ++q) {
                                cl_store(&s_tkey[slot], (u32)q, key[i]);
                                cl_store(&s_tpos[slot], (u32)q, (u32)(lo + REG_POS(i)));
                            }
                        } else {
                            s_tkey[slot] = key[i];
                            s_tpos[slot] = (u32)REG_POS(i);
                        }
                    }
                    ++slot;
                }
            }
        }
        if (multi)
            cl_sync();
        else
            block_bar<ACT, BAR>();
        const u32 c = (u32)(tid / G);
        u32 vrank = 0, ck = 0, cp = 0;
        if (c < cnt) {
            ck = s_tkey[c];
            cp = s_tpos[c];
            for (u32 j = (u32)(tid % G); j < cnt; j += G) {
                const u32 kj = s_tkey[j], pj = s_tpos[j];
                vrank += (kj > ck || (kj == ck && pj < cp)) ? 1u : 0u;
            }
        }
#pragma unroll
        for (int d = 1; d < G; d <<= 1) vrank += __shfl_xor_sync(FULL_MASK, vrank, d);
        if (c < cnt && tid % G == 0 && vrank == need - 1u) {
            sc.sel[0] = ck;
            sc.sel[1] = cp;
        }
        block_bar<ACT, BAR>();
        kv = sc.sel[0];
        kp = (int)sc.sel[1] - lo;  // (below 0: none of kv in this chunk)
    } else if (cnt != need) {  // one key value: its need-th key in row order closes
        u32 eq = 0u;
        FOR_SLOTS(live, if (key[i] == kv) eq |= 1u << i;)
        reg_group_counts<W>(eq, v);
        reg_packed_scan<ACT, BAR, W>(v, excl, total, sc.scan);
        u32 want = need;  // this chunk's keys of kv to take
        if (multi) {  // after the lower ranks' (the exchange's odd words)
            const u32 here = (total[0] & 0xffffu) + (total[0] >> 16) + (total[1] & 0xffffu) + (total[1] >> 16);
            if (tid > (int)rank && tid < C) cl_store(&sc.cnt[2 * rank + 1], (u32)tid, here);
            cl_sync();
            u32 before = 0u;
            for (int q = 0; q < (int)rank; ++q) before += sc.cnt[2 * q + 1];
            want = need > before ? (need - before < here ? need - before : here) : 0u;
        }
        u32 run = 0u;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            if (j >= jn) break;
            const u32 before = run + reg_field<W>(excl, j);
            u32 g = (eq >> (4 * j)) & 15u;
            if (before < want && before + (u32)__popc(g) >= want) {  // here: the (want - before)-th
                const u32 r = want - before;  // 1..4
#pragma unroll
                for (u32 q = 1u; q < 4u; ++q)
                    if (q < r) g &= g - 1u;  // drop the lowest set bit
                sc.sel[1] = (u32)(REG_POS(4 * j) + __ffs(g) - 1);
            }
            run += reg_field<W>(total, j);
        }
        block_bar<ACT, BAR>();
        kp = want == 0u ? -1 : (int)sc.sel[1];
    }

    // collect: per group, this thread's selected keys; one block scan in (group, thread) order
    // (after the lower ranks' totals) gives the selected keys before; they go there in position order
    const u32 upto = reg_slots_upto<J, ACT>(kp < len - 1 ? (kp < -1 ? -1 : kp) : len - 1, tid);
    u32 gt = 0u, eq = 0u;
    FOR_GROUP_SLOTS(if (key[i] > kv) gt |= 1u << i; if (key[i] == kv) eq |= 1u << i;)
    const u32 sel = (gt & live) | (eq & upto);
    // SLOTS with pages of at least 4 slots: each selected group's page entry (its 4 positions share
    // a page: lo and 4 * tid are multiples of 4) in flight across the scan, instead of one
    // dependent load a key after it (sc.page_row is set before the first barrier)
    const bool pre = SLOTS && sc.page_bits >= 2;
    int pg[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        pg[j] = 0;
        if (pre && j < jn && ((sel >> (4 * j)) & 15u) != 0u) {
            const int g = (lo + REG_POS(4 * j)) >> sc.page_bits;
            if (g < sc.pages) pg[j] = __ldg(page_row_of(sc) + g);
        }
    }
    reg_group_counts<W>(sel, v);
    reg_packed_scan<ACT, BAR, W>(v, excl, total, sc.scan);
    u32 run = 0u;
    if (multi) {  // this chunk's total into the higher ranks' (even) words; the last remote access
        const u32 here = (total[0] & 0xffffu) + (total[0] >> 16) + (total[1] & 0xffffu) + (total[1] >> 16);
        if (tid > (int)rank && tid < C) cl_store(&sc.cnt[2 * rank], (u32)tid, here);
        cl_sync();  // CTAs may leave after it
        for (int q = 0; q < (int)rank; ++q) run += sc.cnt[2 * q];
    }
    const u32 ra = excl[0], rt = total[0] ^ run;  // the scan's results (the phase cut reads them here)
    (void)ra;
    (void)rt;
    const bool any = sel != 0u;
    if (!any) return;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        if (j >= jn) break;
        u32 d = run + reg_field<W>(excl, j);
        run += reg_field<W>(total, j);
        const u32 g = (sel >> (4 * j)) & 15u;
        if (d + (u32)__popc(g) > (u32)k) continue;  // never: guards a broken invariant
        int* __restrict__ dst = o + d;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            if ((g >> c) & 1u) {
                const int p = lo + REG_POS(4 * j + c);
                // (pre: page_slot's value from the entry loaded before the scan)
                *dst = !pre ? out_index<SLOTS>(sc, p)
                            : count_unmapped(unmapped_of(sc), (p >> sc.page_bits) < sc.pages
                                                                  ? entry_slot(pg[j], sc.page_bits, p) : -1);
                ++dst;
            }
        }
    }
#undef FOR_SLOTS
#undef FOR_GROUP_SLOTS
#undef REG_POS
}

#define WIDE_SPLIT_KEYS (8 * 8192)  // topk.py: WIDE_CLUSTER_MIN_KEYS

// the shared-memory body of a row split over 8 or 16 CTAs, compiled out of line: those launches
// run it only for chunks longer than the registers hold (rows past 128K or 256K keys), and the
// register body every shorter row runs is faster without it inline (docs/performance.md). Inline
// stays for 2 and 4 CTAs, whose 64K-128K rows run this body
template <int C, int THREADS, bool ALIGNED, bool SLOTS>
__device__ __noinline__ void split_smem_row(const float* __restrict__ x, int n, int k, int* __restrict__ o,
                                            int nan_low, int cap, u32 rank, FirstKeys first,
                                            BodyScratch& sc) {
    topk_cluster_body<C, THREADS, ALIGNED, false, SLOTS>(x, n, k, o, nan_low, cap, rank, first, sc);
}

// a row of n live keys (more than SOLO_MAX or than cap) split over the C CTAs of this cluster:
// a row whose chunks fit the registers runs from them on every CTA of a 1024-thread launch
// (topk_emu.chunks_in_registers; 512 threads have 64 registers each)
template <int C, int THREADS, bool ALIGNED, bool SLOTS>
__device__ __forceinline__ void cluster_split_row(const float* __restrict__ x, int n, int k, int* __restrict__ o,
                                                  int nan_low, int cap, u32 rank, const FirstKeys& first,
                                                  BodyScratch& sc) {
    constexpr int REG_MAX = 4 * CLUSTER_UNROLL * THREADS;
    const int chunk = ((n + C - 1) / C + 3) & ~3;  // topk_emu.cluster_chunks
    if (THREADS == 1024 && chunk <= REG_MAX) {  // cluster-uniform
        const int lo = (int)rank * chunk;
        const int len = n - lo < 0 ? 0 : (n - lo > chunk ? chunk : n - lo);
        topk_reg_body<C, THREADS, THREADS, 0, ALIGNED, SLOTS>(x + lo, n, lo, len, k, o, nan_low, rank, first, nullptr,
                                                             sc);
        return;
    }
    if constexpr (C >= 8)
        split_smem_row<C, THREADS, ALIGNED, SLOTS>(x, n, k, o, nan_low, cap, rank, first, sc);
    else
        topk_cluster_body<C, THREADS, ALIGNED, false, SLOTS>(x, n, k, o, nan_low, cap, rank, first, sc);
}

// zero the first QUADS 16-byte words of smem
template <int QUADS, int THREADS>
__device__ __forceinline__ void clear_quads(u32* smem, int tid) {
#pragma unroll
    for (int r = 0; r < (QUADS + THREADS - 1) / THREADS; ++r) {
        const int i = tid + r * THREADS;
        if (QUADS % THREADS == 0 || i < QUADS) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0u, 0u, 0u, 0u);
    }
}

template <int C, int THREADS, bool ALIGNED, bool SLOTS>
__device__ __forceinline__ void topk_cluster_row(const float* __restrict__ logits, i64 stride_r,
                                                 const void* lens, int lens64, const void* active,
                                                 int active64, int sel_width, int k,
                                                 int* __restrict__ out, i64 stride_o, int nan_low,
                                                 int cap, int lens_early, const int* page_table,
                                                 i64 page_stride, int page_bits, int pages,
                                                 u32* unmapped = nullptr) {
    extern __shared__ __align__(16) u32 smem[];
    const int row = blockIdx.y;
    const u32 rank = (C == 1) ? 0u : cl_rank();
    const int tid = threadIdx.x;
    int* __restrict__ o = out + (i64)row * stride_o;
    const float* __restrict__ x = logits + (i64)row * stride_r;

    // shared memory only: may overlap the previous kernel (programmatic dependent launch). A
    // one-CTA 512-thread launch clears after issuing its first loads instead: its four stores a
    // thread would queue ahead of them (docs/performance.md)
    constexpr int words = C == 1 ? SOLO_WORDS : 2 * PASS_WORDS;  // hist.., glob..
    constexpr int quads = words / 4;
    constexpr bool clear_late = C == 1 && THREADS == 512;
    if (!clear_late) clear_quads<quads, THREADS>(smem, tid);
    // lens_early: the live length is read before the wait, its round trip beside the previous
    // kernel's end (the host passes it where no kernel since the previous one began wrote the
    // lengths: a step's scorer). Every other global read and write comes after that kernel's
    const int n_early = lens_early ? live_length(lens, lens64, active, active64, row, sel_width) : 0;
    grid_dependency_wait();
#if TOPK_TRIGGER
    // the next kernel, where it is a programmatic dependent launch (the next step's CUDA scorer),
    // may launch now, once every kernel before this one has completed (as the scorer does)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

    __shared__ BodyScratch sc;
    FirstKeys first;
    constexpr int REG_MAX = 4 * CLUSTER_UNROLL * THREADS;  // the longest row held in registers
    if (C == 1 || rank == 0u) {  // the first keys beside the live length (the host width is readable)
        const int spec = sel_width < REG_MAX ? sel_width : REG_MAX;
#pragma unroll
        for (int u = 0; u < CLUSTER_UNROLL; ++u) {
            const int p = tid * 4 + u * THREADS * 4;
            first.q[u] = p < spec ? chunk_bits4<ALIGNED>(x, p, spec) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    const int n = lens_early ? n_early : live_length(lens, lens64, active, active64, row, sel_width);
    if (clear_late) clear_quads<quads, THREADS>(smem, tid);  // (the body's first barrier follows)
    const int* page_row = SLOTS ? page_table + (i64)row * page_stride : nullptr;
    if (SLOTS && tid == 0) {  // after the first loads; read at the write, past the body's first barrier
        sc.page_row[0] = (u32)reinterpret_cast<unsigned long long>(page_row);
        sc.page_row[1] = (u32)(reinterpret_cast<unsigned long long>(page_row) >> 32);
        sc.page_bits = page_bits;
        sc.pages = pages;
        sc.unmapped[0] = (u32)reinterpret_cast<unsigned long long>(unmapped);
        sc.unmapped[1] = (u32)(reinterpret_cast<unsigned long long>(unmapped) >> 32);
    }
    if (n <= k) {  // cluster-uniform: no CTA reaches a cluster barrier
        for (int i = (int)rank * THREADS + tid; i < k; i += C * THREADS) {
            o[i] = i >= n ? -1 : (SLOTS ? count_unmapped(unmapped, page_slot(page_row, page_bits, pages, i)) : i);
        }
        return;
    }
    // a row of at most REG_MAX keys runs from registers on rank 0 (topk_emu.in_registers),
    // whatever the bound
    if (n <= REG_MAX) {  // cluster-uniform; no cluster barrier follows
        u32* spare = smem + (C == 1 ? SOLO_WORDS : 2 * PASS_WORDS);  // the keys' words
        constexpr int ACT = SHORT_ACT < THREADS ? SHORT_ACT : THREADS;
        if (rank == 0u) {
            if (ACT < THREADS && n <= 4 * CLUSTER_UNROLL * ACT)
                topk_reg_body<1, THREADS, ACT, (ACT < THREADS ? 1 : 0), ALIGNED, SLOTS>(x, n, 0, n, k, o, nan_low, 0u,
                                                                                     first, spare, sc);
            else
                topk_reg_body<1, THREADS, THREADS, 0, ALIGNED, SLOTS>(x, n, 0, n, k, o, nan_low, 0u, first, spare,
                                                                      sc);
        }
        return;
    }
    if (C == 1) {
        topk_cluster_body<1, THREADS, ALIGNED, true, SLOTS>(x, n, k, o, nan_low, cap, 0u, first, sc);
        return;
    }
    // a short row runs on rank 0 alone, as with one CTA per row (topk_emu.cluster_split)
    if (n <= SOLO_MAX && n <= cap) {  // cluster-uniform; no barrier or remote access follows
        if (rank == 0u) topk_cluster_body<1, THREADS, ALIGNED, false, SLOTS>(x, n, k, o, nan_low, cap, 0u, first, sc);
        return;
    }
    // 16 CTAs split only a row of more than WIDE_SPLIT_KEYS live keys; a shorter one runs on the
    // first 8, as a cluster of 8 (topk_emu.split_ctas). The other 8 leave now: the cluster
    // barriers of the first 8 wait only for threads that have not exited, and none of the 8
    // reaches the shared memory of a rank past 7
    if (C == 16 && n <= WIDE_SPLIT_KEYS) {  // cluster-uniform
        if (rank < 8u) cluster_split_row<8, THREADS, ALIGNED, SLOTS>(x, n, k, o, nan_low, cap, rank, first, sc);
        return;
    }
    cluster_split_row<C, THREADS, ALIGNED, SLOTS>(x, n, k, o, nan_low, cap, rank, first, sc);
}

// one CTA a row launches plainly, without a cluster attribute (measured as fast or faster at
// every one-CTA shape: docs/performance.md)
#define CLUSTER_ATTR_1
#define CLUSTER_ATTR_2 __cluster_dims__(2, 1, 1)
#define CLUSTER_ATTR_4 __cluster_dims__(4, 1, 1)
#define CLUSTER_ATTR_8 __cluster_dims__(8, 1, 1)
#define CLUSTER_ATTR_16 __cluster_dims__(16, 1, 1)
// one entry of the row (SLOTS: writing slots through the page table, its own code; the positions
// entry takes the same parameters and leaves the page-table ones unread)
#define TOPK_CLUSTER_ENTRY(C, T, A, SUF, SLOTS)                                                    \
    extern "C" __global__ void CLUSTER_ATTR_##C __launch_bounds__(T, 1024 / (T))                  \
        topk_cluster_c##C##_t##T##_a##A##SUF(const float* __restrict__ logits, i64 stride_r,      \
                                        const void* lens, int lens64, const void* active,          \
                                        int active64, int sel_width, int k,                        \
                                        int* __restrict__ out, i64 stride_o, int nan_low,          \
                                        int cap, int lens_early, const int* page_table,            \
                                        i64 page_stride, int page_bits, int pages) {               \
        topk_cluster_row<C, T, (A) != 0, SLOTS>(logits, stride_r, lens, lens64, active, active64,  \
                                                sel_width, k, out, stride_o, nan_low, cap,         \
                                                lens_early, page_table, page_stride, page_bits,    \
                                                pages);                                            \
    }
// a slots entry: the positions entry's parameters, then the counter of selected positions written
// as -1 (null: not counted)
#define TOPK_SLOTS_ENTRY(C, T, A)                                                                  \
    extern "C" __global__ void CLUSTER_ATTR_##C __launch_bounds__(T, 1024 / (T))                  \
        topk_cluster_c##C##_t##T##_a##A##_slots(const float* __restrict__ logits, i64 stride_r,   \
                                        const void* lens, int lens64, const void* active,          \
                                        int active64, int sel_width, int k,                        \
                                        int* __restrict__ out, i64 stride_o, int nan_low,          \
                                        int cap, int lens_early, const int* page_table,            \
                                        i64 page_stride, int page_bits, int pages,                 \
                                        u32* unmapped) {                                           \
        topk_cluster_row<C, T, (A) != 0, true>(logits, stride_r, lens, lens64, active, active64,   \
                                               sel_width, k, out, stride_o, nan_low, cap,          \
                                               lens_early, page_table, page_stride, page_bits,     \
                                               pages, unmapped);                       \
    }
// the library's module holds the positions entries; the slots module (compiled with
// TOPK_SLOTS_MODULE=1, on a page table's first use) the slots entries, so that a launch without
// page tables never pays their compile
#if TOPK_SLOTS_MODULE
#define TOPK_CLUSTER_KERNEL(C, T, A) TOPK_SLOTS_ENTRY(C, T, A)
#else
#define TOPK_CLUSTER_KERNEL(C, T, A) TOPK_CLUSTER_ENTRY(C, T, A, , false)
#endif

TOPK_CLUSTER_KERNEL(1, 1024, 1)
TOPK_CLUSTER_KERNEL(1, 1024, 0)
TOPK_CLUSTER_KERNEL(2, 1024, 1)
TOPK_CLUSTER_KERNEL(2, 1024, 0)
TOPK_CLUSTER_KERNEL(4, 1024, 1)
TOPK_CLUSTER_KERNEL(4, 1024, 0)
TOPK_CLUSTER_KERNEL(8, 1024, 1)
TOPK_CLUSTER_KERNEL(8, 1024, 0)
TOPK_CLUSTER_KERNEL(16, 1024, 1)  // non-portable: the host allows it where the device can
TOPK_CLUSTER_KERNEL(16, 1024, 0)
TOPK_CLUSTER_KERNEL(1, 512, 1)
TOPK_CLUSTER_KERNEL(1, 512, 0)
TOPK_CLUSTER_KERNEL(2, 512, 1)
TOPK_CLUSTER_KERNEL(2, 512, 0)
TOPK_CLUSTER_KERNEL(4, 512, 1)
TOPK_CLUSTER_KERNEL(4, 512, 0)
TOPK_CLUSTER_KERNEL(8, 512, 1)
TOPK_CLUSTER_KERNEL(8, 512, 0)
TOPK_CLUSTER_KERNEL(16, 512, 1)
TOPK_CLUSTER_KERNEL(16, 512, 0)

#endif  // sm_90+
