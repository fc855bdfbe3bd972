// Block-wide sum (double) of one value per thread; blockDim.x a multiple of
// 32, at most 1024. Every thread gets the result.
__device__ double block_sum_d(double v) {
    __shared__ double part[32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) part[wid] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    double s = 0.0;
    for (int i = 0; i < nw; i++) s += part[i];
    return s;
}

// block_sum_d of u and of v (the same bits as two calls), with the
// barriers of one.
__device__ void block_sum_d2(double& u, double& v) {
    __shared__ double part2[2][32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    u = warp_sum_d(u);
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) {
        part2[0][wid] = u;
        part2[1][wid] = v;
    }
    __syncthreads();
    int nw = blockDim.x >> 5;
    double su = 0.0, sv = 0.0;
    for (int i = 0; i < nw; i++) {
        su += part2[0][i];
        sv += part2[1][i];
    }
    u = su;
    v = sv;
}

// out[row] = x[row] * rsqrt(mean(x^2) + eps) * w; grid rows, 256 threads.
// With `add` (not null) the residual add comes first, x[row] += add[row]
// (stored; the same bits as add_inplace then rms_norm, one launch fewer).
// Rows of dim % 4 == 0 up to RMS_VEC * 4 * 256 values (16-byte aligned)
// are held in registers, every load issued at once (one round trip to
// memory instead of one per element); others take the loop below.
#define RMS_VEC 4
extern "C" __global__ void rms_norm(float* __restrict__ x, const float* __restrict__ w,
                                   float* __restrict__ out, int dim, float eps, const float* __restrict__ add) {
    PDL_TRIGGER();
    float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    double ss = 0.0;
    const int n4 = dim >> 2;
    const bool vec = (dim & 3) == 0 && n4 <= RMS_VEC * 256 && blockDim.x == 256 &&
                     (((size_t)xr | (size_t)o | (size_t)w | (size_t)add) & 15) == 0;
    if (vec) {
        // The norm weights are read-only: loaded before the wait for x.
        float4 v[RMS_VEC], wv[RMS_VEC];
#pragma unroll
        for (int u = 0; u < RMS_VEC; u++) {
            const int i = threadIdx.x + 256 * u;
            if (i < n4) wv[u] = __ldg((const float4*)w + i);
        }
        PDL_WAIT();
#pragma unroll
        for (int u = 0; u < RMS_VEC; u++) {
            const int i = threadIdx.x + 256 * u;
            if (i < n4) {
                v[u] = ((const float4*)xr)[i];
                if (add) {
                    const float4 a = ((const float4*)(add + (size_t)blockIdx.x * dim))[i];
                    v[u] = make_float4(v[u].x + a.x, v[u].y + a.y, v[u].z + a.z, v[u].w + a.w);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < RMS_VEC; u++) {
            const int i = threadIdx.x + 256 * u;
            if (i < n4) {
                if (add) ((float4*)xr)[i] = v[u];
                ss += (double)v[u].x * (double)v[u].x;
                ss += (double)v[u].y * (double)v[u].y;
                ss += (double)v[u].z * (double)v[u].z;
                ss += (double)v[u].w * (double)v[u].w;
            }
        }
        ss = block_sum_d(ss);
        const float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
#pragma unroll
        for (int u = 0; u < RMS_VEC; u++) {
            const int i = threadIdx.x + 256 * u;
            if (i < n4)
                ((float4*)o)[i] = make_float4((v[u].x * inv) * wv[u].x, (v[u].y * inv) * wv[u].y,
                                              (v[u].z * inv) * wv[u].z, (v[u].w * inv) * wv[u].w);
        }
        return;
    }
    PDL_WAIT();
    if (add) {
        const float* ar = add + (size_t)blockIdx.x * dim;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const float v = xr[i] + ar[i];
            xr[i] = v;
            ss += (double)v * (double)v;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += (double)xr[i] * (double)xr[i];
    }
    ss = block_sum_d(ss);
    float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = (xr[i] * inv) * w[i];
}

// NeoX rotation of the first 2*half values of `v` at `pos`.
__device__ void rope_apply(float* v, const float* inv_freq, int half, int pos) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf((float)pos * inv_freq[i], &s, &c);
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
    }
}

// Stand-alone RoPE on `[heads, hd]` rows at `pos` (test entry point).
extern "C" __global__ void rope(float* v, const float* inv_freq, int half, int hd, int pos) {
    PDL_START();
    rope_apply(v + (size_t)blockIdx.x * hd, inv_freq, half, pos);
}

// Per token t (grid.y) and head (grid.x < nh: query head, else KV head):
// q/k RMS norm, RoPE at pos0 + t, the gate split off, K and V appended to
// the caches at row pos0 + t. q_all rows hold per head [query(hd), gate(hd)]
// when gated (q_stride = 2 hd). `dpos`, when not null, replaces pos0 with
// the position held in device memory (so a CUDA graph can replay the
// launch at every position). 256 threads; hd <= 1024.
extern "C" __global__ void qk_prep(const float* __restrict__ q_all, const float* __restrict__ k_all,
                                  const float* __restrict__ v_all, const float* __restrict__ qn,
                                  const float* __restrict__ kn, const float* __restrict__ inv_freq, int half,
                                  int nh, int nkv, int hd, int q_stride, float eps, int pos0,
                                  float* __restrict__ q_out, float* __restrict__ gate_out,
                                  float* __restrict__ kcache, float* __restrict__ vcache,
                                  const int* __restrict__ dpos) {
    PDL_START();
    __shared__ float buf[1024];
    if (dpos) pos0 = dpos[0];
    int t = blockIdx.y, hh = blockIdx.x;
    const float* src;
    const float* nw;
    float* dst;
    if (hh < nh) {
        src = q_all + ((size_t)t * nh + hh) * q_stride;
        nw = qn;
        dst = q_out + ((size_t)t * nh + hh) * hd;
        if (gate_out)
            for (int i = threadIdx.x; i < hd; i += blockDim.x) gate_out[((size_t)t * nh + hh) * hd + i] = src[hd + i];
    } else {
        int kh = hh - nh;
        src = k_all + ((size_t)t * nkv + kh) * hd;
        nw = kn;
        dst = kcache + ((size_t)(pos0 + t) * nkv + kh) * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x)
            vcache[((size_t)(pos0 + t) * nkv + kh) * hd + i] = v_all[((size_t)t * nkv + kh) * hd + i];
    }
    double ss = 0.0;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) ss += (double)src[i] * (double)src[i];
    ss = block_sum_d(ss);
    float inv = 1.0f / sqrtf((float)(ss / hd) + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) buf[i] = (src[i] * inv) * nw[i];
    __syncthreads();
    rope_apply(buf, inv_freq, half, pos0 + t);
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = buf[i];
}

