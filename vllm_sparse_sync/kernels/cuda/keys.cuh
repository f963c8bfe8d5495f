// Sortable keys of fp32 scores and the one-CTA top-k's pass-A bins, shared by topk.cu and
// scorer.cu (whose counts build bins the scores it writes for the top-k). Included by the
// loader (cuda_topk.resolve_includes), not by NVRTC's search path.
#ifndef VLLM_SPARSE_SYNC_CUDA_KEYS_CUH
#define VLLM_SPARSE_SYNC_CUDA_KEYS_CUH

typedef unsigned int u32;

// the key of x: bits ^ 0x80000000 for a positive float, ~bits for a negative one (unsigned order
// = float order); nan_low != 0 maps every NaN to 0 (below every number)
__device__ __forceinline__ u32 order_key(float x, int nan_low) {
    u32 b = __float_as_uint(x);
    u32 u = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    if (nan_low && (b & 0x7fffffffu) > 0x7f800000u) u = 0u;  // NaN (bit test: no float compare)
    return u;
}

#define SOLO_EXP_LO 113  // cuda_topk_emu.SOLO_EXP_LO

// The one-CTA pass-A bin of key u (cuda_topk_emu.solo_bin): 2048 bins per sign, 64 per binary
// octave of |x| from 2^(SOLO_EXP_LO - 127) to 2^(SOLO_EXP_LO - 95); each sign's first and last
// bins also hold the magnitudes below and above. Non-decreasing in u; a bin is an interval of keys.
__device__ __forceinline__ u32 solo_bin(u32 u) {
    const int s = (int)(u >> 17);
    const bool pos = s >= 0x4000;
    int j = s - (pos ? 0x4000 + SOLO_EXP_LO * 64 : 0x3800 - SOLO_EXP_LO * 64);
    j = j < 0 ? 0 : (j > 2047 ? 2047 : j);
    return (u32)j + (pos ? 2048u : 0u);
}

// the keys [lo, hi] of solo_bin's bin b (cuda_topk_emu.solo_bin_keys)
__device__ __forceinline__ void solo_bin_keys(u32 b, u32& lo, u32& hi) {
    const bool pos = b >= 2048u;
    const u32 j = b & 2047u, base = pos ? 0x4000u + SOLO_EXP_LO * 64 : 0x3800u - SOLO_EXP_LO * 64;
    const u32 s_lo = j == 0u ? (pos ? 0x4000u : 0u) : base + j;
    const u32 s_hi = j == 2047u ? (pos ? 0x7fffu : 0x3fffu) : base + j;
    lo = s_lo << 17;
    hi = (s_hi << 17) | 0x1ffffu;
}

#endif
