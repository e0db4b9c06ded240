// The float operations of a whole decode step on the device (`step.rs`): norms, rotary
// embedding, attention over the KV cache, the router's product, the gated activation and the
// weighted sum of the experts' outputs. These are the step's own arithmetic, not the CPU's:
// each is deterministic (a fixed reduction order, whatever the data), so a step gives the same
// bits every time, whichever tier its experts came from.
//
// Compiled in one unit with quant.cu (after it: FULL and the typedefs come from there).

#define STEP_THREADS 256

// Sum of `v` over the block (STEP_THREADS threads), in a fixed order; every thread gets it.
__device__ __forceinline__ float block_sum(float v, float* shared32) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float t = 0.0f;
    for (int w = 0; w < STEP_THREADS / 32; w++) t += shared32[w];
    return t;
}

__device__ __forceinline__ float block_max(float v, float* shared32) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    float t = shared32[0];
    for (int w = 1; w < STEP_THREADS / 32; w++) t = fmaxf(t, shared32[w]);
    return t;
}

// out[r] = x[r] / sqrt(mean(x[r]²) + eps) ⊙ w, for rows r = blockIdx.x of `dim` values (the
// same `w` for every row: a token's hidden state, or each head of q or k). In place allowed.
extern "C" __global__ void step_rms_norm(const float* x, const float* __restrict__ w, float eps, float* out, int dim) {
    __shared__ float red[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* orow = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += STEP_THREADS) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += STEP_THREADS) orow[i] = xr[i] * scale * w[i];
}

// Rotates the first `rot` values of each of the heads (blockIdx.x) of `x` (`hd` values a
// head) by the angles whose cosines and sines `cs` holds (rot/2 of each); `neox`: pairs
// (i, i + rot/2), else (2i, 2i + 1).
extern "C" __global__ void step_rope(float* x, const float* __restrict__ cs, int hd, int rot, int neox) {
    int half = rot / 2;
    float* h = x + (size_t)blockIdx.x * hd;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c = cs[i], s = cs[half + i];
        int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        float a = h[ia], b = h[ib];
        h[ia] = a * c - b * s;
        h[ib] = b * c + a * s;
    }
}

// One token's attention for head blockIdx.x over positions 0..len of the cache (`kc`, `vc`:
// rows of `kvd` values, the head's group at g·hd): scores (scaled) into `scratch` (a row of
// `stride` floats a head), softmax, then the weighted sum of values into `out` (hd a head).
extern "C" __global__ void step_attention(const float* __restrict__ q, const float* __restrict__ kc,
                                          const float* __restrict__ vc, float* __restrict__ out,
                                          float* __restrict__ scratch, int n_head, int n_kv, int hd, int kvd,
                                          int len, int stride, float scale) {
    __shared__ float red[32];
    int head = blockIdx.x;
    int g = head / (n_head / n_kv);
    const float* qh = q + (size_t)head * hd;
    float* sc = scratch + (size_t)head * stride;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int p = warp; p < len; p += STEP_THREADS / 32) {
        const float* k = kc + (size_t)p * kvd + (size_t)g * hd;
        float d = 0.0f;
        for (int i = lane; i < hd; i += 32) d += qh[i] * k[i];
        for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(FULL, d, o);
        if (lane == 0) sc[p] = d * scale;
    }
    __syncthreads();
    float m = __int_as_float(0xff800000);  // -inf
    for (int p = threadIdx.x; p < len; p += STEP_THREADS) m = fmaxf(m, sc[p]);
    m = block_max(m, red);
    float s = 0.0f;
    for (int p = threadIdx.x; p < len; p += STEP_THREADS) {
        float e = expf(sc[p] - m);
        sc[p] = e;
        s += e;
    }
    s = block_sum(s, red);
    float inv = 1.0f / s;
    for (int i = threadIdx.x; i < hd; i += STEP_THREADS) {
        const float* v = vc + (size_t)g * hd + i;
        float acc = 0.0f;
        for (int p = 0; p < len; p++) acc += sc[p] * v[(size_t)p * kvd];
        out[(size_t)head * hd + i] = acc * inv;
    }
}

// a[i] += b[i]
extern "C" __global__ void step_add(float* a, const float* __restrict__ b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] += b[i];
}

// out[r] = W[r] · x for f32 rows of `cols` values, a warp a row (the router).
extern "C" __global__ void step_matvec_f32(const float* __restrict__ w, const float* __restrict__ x,
                                           float* __restrict__ out, int rows, int cols) {
    int r = blockIdx.x * (STEP_THREADS / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    const float* wr = w + (size_t)r * cols;
    float d = 0.0f;
    for (int i = lane; i < cols; i += 32) d += wr[i] * x[i];
    for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(FULL, d, o);
    if (lane == 0) out[r] = d;
}

// g[i] = silu(g[i]) · u[i]
extern "C" __global__ void step_silu_mul(float* g, const float* __restrict__ u, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float x = g[i];
        g[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

// x[i] += Σ_j w[j] · y[j·n + i], j in rank order (the routed experts' weighted outputs).
extern "C" __global__ void step_weighted_add(float* x, const float* __restrict__ y, const float* __restrict__ w,
                                             int k, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float acc = 0.0f;
    for (int j = 0; j < k; j++) acc += w[j] * y[(size_t)j * n + i];
    x[i] += acc;
}
