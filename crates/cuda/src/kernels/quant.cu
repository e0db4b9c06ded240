// Quantized matmul on the stored GGUF blocks, bit-identical to the CPU scalar reference
// (`sluice-kernels`, quant/dot_ref.rs and quant/act.rs).
//
// The reference splits each block's dot product into exact integer sums and one float
// formula applied block after block, in order. Here the integer sums are spread over the
// lanes of a warp (integer addition does not depend on order), and the float formula is
// applied for each (row, token) in block order by every lane of the row's warp, with the
// same roundings: a rounded product of the two scales, then a fused multiply-add. NVRTC
// compiles this file with --fmad=false, so no other product is fused.
//
// Layouts (all little-endian, as in the file):
//   Q8_K activations: per (token, 256-value block) `d` (f32), 256 codes (i8), 16 sums of 16
//   codes (i16), token-major: index t * nb + b.
//   Q16 activations (for Q8_0 weights): per (token, 32-value block) `d` (f32), 32 codes (i16).

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

#define FULL 0xffffffffu

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float f16_at(const u8* p) {
    return f16_to_f32(*(const u16*)p);
}

// Four bytes from a two-byte aligned address.
__device__ __forceinline__ u32 ld32_a2(const u8* p) {
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}

// Round to nearest, ties to even, for |v| < 2^22 (the reference's `nearest_int`).
__device__ __forceinline__ int nearest_int(float v) {
    float s = __fadd_rn(v, 12582912.0f);
    return (int)(__float_as_uint(s) & 0x007fffffu) - 0x00400000;
}

// Round half away from zero (the reference's `round_away`).
__device__ __forceinline__ int round_away(float v) {
    float a = fabsf(v);
    int i = (int)a;
    int r = (__fsub_rn(a, (float)i) >= 0.5f) ? i + 1 : i;
    return v < 0.0f ? -r : r;
}

// ---------------------------------------------------------------------------------------
// Activation quantization: one warp per block.

// Q8_K: d = 1 / (-127 / max) with max the signed value of largest magnitude (first one on
// ties), q = min(nearest_int(iscale * x), 127), plus sums of every 16 codes.
extern "C" __global__ void quantize_q8k(const float* __restrict__ x, int cols, int n, float* __restrict__ d,
                                        i8* __restrict__ qs, short* __restrict__ bsums) {
    const int nb = cols / 256;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= nb * n) return;
    const int t = warp / nb, b = warp % nb;
    const float* xs = x + (size_t)t * cols + (size_t)b * 256 + lane * 8;
    float v[8];
    float amax = 0.0f;
    int at = -1;
    for (int i = 0; i < 8; ++i) {
        v[i] = xs[i];
        float a = fabsf(v[i]);
        if (a > amax) {
            amax = a;
            at = lane * 8 + i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float oa = __shfl_xor_sync(FULL, amax, o);
        int oi = __shfl_xor_sync(FULL, at, o);
        if (oa > amax || (oa == amax && oi >= 0 && (at < 0 || oi < at))) {
            amax = oa;
            at = oi;
        }
    }
    const size_t blk = (size_t)t * nb + b;
    i8* q = qs + blk * 256 + lane * 8;
    if (amax == 0.0f || at < 0) {
        for (int i = 0; i < 8; ++i) q[i] = 0;
        if ((lane & 1) == 0) bsums[blk * 16 + (lane >> 1)] = 0;
        if (lane == 0) d[blk] = 0.0f;
        return;
    }
    const float max = x[(size_t)t * cols + (size_t)b * 256 + at];
    const float iscale = __fdiv_rn(-127.0f, max);
    int s = 0;
    for (int i = 0; i < 8; ++i) {
        int c = min(nearest_int(__fmul_rn(iscale, v[i])), 127);
        q[i] = (i8)c;
        s += c;
    }
    s += __shfl_xor_sync(FULL, s, 1);
    if ((lane & 1) == 0) bsums[blk * 16 + (lane >> 1)] = (short)s;
    if (lane == 0) d[blk] = __fdiv_rn(1.0f, iscale);
}

// Q16: d = max|x| / 32767, q = clamp(round_away(x / d), ±32767), 32 values a block.
extern "C" __global__ void quantize_q16(const float* __restrict__ x, int cols, int n, float* __restrict__ d,
                                        short* __restrict__ qs) {
    const int nb = cols / 32;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= nb * n) return;
    const int t = warp / nb, b = warp % nb;
    const float v = x[(size_t)t * cols + (size_t)b * 32 + lane];
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, o));
    const float dd = __fdiv_rn(amax, 32767.0f);
    const float id = dd != 0.0f ? __fdiv_rn(1.0f, dd) : 0.0f;
    const size_t blk = (size_t)t * nb + b;
    qs[blk * 32 + lane] = (short)max(-32767, min(32767, round_away(__fmul_rn(v, id))));
    if (lane == 0) d[blk] = dd;
}

// ---------------------------------------------------------------------------------------
// Weight formats. Each gives, for lane `j` of the `L` lanes that share one block, its part
// of the block's integer sums, and the block's two scales.

struct Act {
    const float* d;
    const i8* qs;
    const short* bsums;
    const short* qs16;
};

struct Ints {
    int isum, mins;
};

// The 6-bit (scale, min) pair `k` of a Q4_K/Q5_K block, from its 12 scale bytes held as
// three words s0 (bytes 0-3), s1 (4-7), s2 (8-11).
__device__ __forceinline__ void scale_min_k4(int k, u32 s0, u32 s1, u32 s2, int& sc, int& mn) {
    if (k < 4) {
        sc = (s0 >> (8 * k)) & 63;
        mn = (s1 >> (8 * k)) & 63;
    } else {
        const int b = 8 * (k - 4);
        sc = ((s2 >> b) & 0xF) | (((s0 >> (b + 6)) & 3) << 4);
        mn = ((s2 >> (b + 4)) & 0xF) | (((s1 >> (b + 6)) & 3) << 4);
    }
}

// Q4_K and Q5_K: 8 lanes a block; lane j covers chunk c = j/2 (64 values) and half h = j%2
// of its 32 byte positions: low nibbles are sub-block 2c, high nibbles sub-block 2c+1.
template <bool FIVE>
struct QK45 {
    enum { L = 8, BYTES = FIVE ? 176 : 144, MIN = 1, ACT = 256 };
    __device__ static Ints part(const u8* blk, int j, const i8* xq, const short* bs) {
        const int c = j >> 1, h = j & 1;
        const u32* sw = (const u32*)(blk + 4);
        const u32 w0 = sw[0], w1 = sw[1], w2 = sw[2];
        int s1, m1, s2, m2;
        scale_min_k4(2 * c, w0, w1, w2, s1, m1);
        scale_min_k4(2 * c + 1, w0, w1, w2, s2, m2);
        const uint4 q = *(const uint4*)(blk + (FIVE ? 48 : 16) + 16 * j);
        uint4 qh = make_uint4(0, 0, 0, 0);
        if (FIVE) qh = *(const uint4*)(blk + 16 + 16 * h);
        const int4 xl = *(const int4*)(xq + 64 * c + 16 * h);
        const int4 xh = *(const int4*)(xq + 64 * c + 32 + 16 * h);
        const u32 qw[4] = {q.x, q.y, q.z, q.w};
        const u32 hw[4] = {qh.x, qh.y, qh.z, qh.w};
        const int xlw[4] = {xl.x, xl.y, xl.z, xl.w};
        const int xhw[4] = {xh.x, xh.y, xh.z, xh.w};
        int a = 0, b = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            u32 lo = qw[k] & 0x0F0F0F0Fu, hi = (qw[k] >> 4) & 0x0F0F0F0Fu;
            if (FIVE) {
                lo |= ((hw[k] >> (2 * c)) & 0x01010101u) << 4;
                hi |= ((hw[k] >> (2 * c + 1)) & 0x01010101u) << 4;
            }
            a = __dp4a((int)lo, xlw[k], a);
            b = __dp4a((int)hi, xhw[k], b);
        }
        Ints r;
        r.isum = s1 * a + s2 * b;
        r.mins = h == 0 ? m1 * (bs[4 * c] + bs[4 * c + 1]) + m2 * (bs[4 * c + 2] + bs[4 * c + 3]) : 0;
        return r;
    }
    __device__ static float2 scales(const u8* blk) { return make_float2(f16_at(blk), f16_at(blk + 2)); }
};

// Q6_K: 8 lanes a block; lane j covers half n = j/4 (128 values) and byte positions
// l = 8k..8k+8 (k = j%4) of its four 32-value quarters.
struct Q6K {
    enum { L = 8, BYTES = 210, MIN = 0, ACT = 256 };
    __device__ static Ints part(const u8* blk, int j, const i8* xq, const short*) {
        const int n = j >> 2, k = j & 3;
        const u8* ql = blk + 64 * n + 8 * k;
        const u8* qh = blk + 128 + 32 * n + 8 * k;
        const i8* x = xq + 128 * n + 8 * k;
        int g1 = 0, g2 = 0, g3 = 0, g4 = 0;
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            const u32 a = ld32_a2(ql + 4 * w), b = ld32_a2(ql + 32 + 4 * w), h = ld32_a2(qh + 4 * w);
            const u32 q1 = (a & 0x0F0F0F0Fu) | ((h & 0x03030303u) << 4);
            const u32 q2 = (b & 0x0F0F0F0Fu) | (((h >> 2) & 0x03030303u) << 4);
            const u32 q3 = ((a >> 4) & 0x0F0F0F0Fu) | (((h >> 4) & 0x03030303u) << 4);
            const u32 q4 = ((b >> 4) & 0x0F0F0F0Fu) | (((h >> 6) & 0x03030303u) << 4);
            g1 = __dp4a((int)__vsub4(q1, 0x20202020u), *(const int*)(x + 4 * w), g1);
            g2 = __dp4a((int)__vsub4(q2, 0x20202020u), *(const int*)(x + 32 + 4 * w), g2);
            g3 = __dp4a((int)__vsub4(q3, 0x20202020u), *(const int*)(x + 64 + 4 * w), g3);
            g4 = __dp4a((int)__vsub4(q4, 0x20202020u), *(const int*)(x + 96 + 4 * w), g4);
        }
        const i8* sc = (const i8*)(blk + 192) + 8 * n + (k >> 1);
        Ints r;
        r.isum = sc[0] * g1 + sc[2] * g2 + sc[4] * g3 + sc[6] * g4;
        r.mins = 0;
        return r;
    }
    __device__ static float2 scales(const u8* blk) { return make_float2(f16_at(blk + 208), 0.0f); }
};

// Q2_K: 8 lanes a block; lane j covers half n = j/4 and the 16-value group pair of shift
// jj = j%4: codes (qs[32n + i] >> 2jj) & 3 for i in 0..32, sub-blocks 8n + 2jj + {0, 1}.
struct Q2K {
    enum { L = 8, BYTES = 84, MIN = 1, ACT = 256 };
    __device__ static Ints part(const u8* blk, int j, const i8* xq, const short* bs) {
        const int n = j >> 2, jj = j & 3;
        const u8* qs = blk + 16 + 32 * n;
        const i8* x = xq + 128 * n + 32 * jj;
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const u32 q0 = (*(const u32*)(qs + 4 * w) >> (2 * jj)) & 0x03030303u;
            const u32 q1 = (*(const u32*)(qs + 16 + 4 * w) >> (2 * jj)) & 0x03030303u;
            s0 = __dp4a((int)q0, *(const int*)(x + 4 * w), s0);
            s1 = __dp4a((int)q1, *(const int*)(x + 16 + 4 * w), s1);
        }
        const int g = 8 * n + 2 * jj;
        const u8 c0 = blk[g], c1 = blk[g + 1];
        Ints r;
        r.isum = (c0 & 0xF) * s0 + (c1 & 0xF) * s1;
        r.mins = (c0 >> 4) * bs[g] + (c1 >> 4) * bs[g + 1];
        return r;
    }
    __device__ static float2 scales(const u8* blk) { return make_float2(f16_at(blk + 80), f16_at(blk + 82)); }
};

// The sixteen 6-bit Q3_K scales, minus 32, of a block's 12 scale bytes.
__device__ __forceinline__ int q3k_scale(const u8* s, int i) {
    const int lo = i < 8 ? (s[i] & 0xF) : (s[i - 8] >> 4);
    const int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// Q3_K: 8 lanes a block, laid out as Q2_K's; a code is its two low bits minus 4 where the
// high-bit mask has no bit.
struct Q3K {
    enum { L = 8, BYTES = 110, MIN = 0, ACT = 256 };
    __device__ static Ints part(const u8* blk, int j, const i8* xq, const short*) {
        const int n = j >> 2, jj = j & 3;
        const u8* hm = blk;
        const u8* qs = blk + 32 + 32 * n;
        const i8* x = xq + 128 * n + 32 * jj;
        const int mbit = n * 4 + jj;
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const u32 q0 = (ld32_a2(qs + 4 * w) >> (2 * jj)) & 0x03030303u;
            const u32 q1 = (ld32_a2(qs + 16 + 4 * w) >> (2 * jj)) & 0x03030303u;
            // 4 where the mask bit is clear, 0 where it is set.
            const u32 m0 = ((~ld32_a2(hm + 4 * w) >> mbit) & 0x01010101u) << 2;
            const u32 m1 = ((~ld32_a2(hm + 16 + 4 * w) >> mbit) & 0x01010101u) << 2;
            s0 = __dp4a((int)__vsub4(q0, m0), *(const int*)(x + 4 * w), s0);
            s1 = __dp4a((int)__vsub4(q1, m1), *(const int*)(x + 16 + 4 * w), s1);
        }
        const int g = 8 * n + 2 * jj;
        Ints r;
        r.isum = q3k_scale(blk + 96, g) * s0 + q3k_scale(blk + 96, g + 1) * s1;
        r.mins = 0;
        return r;
    }
    __device__ static float2 scales(const u8* blk) { return make_float2(f16_at(blk + 108), 0.0f); }
};

// Q8_0 against Q16 activations: one lane a block of 32.
struct Q80 {
    enum { L = 1, BYTES = 34, MIN = 0, ACT = 32 };
    __device__ static Ints part(const u8* blk, int, const short* x16) {
        int s = 0;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const int q = (int)ld32_a2(blk + 2 + 4 * w);
            const int* xp = (const int*)(x16 + 4 * w);
            s = __dp2a_lo(xp[0], q, s);
            s = __dp2a_hi(xp[1], q, s);
        }
        Ints r;
        r.isum = s;
        r.mins = 0;
        return r;
    }
    __device__ static float2 scales(const u8* blk) { return make_float2(f16_at(blk), 0.0f); }
};

template <class F>
__device__ __forceinline__ Ints block_part(const u8* blk, int j, const Act& a, size_t ab) {
    return F::part(blk, j, a.qs + ab * 256, a.bsums + ab * 16);
}

template <>
__device__ __forceinline__ Ints block_part<Q80>(const u8* blk, int j, const Act& a, size_t ab) {
    return Q80::part(blk, j, a.qs16 + ab * 32);
}

// ---------------------------------------------------------------------------------------
// out[t][r] = Σ_b formula(W[r] block b, x[t] block b), NT tokens at a time.
//
// A row belongs to a group of G consecutive lanes (32 / G rows a warp). The group walks the
// row's blocks in order, G / L of them an iteration, the L lanes of a block each taking one
// part of its integer sums; a butterfly of shuffles gives every lane of those L the exact
// block totals. Then every lane of the group applies the float formula to the iteration's
// blocks, in block order, on its own copy of the row's accumulator: no lane waits for
// another row, and the row's operations are the reference's whatever G, L or NT.

//
// Entry i of the n reads activation row `act_rows[i]` (row i where `act_rows` is null) and
// writes output row i.

// Tokens are shared out between blocks along z, `chunk` (a multiple of NT) to a block, so that
// a prefill fills the device however few rows a matrix has; each token's operations are the
// same whichever block takes it.
template <class F, int G, int NT>
__device__ __forceinline__ void matmul_rows(const u8* __restrict__ w, int rows, int nb, Act act,
                                            const int* __restrict__ act_rows, int n, int chunk,
                                            float* __restrict__ out) {
    constexpr int L = F::L, B = G / L;
    const int lane = threadIdx.x & 31;
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) / G;
    // Rows past the end still take part in the shuffles (their loads are clamped to row 0).
    const bool live = row < rows;
    const int gbase = lane & ~(G - 1), j = (lane & (G - 1)) % L, sub = (lane & (G - 1)) / L;
    const u8* wr = w + (size_t)(live ? row : 0) * nb * F::BYTES;
    const int t_end = min(n, (int)(blockIdx.z + 1) * chunk);
    for (int t0 = blockIdx.z * chunk; t0 < t_end; t0 += NT) {
        const int nt = min(NT, t_end - t0);
        float acc[NT];
        size_t arow[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            acc[t] = 0.0f;
            const int i = min(t0 + t, t_end - 1);
            arow[t] = (size_t)(act_rows ? act_rows[i] : i) * nb;
        }
#pragma unroll(NT == 1 ? 4 : 1)
        for (int base = 0; base < nb; base += B) {
            const int b = base + sub;
            const bool have = b < nb;
            const u8* blk = wr + (size_t)(have ? b : 0) * F::BYTES;
            Ints ints[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                ints[t].isum = 0;
                ints[t].mins = 0;
                if (t < nt && have) ints[t] = block_part<F>(blk, j, act, arow[t] + b);
            }
#pragma unroll
            for (int o = L / 2; o > 0; o >>= 1) {
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    ints[t].isum += __shfl_xor_sync(FULL, ints[t].isum, o);
                    if (F::MIN) ints[t].mins += __shfl_xor_sync(FULL, ints[t].mins, o);
                }
            }
            const float2 sc = have ? F::scales(blk) : make_float2(0.0f, 0.0f);
#pragma unroll
            for (int q = 0; q < B; ++q) {
                const int src = gbase + q * L;
                const float d = B == 1 ? sc.x : __shfl_sync(FULL, sc.x, src);
                const float m = B == 1 ? sc.y : __shfl_sync(FULL, sc.y, src);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const int is = B == 1 ? ints[t].isum : __shfl_sync(FULL, ints[t].isum, src);
                    const int mn = B == 1 ? ints[t].mins : __shfl_sync(FULL, ints[t].mins, src);
                    if (t < nt && base + q < nb) {
                        const float dx = act.d[arow[t] + base + q];
                        acc[t] = fmaf(__fmul_rn(d, dx), (float)is, acc[t]);
                        if (F::MIN) acc[t] = fmaf(-__fmul_rn(m, dx), (float)mn, acc[t]);
                    }
                }
            }
        }
        if (live && (lane & (G - 1)) == 0) {
            for (int t = 0; t < nt; ++t) out[(size_t)(t0 + t) * rows + row] = acc[t];
        }
    }
}

#define MATMUL(NAME, F, G, NT)                                                                               \
    extern "C" __global__ void NAME(const u8* __restrict__ w, int rows, int nb, const float* ad, const i8* aqs, \
                                    const short* absum, const short* aqs16, int n, int chunk,               \
                                    float* __restrict__ out) {                                               \
        const Act a = {ad, aqs, absum, aqs16};                                                               \
        matmul_rows<F, G, NT>(w, rows, nb, a, nullptr, n, chunk, out);                                       \
    }                                                                                                        \
    /* Several matrices of one shape in one launch (a MoE layer's experts): segment                       \
       blockIdx.y multiplies the matrix at w[s] with the activation rows act_rows[start[s] ..               \
       start[s] + len[s]) into those output rows. */                                                       \
    extern "C" __global__ void NAME##_ids(const unsigned long long* __restrict__ w, const int* __restrict__ start, \
                                          const int* __restrict__ len, int rows, int nb, const float* ad,     \
                                          const i8* aqs, const short* absum, const short* aqs16,              \
                                          const int* __restrict__ act_rows, int chunk, float* __restrict__ out) { \
        const Act a = {ad, aqs, absum, aqs16};                                                               \
        const int sg = blockIdx.y, s0 = start[sg];                                                           \
        matmul_rows<F, G, NT>((const u8*)w[sg], rows, nb, a, act_rows + s0, len[sg], chunk,                  \
                              out + (size_t)s0 * rows);                                                      \
    }

// Each format at 8 and 16 lanes a row, for one token and for eight at a time.
#define FORMAT(name, F)                    \
    MATMUL(matmul_##name##_g8_1, F, 8, 1)  \
    MATMUL(matmul_##name##_g8_8, F, 8, 8)  \
    MATMUL(matmul_##name##_g16_1, F, 16, 1) \
    MATMUL(matmul_##name##_g16_8, F, 16, 8)

FORMAT(q4_k, QK45<false>)
FORMAT(q5_k, QK45<true>)
FORMAT(q6_k, Q6K)
FORMAT(q2_k, Q2K)
FORMAT(q3_k, Q3K)
FORMAT(q8_0, Q80)
