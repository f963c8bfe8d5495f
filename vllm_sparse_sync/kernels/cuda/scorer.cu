// CUDA paged indexer scorer for sm_90a: logit[r, t] = k_scale[t] * sum_h w[r, h] * relu(q[r, h] . k[t]).
//
// Compiled at run time by NVRTC (kernels/cuda/scorer.py); the torch reference
// (kernels/reference.paged_indexer_logits) is its specification. Same grid and contract as the
// Triton scorer (kernels/triton/scorer.py): program (row, split) of a (rows, splits) grid scores the
// 64-token tiles split, split + splits, ... of its row up to the row's device length n; a
// position t < n is -inf where t >= live_width or its page id lies outside [0, num_pages);
// positions at or past n are not written (with fill_width > n: -inf up to fill_width).
//
// One CTA an SM: CONSUMERS warpgroups (64 tokens per tile each) and one producer warp.
//   pages     ISSUE_LANES lanes of the producer warp copy one tile each at a time (8448 bytes:
//             8 KB of keys, then 256 B of scales) into a ring of shared-memory slots
//             (see "rings" below) with the bulk copy
//             engine (cp.async.bulk, completion on the slot's full mbarrier), as far ahead as
//             the ring allows; a slot is refilled once the four warps that read it have arrived
//             on its empty mbarrier. The copies mark their L2 lines evict-first: a page is read
//             once a step, and the logits the top-k reads next stay in L2 (docs/performance.md).
//             The producer fetches the page ids 32 tiles ahead and issues
//             the first tiles before the CTA's one barrier. Past it no warp waits for the CTA.
//   rings     a kernel holds STAGES slots (STAGES_SHORT or STAGES_DEEP); a program runs all of
//             them where it has at least deep_tiles live tiles (from the device length, so the
//             host bound does not choose), else the first STAGES_SHORT: a deep ring measured
//             faster only where a program has many tiles.
//   tiles     tile it of the program is consumer warpgroup it % CONSUMERS's; each warpgroup
//             cycles through its own slots of the program's ring (slot_of).
//   scoring   the row's query, converted once into the wgmma B operand in shared memory (one
//             image for every warpgroup, its k-steps' descriptors made once a program); each
//             consumer thread holds its heads' weights in registers; per tile each thread loads
//             32 key bytes of each of its two token rows (two 16-byte shared loads a row), which
//             are the wgmma A operand in registers (PRECISE: each e4m3 pair converted to f16x2,
//             exact); H/8 x (8 k16 steps f16 | 4 k32 steps e4m3) wgmma with fp32 accumulators;
//             then relu, the head weights, the quad's sum, the token's scale, one store per token.
//   K order   a sum over k does not depend on the order of its terms: thread (g, c) of a warp
//             holds key bytes 32c .. 32c + 31 of its rows, and the B operand is the query with
//             its dimensions permuted the same way (phys_dim below), so each thread's key bytes
//             are contiguous in shared memory.
// Launch: a programmatic dependent launch where the host asks (KernelConfig.pdl): every CTA first waits
// for the stream's previous kernel (griddepcontrol.wait), then lets its own dependents launch.
// Exactness: the PRECISE products are exact (e4m3 -> f16 is exact), sums in fp32 (as the Triton
// scorer's fp16 dot); the e4m3 tensor-core path accumulates with ~14 mantissa bits (as DeepGEMM).
// A NaN dot counts as 0 (maxNum relu); a NaN score is written as a negative NaN (its sortable key
// lies below -inf's), as the Triton scorer does.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#ifndef STAGES_DEEP
#define STAGES_DEEP 24   // the deep ring (programs of at least deep_tiles live tiles)
#endif
#ifndef STAGES_SHORT
#define STAGES_SHORT 12  // the ring every call runs with by default
#endif
#ifndef CONSUMERS
#define CONSUMERS 4
#endif
#define PAGE 64
#define HEAD_DIM 128
#define KEY_BYTES (PAGE * HEAD_DIM)           // a page's keys: 8192 bytes
#define SCALE_BYTES (PAGE * 4)                // then its 64 fp32 scales
#define SLOT_BYTES (KEY_BYTES + SCALE_BYTES)  // 8448, a multiple of 16
#ifndef PROXY_FENCE
#define PROXY_FENCE 0  // 1: a generic-to-async proxy fence before each refill (the empty mbarrier's
#endif                 // release and acquire already order the consumers' reads before the copy)
#ifndef PDL_WAIT
#define PDL_WAIT 1  // tests only: 0 plants a scorer that touches memory before the previous kernel is done
#endif
#ifndef RING_STRESS_NS
#define RING_STRESS_NS 0  // tests only: > 0 sleeps producer lanes and consumers pseudo-randomly, up to
#endif                    // this many ns a tile, so the ring runs under shuffled timings
#ifndef ISSUE_LANES
#define ISSUE_LANES CONSUMERS  // producer lanes issuing copies at once: one tile of each consumer
#endif
#define THREADS (CONSUMERS * 128 + 32)  // the consumer warpgroups, then the producer warp
#define PRODUCER_WARP (CONSUMERS * 4)

// Tile it of a program is consumer warpgroup (it % CONSUMERS)'s; each consumer cycles through
// its own `per_consumer` slots of the ring, so a slot's uses are one warpgroup's tiles in its
// order and its full barrier is never two phases behind the tile a consumer waits for.
__device__ __forceinline__ int slot_of(int it, int per_consumer) {
    return it % CONSUMERS + CONSUMERS * ((it / CONSUMERS) % per_consumer);
}

// RING_STRESS_NS > 0: a pseudo-random pause of up to RING_STRESS_NS ns (a quarter of the calls
// none) for tile `it` of this program at point `salt`
__device__ __forceinline__ void stress_pause(int it, u32 salt) {
#if RING_STRESS_NS > 0
    u32 h = (u32)it * 0x9E3779B1u ^ blockIdx.x * 0x85EBCA77u ^ blockIdx.y * 0xC2B2AE3Du ^ salt * 0x27D4EB2Fu;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    if (h & 3u) __nanosleep((h >> 8) % (u32)RING_STRESS_NS);
#endif
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// RING_STRESS_NS > 0 (tests): a wait that has not ended after 2 s traps, so a deadlocked ring
// fails its launch instead of hanging the test
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
#if RING_STRESS_NS > 0
    u64 since = 0;
#endif
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
#if RING_STRESS_NS > 0
        if (!done) {
            u64 now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (since == 0) since = now;
            else if (now - since > 2000000000ull) __trap();
        }
#endif
    } while (!done);
}

#ifndef KEYS_EVICT_FIRST
#define KEYS_EVICT_FIRST 1  // the pages' copies mark their L2 lines evict-first (0: L2's default)
#endif

__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
#if KEYS_EVICT_FIRST
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
#endif
}

// four e4m3 as two f16x2: bytes 0, 1 -> lo, bytes 2, 3 -> hi (the lower byte in the lower half).
// volatile: the A operand's conversions stay before the wgmma fence that orders them
__device__ __forceinline__ void f16x4_of_e4m3x4(u32 four, u32& lo, u32& hi) {
    asm volatile("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
                 : "=r"(lo), "=r"(hi)
                 : "r"(four));
}

__device__ __forceinline__ i64 load_int(const void* p, int is64, i64 i) {
    return is64 ? ((const i64*)p)[i] : (i64)((const int*)p)[i];
}

// The query dimension held at logical position kl of k-step j (see "K order" above).
//   PRECISE (k16 steps): phys = 32c + 4j + 2hi + e for kl = 8hi + 2c + e
//   e4m3    (k32 steps): phys = 32c + 8j + 4hi + e for kl = 16hi + 4c + e

// wgmma B operand (the query) in shared memory, K-major, no swizzle: core matrices of 8 heads x
// 16 bytes, 128 bytes each; the two (PRECISE) or two (e4m3) core matrices of a k-step along K are
// LBO = 128 bytes apart, the H/8 along N SBO = 256 bytes apart; a k-step takes H * 32 bytes.
__device__ __forceinline__ u64 b_desc(u32 addr) {
    return (u64)((addr >> 4) & 0x3FFF) | ((u64)(128 >> 4) << 16) | ((u64)(256 >> 4) << 32);
}

// One wgmma of a k-step, A from registers, B from the descriptor; accumulate = 0 starts the sum.
// The e4m3 forms take no transpose flag (TAIL), the f16 forms a 0 (B is K-major).
#define ACC16(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),           \
    "+f"(d[14]), "+f"(d[15])
#define ACC32(d) ACC16(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
    "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),             \
    "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
// after N accumulators: a0..a3, the descriptor, the predicate; and the accumulate flag's operand
#define OPS16 "{%16, %17, %18, %19}, %21, p"
#define FLAG16 "%20"
#define OPS32 "{%32, %33, %34, %35}, %37, p"
#define FLAG32 "%36"

template <int N, bool PRECISE>
struct Mma;

#define MMA(N, P, INSTR, TAIL, DREGS, OPS, FLAG, ACC)                                                   \
    template <>                                                                                     \
    struct Mma<N, P> {                                                                              \
        __device__ __forceinline__ static void run(float (&d)[N / 2], u32 a0, u32 a1, u32 a2, u32 a3, \
                                                   u64 desc, u32 accumulate) {                      \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FLAG ", 0;\n" INSTR " " DREGS ", " OPS  \
                         ", 1, 1" TAIL ";\n}\n"                                                     \
                         : ACC(d)                                                                   \
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(accumulate), "l"(desc));         \
        }                                                                                           \
    };

MMA(64, true, "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16", ", 0", D32, OPS32, FLAG32, ACC32)
MMA(64, false, "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", "", D32, OPS32, FLAG32, ACC32)
MMA(32, true, "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16", ", 0", D16, OPS16, FLAG16, ACC16)
MMA(32, false, "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3", "", D16, OPS16, FLAG16, ACC16)

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {  // no read of d moves above a wait
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Query word gi (4 e4m3 bytes: head gi / 32, physical dims p .. p + 3) into the B operand image.
template <int H, bool PRECISE>
__device__ __forceinline__ void put_query_word(unsigned char* qimg, int gi, u32 v) {
    constexpr int STEP_BYTES = H * HEAD_DIM * (PRECISE ? 2 : 1) / (PRECISE ? 8 : 4);
    const int h = gi / (HEAD_DIM / 4);
    const int p = (gi % (HEAD_DIM / 4)) * 4;
    const int cq = p / 32;
    const int core = (h / 8) * 256 + (h % 8) * 16;
    if (PRECISE) {  // j = (p % 32) / 4; dims (p, p+1) -> kl 2c, 2c+1; (p+2, p+3) -> kl 2c+8, 2c+9
        const int j = (p % 32) / 4;
        unsigned char* base = qimg + j * STEP_BYTES + core;
        u32 lo, hi;
        f16x4_of_e4m3x4(v, lo, hi);
        *reinterpret_cast<u32*>(base + (2 * cq) * 2) = lo;
        *reinterpret_cast<u32*>(base + 128 + (2 * cq) * 2) = hi;
    } else {  // j = (p % 32) / 8, hi = (p % 8) / 4: dims p .. p+3 -> kl 16hi + 4c .. + 3
        const int j = (p % 32) / 8;
        const int hi = (p % 8) / 4;
        *reinterpret_cast<u32*>(qimg + j * STEP_BYTES + core + hi * 128 + 4 * cq) = v;
    }
}

// A thread's share of a tile: 32 key bytes of each of its rows m0, m0 + 8 (bytes 32c ..), their scales.
struct TileRegs {
    u32 k0[8], k1[8];
    float sc0, sc1;
};

// One warp's reads of a tile from `slot` (16-byte loads in row order: rows g and g + 1 share banks
// for one extra wavefront a load, measured cheaper than the register moves that avoid it); the warp
// then arrives on the slot's empty barrier.
__device__ __forceinline__ void load_tile(const unsigned char* slot, u32 empty_bar, int m0, int c, int lane,
                                          TileRegs& r) {
    const uint4 lo0 = *reinterpret_cast<const uint4*>(slot + m0 * HEAD_DIM + 32 * c);
    const uint4 hi0 = *reinterpret_cast<const uint4*>(slot + m0 * HEAD_DIM + 32 * c + 16);
    const uint4 lo1 = *reinterpret_cast<const uint4*>(slot + (m0 + 8) * HEAD_DIM + 32 * c);
    const uint4 hi1 = *reinterpret_cast<const uint4*>(slot + (m0 + 8) * HEAD_DIM + 32 * c + 16);
    r.sc0 = reinterpret_cast<const float*>(slot + KEY_BYTES)[m0];
    r.sc1 = reinterpret_cast<const float*>(slot + KEY_BYTES)[m0 + 8];
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar);  // this warp has read the slot
    const u32 k0[8] = {lo0.x, lo0.y, lo0.z, lo0.w, hi0.x, hi0.y, hi0.z, hi0.w};
    const u32 k1[8] = {lo1.x, lo1.y, lo1.z, lo1.w, hi1.x, hi1.y, hi1.z, hi1.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) r.k0[j] = k0[j], r.k1[j] = k1[j];
}

// The A operand of every k-step from a thread's key words (wgmma reads registers that other
// instructions wrote only across a wgmma.fence, which mma_issue puts after this).
template <bool PRECISE>
__device__ __forceinline__ void a_operand(const TileRegs& r, u32 (&a)[16], u32 (&b)[PRECISE ? 16 : 1]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (PRECISE) {  // k16 step j: rows m0, m0 + 8 at kl 2c, 2c+1 (a0, a1), 2c+8, 2c+9 (a2, a3)
            f16x4_of_e4m3x4(r.k0[j], a[2 * j], b[2 * j]);
            f16x4_of_e4m3x4(r.k1[j], a[2 * j + 1], b[2 * j + 1]);
        } else {
            a[2 * j] = r.k0[j];
            a[2 * j + 1] = r.k1[j];
        }
    }
}

// The tile's wgmma group against the query image whose first k-step's descriptor is desc0 (made
// once a program) into d: issued and committed, not waited.
template <int H, bool PRECISE>
__device__ __forceinline__ void mma_issue(float (&d)[H / 2], const u32 (&a)[16], const u32 (&b)[PRECISE ? 16 : 1],
                                          u64 desc0) {
    constexpr int STEPS = PRECISE ? 8 : 4;
    constexpr int STEP_BYTES = H * HEAD_DIM * (PRECISE ? 2 : 1) / STEPS;
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < STEPS; ++j) {
        // step j's: its address field (bits 0-13, 16-byte units) moved on, no carry out below 256 KB
        const u64 desc = desc0 + (u64)((j * STEP_BYTES) >> 4);
        if (PRECISE) {
            Mma<H, true>::run(d, a[2 * j], a[2 * j + 1], b[2 * j], b[2 * j + 1], desc, j > 0);
        } else {  // k32 step j: rows m0, m0 + 8 at kl 4c .. (words 2j), 16 + 4c .. (words 2j + 1)
            Mma<H, false>::run(d, a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3], desc, j > 0);
        }
    }
    wgmma_commit();
}

// relu, the head weights, the quad's sum, the token's scale; positions t * PAGE .. of out_row
// below n written (-inf where !ok or past n_live). d[4i + 0/1]: row m0, heads 8i + 2c, 8i + 2c + 1;
// d[4i + 2/3]: row m0 + 8; w_reg[2i], w_reg[2i + 1]: those heads' weights.
template <int H>
__device__ __forceinline__ void store_scores(const float (&d)[H / 2], const float (&w_reg)[H / 4],
                                             float sc0, float sc1, int ok, float* __restrict__ out_row, int t,
                                             int n, int n_live, int m0, int c) {
    float s0 = 0.0f, s1 = 0.0f, t0 = 0.0f, t1 = 0.0f;  // two chains a row
#pragma unroll
    for (int i = 0; i < H / 8; ++i) {  // heads 8i + 2c, 8i + 2c + 1 (the thread's columns)
        s0 = fmaf(fmaxf(d[4 * i], 0.0f), w_reg[2 * i], s0);
        t0 = fmaf(fmaxf(d[4 * i + 1], 0.0f), w_reg[2 * i + 1], t0);
        s1 = fmaf(fmaxf(d[4 * i + 2], 0.0f), w_reg[2 * i], s1);
        t1 = fmaf(fmaxf(d[4 * i + 3], 0.0f), w_reg[2 * i + 1], t1);
    }
    s0 += t0;
    s1 += t1;
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if (c < 2) {  // lane c = 0 writes row m0, c = 1 row m0 + 8
        const int m = c == 0 ? m0 : m0 + 8;
        const int pos = t * PAGE + m;
        float v = (c == 0 ? s0 : s1) * (c == 0 ? sc0 : sc1);
        if (v != v) v = __uint_as_float(__float_as_uint(v) | 0x80000000u);
        if (!ok || pos >= n_live) v = __uint_as_float(0xff800000u);  // -inf
        if (pos < n) out_row[pos] = v;
    }
}

// A consumer's wait for its tile it: the slot's full barrier at that use's parity; the slot.
__device__ __forceinline__ int wait_tile(u64* full, int it, int per_consumer) {
    const int s = slot_of(it, per_consumer);
    stress_pause(it, 2);
    mbar_wait(smem_addr(&full[s]), ((it / CONSUMERS) / per_consumer) & 1);
    return s;
}

template <int H, bool PRECISE, int STAGES>
__device__ __forceinline__ void score_row(
    const unsigned char* __restrict__ q, const float* __restrict__ w, const unsigned char* __restrict__ kc,
    const void* bt, int bt64, i64 bt_stride, const void* lens, int lens64, const void* active, int active64,
    float* __restrict__ out, i64 out_stride, int num_pages, i64 page_stride, int sel_width, int live_width,
    int fill_width, int launch_dependents, int deep_tiles) {
    constexpr int QBYTES = H * HEAD_DIM * (PRECISE ? 2 : 1);  // the B operand image
    constexpr int QGROUPS = H * (HEAD_DIM / 4);               // 4-byte query groups
    constexpr int QWORDS = (QGROUPS + THREADS - 1) / THREADS; // per thread
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char* qimg = smem;                                       // QBYTES
    unsigned char* slots = smem + QBYTES;                             // STAGES * SLOT_BYTES
    u64* full = reinterpret_cast<u64*>(slots + STAGES * SLOT_BYTES);  // [STAGES]: a page landed
    u64* empty = full + STAGES;                                       // [STAGES]: its warpgroup read it
    float* w_img = reinterpret_cast<float*>(empty + STAGES);          // the row's head weights [H]
    int* slot_ok = reinterpret_cast<int*>(w_img + H);                 // [STAGES]
    static_assert((QBYTES + STAGES * SLOT_BYTES) % 16 == 0, "the barriers and the weights' float2 reads");
    static_assert(STAGES % CONSUMERS == 0 && STAGES_SHORT % CONSUMERS == 0, "each consumer owns its ring's slots / CONSUMERS");
    static_assert(32 % ISSUE_LANES == 0 && ISSUE_LANES <= (STAGES < STAGES_SHORT ? STAGES : STAGES_SHORT), "a group of issued tiles shares one page-id load");

    // a programmatic dependent launch (the host's KernelConfig.pdl) waits here for the stream's previous
    // kernel to complete (a no-op otherwise): nothing global is read or written before it. Only
    // then are the dependents let launch, so a dependent that reads before its own wait (the
    // top-k's live lengths) sees every write of the kernels before this one
#if PDL_WAIT
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (launch_dependents) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int row = blockIdx.x;
    const int split = blockIdx.y;
    const int splits = gridDim.y;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const bool producer = warp == PRODUCER_WARP;

    // every global read that does not depend on the row's length is issued beside it: the
    // producer's first 32 page ids (lane l: the l-th tile of this program, within the table and
    // the host width), every thread's query words, every consumer's head weights
    const unsigned char* bt_row = (const unsigned char*)bt + (i64)row * bt_stride * (bt64 ? 8 : 4);
    const int width_tiles = ((sel_width < live_width ? sel_width : live_width) + PAGE - 1) / PAGE;
    int pages_now = -1, pages_next = -1;
    if (producer) {
        const int t = split + lane * splits;
        if (t < width_tiles) pages_now = (int)load_int(bt_row, bt64, t);
    }
    const unsigned char* q_row = q + (i64)row * (H * HEAD_DIM);
    u32 qw[QWORDS];
#pragma unroll
    for (int i = 0; i < QWORDS; ++i) {
        const int gi = tid + i * THREADS;
        qw[i] = gi < QGROUPS ? *reinterpret_cast<const u32*>(q_row + 4 * gi) : 0u;
    }
    const int g = lane >> 2, c = lane & 3;
    const float w_mine = tid < H ? w[(i64)row * H + tid] : 0.0f;
    // min(row_len, sel_width, active[0]): both reads in flight together (without an active
    // width the second reads the row's length again, which clamps nothing)
    const bool has_active = active != nullptr;
    i64 n64 = load_int(lens, lens64, row);
    i64 a = load_int(has_active ? active : lens, has_active ? active64 : lens64, has_active ? 0 : row);
    n64 = n64 < 0 ? 0 : (n64 > sel_width ? sel_width : n64);
    a = a < 0 ? 0 : a;
    const int n = (int)(n64 > a ? a : n64);
    const int n_live = n < live_width ? n : live_width;
    const int n_tiles = (n + PAGE - 1) / PAGE;
    const int my_tiles = split < n_tiles ? (n_tiles - split + splits - 1) / splits : 0;
    float* __restrict__ out_row = out + (i64)row * out_stride;
    const bool fills = fill_width > n && (n / PAGE + split) * PAGE < fill_width;
    if (my_tiles == 0 && !fills) return;  // CTA-uniform: no barrier was reached
    // the program's ring (CTA-uniform): every slot for many live tiles, else the short ring's
    constexpr int SHORT = STAGES < STAGES_SHORT ? STAGES : STAGES_SHORT;
    const int per_consumer = (my_tiles >= deep_tiles ? STAGES : SHORT) / CONSUMERS;

    // tile `it` into slot slot_of(it, per_consumer) once the warpgroup that read the slot's previous
    // tile has arrived on its empty barrier (the page id comes by shuffle from lane it % 32); the
    // producer's lanes 0 .. ISSUE_LANES - 1 issue the tiles base .. base + ISSUE_LANES - 1
    auto issue = [&](int base) {
        if (base > 0 && base % 32 == 0) {  // the next 32 page ids, and a load of the 32 after them
            pages_now = pages_next;
            const int t = split + (base + 32 + lane) * splits;
            pages_next = (base + 32 < my_tiles && t < width_tiles) ? (int)load_int(bt_row, bt64, t) : -1;
        }
        const int it = base + lane;  // lanes 0 .. ISSUE_LANES - 1 issue one tile each
        const int page = __shfl_sync(0xffffffffu, pages_now, it % 32);
        if (lane < ISSUE_LANES && it < my_tiles) {
            const int j = it / CONSUMERS;  // the consumer's own tile count, and its slot's use
            const int s = slot_of(it, per_consumer);
            stress_pause(it, 1);
            if (j >= per_consumer) mbar_wait(smem_addr(&empty[s]), ((j / per_consumer) - 1) & 1);
            const int t = split + it * splits;
            const bool ok = t * PAGE < n_live && page >= 0 && page < num_pages;
            slot_ok[s] = ok ? 1 : 0;
            const u32 bar = smem_addr(&full[s]);
            if (ok) {
#if PROXY_FENCE
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot's reads -> the copy
#endif
                mbar_expect_tx(bar, SLOT_BYTES);
                bulk_copy(smem_addr(slots + s * SLOT_BYTES), kc + (i64)page * page_stride, SLOT_BYTES, bar);
            } else {
                mbar_arrive(bar);
            }
        }
        __syncwarp();
    };
    // the producer initializes the barriers and issues the first tiles' copies before the CTA
    // barrier: they are in flight while the consumers write the query image (the slots, barriers
    // and validity flags are the producer's alone until that barrier)
    if (producer) {
        if (lane == 0) {
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(smem_addr(&full[s]), 1);
                mbar_init(smem_addr(&empty[s]), 4);  // one arrival per warp of the consuming warpgroup
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();  // the barriers initialized before any lane's copy
        // tiles 0 .. ISSUE_LANES - 1 are each consumer's first use of a slot (ISSUE_LANES is at
        // most the short ring, asserted above), so none waits on an empty barrier: a wait here,
        // before the consumers pass the CTA barrier, would never end
        issue(0);
    }
    // the query as the B operand image
#pragma unroll
    for (int i = 0; i < QWORDS; ++i) {
        const int gi = tid + i * THREADS;
        if (gi >= QGROUPS) break;
        put_query_word<H, PRECISE>(qimg, gi, qw[i]);
    }
    if (tid < H) w_img[tid] = w_mine;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> wgmma reads
    __syncthreads();  // the only CTA barrier: barriers initialized, the query image written

    if (producer) {
        {
            const int t = split + (32 + lane) * splits;
            if (32 < my_tiles && t < width_tiles) pages_next = (int)load_int(bt_row, bt64, t);
        }
        for (int base = ISSUE_LANES; base < my_tiles; base += ISSUE_LANES) issue(base);
    } else {
        // consumer warpgroup wg scores tiles wg, wg + CONSUMERS, ... of this program
        const int wg = warp >> 2;
        const int m0 = (warp & 3) * 16 + g;  // the thread's token rows m0, m0 + 8 of a tile
        const u64 desc0 = b_desc(smem_addr(qimg));
        float w_reg[H / 4];  // heads 8i + 2c, 8i + 2c + 1: the row's weights, held for every tile
#pragma unroll
        for (int i = 0; i < H / 8; ++i) w_reg[2 * i] = w_img[8 * i + 2 * c], w_reg[2 * i + 1] = w_img[8 * i + 2 * c + 1];
        u32 a[16];
        u32 b[PRECISE ? 16 : 1];
        TileRegs tr;
        for (int it = wg; it < my_tiles; it += CONSUMERS) {
            const int s = wait_tile(full, it, per_consumer);
            const int ok = slot_ok[s];
            float d[H / 2];  // not cleared: the first k-step's wgmma does not read it (scale-d 0)
            load_tile(slots + s * SLOT_BYTES, smem_addr(&empty[s]), m0, c, lane, tr);
            a_operand<PRECISE>(tr, a, b);
            mma_issue<H, PRECISE>(d, a, b, desc0);
            wgmma_wait();
            fence_operands(d);
            store_scores<H>(d, w_reg, tr.sc0, tr.sc1, ok, out_row, split + it * splits, n, n_live, m0, c);
        }
    }
    if (fill_width > n) {  // the dense API: -inf from n to fill_width
        for (int tile = n / PAGE + split; tile * PAGE < fill_width; tile += splits) {
            if (tid < PAGE) {
                const int pos = tile * PAGE + tid;
                if (pos >= n && pos < fill_width) out_row[pos] = __uint_as_float(0xff800000u);
            }
        }
    }
}

#define SCORE_KERNEL(H, P, S)                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) score_h##H##_p##P##_s##S(                  \
        const unsigned char* __restrict__ q, const float* __restrict__ w,                               \
        const unsigned char* __restrict__ kc, const void* bt, int bt64, i64 bt_stride, const void* lens, \
        int lens64, const void* active, int active64, float* __restrict__ out, i64 out_stride,          \
        int num_pages, i64 page_stride, int sel_width, int live_width, int fill_width,                 \
        int launch_dependents, int deep_tiles) {                                                        \
        score_row<H, (P) != 0, S>(q, w, kc, bt, bt64, bt_stride, lens, lens64, active, active64, out,  \
                                  out_stride, num_pages, page_stride, sel_width, live_width, fill_width, \
                                  launch_dependents, deep_tiles);                                       \
    }
#define SCORE_KERNELS(S) SCORE_KERNEL(64, 1, S) SCORE_KERNEL(64, 0, S) SCORE_KERNEL(32, 1, S) SCORE_KERNEL(32, 0, S)
// the instantiations' names need the stage counts as literals
#define SCORE_KERNELS_OF(S) SCORE_KERNELS(S)
SCORE_KERNELS_OF(STAGES_DEEP)
SCORE_KERNELS_OF(STAGES_SHORT)
