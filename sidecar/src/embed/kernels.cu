// The element-wise and row-wise steps of the BERT forward pass on the GPU; the GEMMs are
// cuBLAS's. Compiled at run time by NVRTC (no nvcc at build time). Row-major throughout;
// T = rows × L tokens (padded), H hidden, d = H / heads.

#define BLOCK 256
// NVRTC has no math.h: -infinity from its bits.
#define NEG_INF __int_as_float(0xff800000)

// Sum of `v` over the block; every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float partial[BLOCK / 32];
    __shared__ float total;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffff, v, offset);
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffff, v, offset);
        if (lane == 0) total = v;
    }
    __syncthreads();
    float result = total;
    __syncthreads();
    return result;
}

__device__ float block_max(float v) {
    __shared__ float partial[BLOCK / 32];
    __shared__ float total;
    for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_down_sync(0xffffffff, v, offset));
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < blockDim.x / 32 ? partial[lane] : NEG_INF;
        for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_down_sync(0xffffffff, v, offset));
        if (lane == 0) total = v;
    }
    __syncthreads();
    float result = total;
    __syncthreads();
    return result;
}

// out[t] = word[ids[t]] + position[t % L] + token_type[types[t]]; one block per token.
extern "C" __global__ void embed(const unsigned int* ids, const unsigned int* types, const float* word,
                                 const float* position, const float* token_type, float* out, int L, int H) {
    int t = blockIdx.x;
    const float* w = word + (size_t)ids[t] * H;
    const float* p = position + (size_t)(t % L) * H;
    const float* y = token_type + (size_t)types[t] * H;
    for (int h = threadIdx.x; h < H; h += blockDim.x) out[(size_t)t * H + h] = w[h] + p[h] + y[h];
}

// y = LayerNorm(x + bias + residual) per row; bias and residual may be null. One block per row.
// y may alias residual (each thread reads its own elements before writing them).
extern "C" __global__ void layer_norm(float* y, const float* x, const float* bias, const float* residual,
                                      const float* gamma, const float* beta, int H, float eps) {
    size_t row = (size_t)blockIdx.x * H;
    float sum = 0.0f;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float v = x[row + h] + (bias ? bias[h] : 0.0f) + (residual ? residual[row + h] : 0.0f);
        sum += v;
    }
    float mean = block_sum(sum) / H;
    float sq = 0.0f;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float v = x[row + h] + (bias ? bias[h] : 0.0f) + (residual ? residual[row + h] : 0.0f) - mean;
        sq += v * v;
    }
    float inv = rsqrtf(block_sum(sq) / H + eps);
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float v = x[row + h] + (bias ? bias[h] : 0.0f) + (residual ? residual[row + h] : 0.0f);
        y[row + h] = (v - mean) * inv * gamma[h] + beta[h];
    }
}

// x = gelu(x + bias), the exact (erf) GELU; n elements, rows of `cols`.
extern "C" __global__ void bias_gelu(float* x, const float* bias, int n, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i] + bias[i % cols];
    x[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}

// qkv [T, 3H] (+ bias) to q, k, v, each [rows · heads, L, d].
extern "C" __global__ void split_heads(const float* qkv, const float* bias, float* q, float* k, float* v,
                                       int L, int H, int heads) {
    int t = blockIdx.x;
    int b = t / L, l = t % L, d = H / heads;
    for (int j = threadIdx.x; j < 3 * H; j += blockDim.x) {
        int which = j / H, h = (j % H) / d, e = j % d;
        float* dst = which == 0 ? q : (which == 1 ? k : v);
        dst[(((size_t)b * heads + h) * L + l) * d + e] = qkv[(size_t)t * 3 * H + j] + bias[j];
    }
}

// Softmax over each row of scores [rows · heads, L, L], keys at or past the row's length masked
// out (weight exactly 0). One block per (row · head, query).
extern "C" __global__ void masked_softmax(float* scores, const int* lengths, int L, int heads) {
    size_t r = blockIdx.x;
    int b = (int)(r / L) / heads;
    int len = lengths[b];
    float* s = scores + r * L;
    float m = NEG_INF;
    for (int j = threadIdx.x; j < len; j += blockDim.x) m = fmaxf(m, s[j]);
    m = block_max(m);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        float e = j < len ? __expf(s[j] - m) : 0.0f;
        s[j] = e;
        sum += e;
    }
    float inv = 1.0f / block_sum(sum);
    for (int j = threadIdx.x; j < L; j += blockDim.x) s[j] *= inv;
}

// ctx [rows · heads, L, d] back to [T, H], heads side by side.
extern "C" __global__ void merge_heads(const float* ctx, float* out, int L, int H, int heads) {
    int t = blockIdx.x;
    int b = t / L, l = t % L, d = H / heads;
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        int h = j / d, e = j % d;
        out[(size_t)t * H + j] = ctx[(((size_t)b * heads + h) * L + l) * d + e];
    }
}

// One sentence vector per row: the mean of its real tokens (or its [CLS] token), then scaled to
// unit length when asked. One block per row.
extern "C" __global__ void pool(const float* x, const int* lengths, float* out, int L, int H, int cls,
                                int normalize) {
    int b = blockIdx.x;
    int len = cls ? 1 : lengths[b];
    float sq = 0.0f;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.0f;
        for (int l = 0; l < len; l++) acc += x[((size_t)b * L + l) * H + h];
        float v = acc / len;
        out[(size_t)b * H + h] = v;
        sq += v * v;
    }
    if (!normalize) return;
    float inv = 1.0f / fmaxf(sqrtf(block_sum(sq)), 1e-12f);
    for (int h = threadIdx.x; h < H; h += blockDim.x) out[(size_t)b * H + h] *= inv;
}
