// Row `ids[t]` of `w` dequantized into out[t, :] (embedding lookup);
// grid (ceil(cols / 256), tokens).
extern "C" __global__ void embed_rows(W w, const int* __restrict__ ids, float* __restrict__ out) {
    PDL_START();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (c >= w.cols) return;
    size_t r = (size_t)ids[t];
    float v;
    if (w.qt == QT_F32) {
        v = ((const float*)w.codes)[r * w.cols + c];
    } else if (w.qt == QT_F16 || w.qt == QT_BF16) {
        v = half_val(((const u16*)w.codes)[r * w.cols + c], w.qt == QT_BF16);
    } else if (w.qt >= QT_Q4_0) {
        // The element's 32-value sub-block, dequantized as in row_dot.
        const int per = w.group >> 5, u = c >> 5;
        const u8* row = w.codes + r * (size_t)(w.cols / w.group) * ggml_block_bytes(w.qt);
        float wv[32];
        ggml_sub(row + (size_t)(u / per) * ggml_block_bytes(w.qt), w.qt, u % per, wv);
        v = 0.0f;
#pragma unroll
        for (int l = 0; l < 32; l++)
            if (l == (c & 31)) v = wv[l];
    } else {
        int bits = w.qt == QT_A4 ? 4 : 8;
        size_t j = r * w.cols + c;
        u32 q = bits == 4 ? ((w.codes[j / 2] >> ((j & 1) * 4)) & 15u) : w.codes[j];
        size_t g = r * (w.cols / w.group) + c / w.group;
        v = half_val(w.scales[g], w.scale_bf16) * (float)q + half_val(w.biases[g], w.scale_bf16);
    }
    out[(size_t)t * w.cols + c] = v;
}

// x += y, n elements.
extern "C" __global__ void add_inplace(float* __restrict__ x, const float* __restrict__ y, int n) {
    PDL_START();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// HBM bandwidth probes: a float4 copy and a float4 read (sum kept so the
// loads are not removed).
extern "C" __global__ void bw_copy(const float4* __restrict__ src, float4* __restrict__ dst, u64 n) {
    PDL_START();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) dst[i] = src[i];
}
extern "C" __global__ void bw_read(const float4* __restrict__ src, u64 n, float* __restrict__ out) {
    PDL_START();
    float s = 0.0f;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float4 v = __ldg(src + i);
        s += (v.x + v.y) + (v.z + v.w);
    }
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0 && s == 12345.678f) out[0] = s;
}

// Spins for `cycles` clock cycles (a clock-hold probe on a second stream).
extern "C" __global__ void spin(long long cycles) {
    PDL_START();
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

// An empty kernel (launch-cost probe).
extern "C" __global__ void nop() { PDL_START(); }
