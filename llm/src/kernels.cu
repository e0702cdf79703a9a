// The decoder's GPU kernels, compiled at load by NVRTC (ferry-llm's gpu.rs). Every kernel has a
// host emulation in host.rs that computes the same thing the same way; keep the two in step.
// Row-major throughout; the KV cache is [layer][slot][kv_dim], keys and values apart.

// -inf (NVRTC has no math.h, so no INFINITY).
#define NEG_INF __int_as_float(0xff800000)

// One block per row: out[i] = table[ids[i]].
extern "C" __global__ void gather(const unsigned* ids, const float* table, float* out, int width) {
    int i = blockIdx.x;
    const float* src = table + (long long)ids[i] * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) out[(long long)i * width + c] = src[c];
}

__device__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) / 32;
    v = threadIdx.x < warps ? scratch[threadIdx.x] : 0.0f;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    float total = scratch[0];
    __syncthreads();
    return total;
}

__device__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffff, v, o));
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) / 32;
    v = threadIdx.x < warps ? scratch[threadIdx.x] : NEG_INF;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffff, v, o));
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    float m = scratch[0];
    __syncthreads();
    return m;
}

// One block per row: out = x / sqrt(mean(x²) + eps) * weight.
extern "C" __global__ void rms_norm(const float* x, const float* weight, float* out, int width, float eps) {
    __shared__ float scratch[32];
    const float* row = x + (long long)blockIdx.x * width;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < width; c += blockDim.x) ss += row[c] * row[c];
    float inv = rsqrtf(block_sum(ss, scratch) / width + eps);
    for (int c = threadIdx.x; c < width; c += blockDim.x)
        out[(long long)blockIdx.x * width + c] = row[c] * inv * weight[c];
}

// One block per token: adds the Q/K/V bias (null: none), rotates the Q and K heads for the
// token's position (element i with element i + d/2 of each head), then copies K and V into the
// cache at the token's slot of this layer.
extern "C" __global__ void rope_store(float* qkv, const float* bias, const unsigned* positions,
                                      const unsigned* slots, const float* cos_t, const float* sin_t,
                                      float* keys, float* values, long long layer_offset,
                                      int heads, int kv_heads, int head_dim) {
    int t = blockIdx.x;
    int q_dim = heads * head_dim, kv_dim = kv_heads * head_dim, width = q_dim + 2 * kv_dim;
    float* row = qkv + (long long)t * width;
    if (bias != 0)
        for (int c = threadIdx.x; c < width; c += blockDim.x) row[c] += bias[c];
    __syncthreads();
    int half = head_dim / 2;
    const float* cs = cos_t + (long long)positions[t] * half;
    const float* sn = sin_t + (long long)positions[t] * half;
    // Q heads, then K heads: (heads + kv_heads) × half pairs.
    for (int e = threadIdx.x; e < (heads + kv_heads) * half; e += blockDim.x) {
        int head = e / half, i = e % half;
        float* x = row + head * head_dim;  // K heads follow the Q heads in the row
        float x0 = x[i], x1 = x[i + half];
        x[i] = x0 * cs[i] - x1 * sn[i];
        x[i + half] = x1 * cs[i] + x0 * sn[i];
    }
    __syncthreads();
    long long at = layer_offset + (long long)slots[t] * kv_dim;
    for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
        keys[at + c] = row[q_dim + c];
        values[at + c] = row[q_dim + kv_dim + c];
    }
}

// Paged attention: one block per (token, head); the token's context is the run of
// positions[t] + 1 slots at context + context_start[t]. Scores live in shared memory
// (n floats, sized at launch from the step's longest context).
extern "C" __global__ void attention(const float* qkv, const unsigned* positions, const unsigned* context_start,
                                     const unsigned* context, const float* keys, const float* values,
                                     long long layer_offset, float* out, int heads, int kv_heads, int head_dim,
                                     float scale) {
    extern __shared__ float shared[];
    float* scratch = shared;       // 32 floats for the reductions
    float* scores = shared + 32;   // n floats
    int t = blockIdx.x, h = blockIdx.y;
    int q_dim = heads * head_dim, kv_dim = kv_heads * head_dim, width = q_dim + 2 * kv_dim;
    int kvh = h / (heads / kv_heads);
    int n = positions[t] + 1;
    const unsigned* slots = context + context_start[t];
    const float* q = qkv + (long long)t * width + h * head_dim;
    float local_max = NEG_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float* k = keys + layer_offset + (long long)slots[j] * kv_dim + kvh * head_dim;
        float d = 0.0f;
        for (int i = 0; i < head_dim; i++) d += q[i] * k[i];
        scores[j] = d * scale;
        local_max = fmaxf(local_max, scores[j]);
    }
    float m = block_max(local_max, scratch);
    float local_sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        scores[j] = expf(scores[j] - m);
        local_sum += scores[j];
    }
    float inv = 1.0f / block_sum(local_sum, scratch);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; j++)
            acc += scores[j] * values[layer_offset + (long long)slots[j] * kv_dim + kvh * head_dim + i];
        out[(long long)t * q_dim + h * head_dim + i] = acc * inv;
    }
}

// out[r, f] = silu(gu[r, f]) * gu[r, ffn + f], one thread per element.
extern "C" __global__ void silu_mul(const float* gate_up, float* out, int rows, int ffn) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)rows * ffn) return;
    long long r = e / ffn, f = e % ffn;
    float g = gate_up[r * 2 * ffn + f], u = gate_up[r * 2 * ffn + ffn + f];
    out[e] = g / (1.0f + expf(-g)) * u;
}

// x += y, one thread per element.
extern "C" __global__ void add(float* x, const float* y, long long n) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < n) x[e] += y[e];
}
