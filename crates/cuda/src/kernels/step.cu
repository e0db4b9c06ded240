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

// One token's attention for head blockIdx.x over positions 0..len of the cache (`kc`, `vc`:
// rows of `kvd` values, the head's group at g·hd; hd ≤ 256): scores (scaled) into `scratch` (a
// row of `stride` floats a head), softmax, then the weighted sum of values into `out`.
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
    // The weighted sum of values: each warp over its positions (p ≡ warp), its lanes over the
    // head's values (hd ≤ 256), then the warps' partial sums in warp order.
    __shared__ float part[STEP_THREADS / 32][256];
    float acc[8];
    for (int j = 0; j < 8; j++) acc[j] = 0.0f;
    for (int p = warp; p < len; p += STEP_THREADS / 32) {
        float w = sc[p];
        const float* v = vc + (size_t)p * kvd + (size_t)g * hd;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j * 32 + lane < hd) acc[j] += w * v[j * 32 + lane];
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j * 32 + lane < hd) part[warp][j * 32 + lane] = acc[j];
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += STEP_THREADS) {
        float t = 0.0f;
        for (int w = 0; w < STEP_THREADS / 32; w++) t += part[w][i];
        out[(size_t)head * hd + i] = t * inv;
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

// A MoE layer's routing on the device, for softmax gates: probabilities over the `ne`
// logits, the `k` largest (ties to the lower index) in rank order, their weights (divided by
// their sum when `norm`); `topk_first`: the weights are instead the softmax of the chosen
// logits. One block. Then each grouped product's table (matrix pointers,
// segment starts, lengths, activation rows: matmul_ids' layout) for the gate, up and down
// products from `ptrs` (the layer's experts' gate, up and down matrices, ne each), when the
// layer's experts all sit in VRAM (`ptrs` null otherwise).
extern "C" __global__ void step_route(const float* __restrict__ logits, int ne, int k, int norm, int topk_first,
                                      const unsigned long long* __restrict__ ptrs, float* __restrict__ weights,
                                      unsigned char* __restrict__ tables, int* __restrict__ ids_out) {
    __shared__ float red[32];
    __shared__ float p[1024];
    __shared__ int chosen[64];
    __shared__ int best_i[32];
    __shared__ float best_v[32];
    float m = __int_as_float(0xff800000);
    for (int e = threadIdx.x; e < ne; e += STEP_THREADS) m = fmaxf(m, logits[e]);
    m = block_max(m, red);
    float s = 0.0f;
    for (int e = threadIdx.x; e < ne; e += STEP_THREADS) {
        float v = topk_first ? logits[e] : expf(logits[e] - m);
        p[e] = v;
        s += topk_first ? 0.0f : v;
    }
    s = block_sum(s, red);
    if (!topk_first)
        for (int e = threadIdx.x; e < ne; e += STEP_THREADS) p[e] = p[e] / s;
    __syncthreads();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = 0; r < k; r++) {
        float bv = __int_as_float(0xff800000);
        int bi = 0x7fffffff;
        for (int e = threadIdx.x; e < ne; e += STEP_THREADS) {
            bool taken = false;
            for (int j = 0; j < r; j++) taken |= chosen[j] == e;
            float v = p[e];
            // NaN ranks lowest (as −∞), so that every pick is an expert not yet chosen.
            if (v != v) v = __int_as_float(0xff800000);
            if (!taken && (v > bv || (v == bv && e < bi))) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL, bv, o);
            int oi = __shfl_xor_sync(FULL, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = best_v[0];
            int i = best_i[0];
            for (int w = 1; w < STEP_THREADS / 32; w++)
                if (best_v[w] > v || (best_v[w] == v && best_i[w] < i)) { v = best_v[w]; i = best_i[w]; }
            chosen[r] = i;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float w[64];
        float sum = 0.0f;
        if (topk_first) {
            float mx = p[chosen[0]];
            for (int r = 0; r < k; r++) { w[r] = expf(p[chosen[r]] - mx); sum += w[r]; }
            for (int r = 0; r < k; r++) w[r] = w[r] / sum;
        } else {
            for (int r = 0; r < k; r++) { w[r] = p[chosen[r]]; sum += w[r]; }
            if (norm) for (int r = 0; r < k; r++) w[r] = w[r] / sum;
        }
        for (int r = 0; r < k; r++) {
            weights[r] = w[r];
            ids_out[r] = chosen[r];
        }
        if (ptrs == nullptr) return;  // the host makes the experts resident and builds the tables
        // Three tables of k entries, 24k bytes apart: 8k bytes of pointers, then 4k each of
        // starts, lengths and activation rows (gate and up read row 0; down reads row r).
        size_t tb = 24 * (size_t)k;  // 20k, rounded so that each table's pointers stay aligned
        for (int t = 0; t < 3; t++) {
            unsigned char* tab = tables + t * tb;
            unsigned long long* tp = (unsigned long long*)tab;
            int* starts = (int*)(tab + 8 * k);
            int* lens = starts + k;
            int* rows = lens + k;
            for (int r = 0; r < k; r++) {
                tp[r] = ptrs[(size_t)t * ne + chosen[r]];
                starts[r] = r;
                lens[r] = 1;
                rows[r] = t == 2 ? r : 0;
            }
        }
    }
}

// A token's q heads (blocks 0 .. n_q) and k heads (blocks n_q .. n_q + n_k), `hd` values each:
// each head RMS-normed by its weights (`wq` or `wk`; skipped when `norm` is 0), then its first
// `rot` values rotated by the angles whose cosines and sines `cs` holds (rot/2 of each); `neox`:
// pairs (i, i + rot/2), else (2i, 2i + 1).
extern "C" __global__ void step_qk_norm_rope(float* q, float* k, const float* __restrict__ wq,
                                             const float* __restrict__ wk, int norm, float eps, int n_q, int hd,
                                             const float* __restrict__ cs, int rot, int neox) {
    __shared__ float red[32];
    int b = blockIdx.x;
    bool is_q = b < n_q;
    float* h = is_q ? q + (size_t)b * hd : k + (size_t)(b - n_q) * hd;
    if (norm) {
        const float* w = is_q ? wq : wk;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < hd; i += STEP_THREADS) ss += h[i] * h[i];
        ss = block_sum(ss, red);
        float scale = 1.0f / sqrtf(ss / (float)hd + eps);
        for (int i = threadIdx.x; i < hd; i += STEP_THREADS) h[i] = h[i] * scale * w[i];
        __syncthreads();
    }
    int half = rot / 2;
    for (int i = threadIdx.x; i < half; i += STEP_THREADS) {
        float c = cs[i], s = cs[half + i];
        int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        float a = h[ia], bb = h[ib];
        h[ia] = a * c - bb * s;
        h[ib] = bb * c + a * s;
    }
}

// x += o, then out = RMSNorm(x) ⊙ w (one row of `dim`): the residual after a block and the
// next block's normed input in one launch.
extern "C" __global__ void step_add_rms_norm(float* x, const float* __restrict__ o, const float* __restrict__ w,
                                             float eps, float* __restrict__ out, int dim) {
    __shared__ float red[32];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += STEP_THREADS) {
        float v = x[i] + o[i];
        x[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, red);
    float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += STEP_THREADS) out[i] = x[i] * scale * w[i];
}
