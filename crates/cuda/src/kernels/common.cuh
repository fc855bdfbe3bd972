// Decode kernels of the CUDA backend, compiled at run time by NVRTC.
// No headers: f16/bf16 conversions are done by hand so NVRTC needs no
// include path. Activations are f32; weights keep their stored layout
// (see crates/core/src/quant.rs): affine rows are packed codes (low nibble
// = even element), then f16/bf16 scales, then biases, one per group.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

// Programmatic dependent launch (sm_90+; the host sets the launch
// attribute): every kernel lets the next one launch as soon as all its
// blocks run (PDL_TRIGGER), and waits for the previous kernel to finish and
// its writes to be visible (PDL_WAIT) before it reads anything a kernel
// wrote or writes anything. The weight matvecs issue their weight loads
// (read-only data no kernel writes) before that wait, so those loads overlap
// the previous kernel's tail and the launch gap (the expert kernels: see
// PDL_EXPERTS_START). Without the attribute the
// wait returns at once and the stream orders kernels as usual.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_TRIGGER() do {} while (0)
#define PDL_WAIT() do {} while (0)
#endif
#define PDL_START() do { PDL_TRIGGER(); PDL_WAIT(); } while (0)
// Every routed experts' gate/up kernel (and the fused one) waits before it
// lets the next kernel launch: moe_down_a4v, which always follows one, reads
// the expert bases the router kernel wrote (device routing) before its own
// wait, so the router must be done by the time it launches.
#define PDL_EXPERTS_START() do { PDL_WAIT(); PDL_TRIGGER(); } while (0)

// Weight kinds (must match `QKind` in src/lib.rs).
#define INFINITY __int_as_float(0x7f800000)
#define QT_F32 0
#define QT_F16 1
#define QT_BF16 2
#define QT_A4 3
#define QT_A8 4
// GGML block kinds (llama.cpp's types, as GGUF import keeps them): `group`
// is the block's elements (32, or 256 for the K-quants), the rows are whole
// blocks back to back in `codes`.
#define QT_Q4_0 5
#define QT_Q8_0 6
#define QT_Q4K 7
#define QT_Q5K 8
#define QT_Q6K 9

// One weight matrix `[rows, cols]`; for affine kinds `scales`/`biases` are
// `[rows, cols / group]`. Mirrors `WDesc` in src/lib.rs (repr(C)).
struct W {
    const u8* codes;
    const u16* scales;
    const u16* biases;
    int rows;
    int cols;
    int qt;
    int group;
    int scale_bf16;
    int pad;
};

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ float half_val(u16 h, int bf) { return bf ? bf16_to_f32(h) : f16_to_f32(h); }
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }

// The same layout at another base (experts: every record of a layer has
// the same part shapes). For affine kinds the scales and biases follow the
// codes back to back.
__device__ __forceinline__ W at_base(W t, const u8* p) {
    W w = t;
    w.codes = p;
    if (t.qt == QT_A4 || t.qt == QT_A8) {
        size_t cb = (size_t)t.rows * t.cols * (t.qt == QT_A4 ? 4 : 8) / 8;
        size_t sb = (size_t)t.rows * (t.cols / t.group) * 2;
        w.scales = (const u16*)(p + cb);
        w.biases = (const u16*)(p + cb + sb);
    }
    return w;
}

// at_base for affine 4-bit weights with a power-of-two group (no division).
__device__ __forceinline__ W at_base_a4(W t, const u8* p) {
    W w = t;
    const size_t cb = (size_t)t.rows * t.cols / 2;
    const size_t sb = ((size_t)t.rows * t.cols >> (__ffs(t.group) - 1)) * 2;
    w.codes = p;
    w.scales = (const u16*)(p + cb);
    w.biases = (const u16*)(p + cb + sb);
    return w;
}

// Bytes of one block of a GGML kind.
__device__ __forceinline__ int ggml_block_bytes(int qt) {
    return qt == QT_Q4_0 ? 18 : qt == QT_Q8_0 ? 34 : qt == QT_Q4K ? 144 : qt == QT_Q5K ? 176 : 210;
}

__device__ __forceinline__ float f16_at(const u8* b, int i) { return f16_to_f32(__ldg((const u16*)(b + i))); }

// The 32 weights of sub-block `sub` (elements 32 sub ..) of the GGML block
// at `b`, dequantized with the reference's products (crates/kernels
// ggml.rs, gguf-py: multiply and subtract never fused), into w.
__device__ __forceinline__ void ggml_sub(const u8* __restrict__ b, int qt, int sub, float* w) {
    if (qt == QT_Q4_0) {
        const float d = f16_at(b, 0);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const u32 q = __ldg(b + 2 + j);
            w[j] = __fmul_rn(d, (float)((int)(q & 15u) - 8));
            w[j + 16] = __fmul_rn(d, (float)((int)(q >> 4) - 8));
        }
    } else if (qt == QT_Q8_0) {
        const float d = f16_at(b, 0);
#pragma unroll
        for (int j = 0; j < 32; j++) w[j] = __fmul_rn((float)(signed char)__ldg(b + 2 + j), d);
    } else if (qt == QT_Q4K || qt == QT_Q5K) {
        const bool five = qt == QT_Q5K;
        const float d = f16_at(b, 0), dmin = f16_at(b, 2);
        const u8* sc = b + 4;
        const int j = sub;
        u32 scj, mj;
        if (j < 4) {
            scj = __ldg(sc + j) & 63u;
            mj = __ldg(sc + j + 4) & 63u;
        } else {
            scj = (__ldg(sc + j + 4) & 0xFu) | ((__ldg(sc + j - 4) >> 6) << 4);
            mj = (__ldg(sc + j + 4) >> 4) | ((__ldg(sc + j) >> 6) << 4);
        }
        const float dj = __fmul_rn(d, (float)scj), mm = __fmul_rn(dmin, (float)mj);
        const u8* qh = b + 16;
        const u8* ql = b + (five ? 48 : 16) + 32 * (j >> 1);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            u32 q = (__ldg(ql + l) >> shift) & 15u;
            if (five) q |= ((__ldg(qh + l) >> j) & 1u) << 4;
            w[l] = __fsub_rn(__fmul_rn(dj, (float)q), mm);
        }
    } else {
        // Q6_K: element e = h 128 + k 32 + l with sub = 4 h + k.
        const int h = sub >> 2, k = sub & 3;
        const float d = f16_at(b, 208);
        const u8* ql = b + h * 64 + (k & 1) * 32;
        const u8* qh = b + 128 + h * 32;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            const u32 nibv = (__ldg(ql + l) >> (4 * (k >> 1))) & 15u;
            const u32 hb = (__ldg(qh + l) >> (2 * k)) & 3u;
            const int q = (int)(nibv | (hb << 4)) - 32;
            const float sc = __fmul_rn(d, (float)(signed char)__ldg(b + 192 + (32 * sub + l) / 16));
            w[l] = __fmul_rn(sc, (float)q);
        }
    }
}

// Dot of row `r` of `w` with `x` (`[cols]`, 16-byte aligned), one warp;
// the result is valid in every lane.
__device__ __forceinline__ float row_dot(const W& w, int r, const float* __restrict__ x, int lane) {
    float acc = 0.0f;
    const int cols = w.cols;
    if (w.qt == QT_A4) {
        const u32* c = (const u32*)(w.codes + (size_t)r * cols / 2);
        const int ng = cols / w.group;
        const u16* s = w.scales + (size_t)r * ng;
        const u16* b = w.biases + (size_t)r * ng;
        const int nw = cols / 8;
        // Unrolled so a 2048-column row's loads are all in flight at once
        // (the summation order is the loop's either way).
#pragma unroll 8
        for (int i = lane; i < nw; i += 32) {
            u32 q = __ldg(c + i);
            int j = i * 8;
            int g = j / w.group;
            float4 x0 = *(const float4*)(x + j);
            float4 x1 = *(const float4*)(x + j + 4);
            float qx = (float)(q & 15u) * x0.x + (float)((q >> 4) & 15u) * x0.y +
                       (float)((q >> 8) & 15u) * x0.z + (float)((q >> 12) & 15u) * x0.w +
                       (float)((q >> 16) & 15u) * x1.x + (float)((q >> 20) & 15u) * x1.y +
                       (float)((q >> 24) & 15u) * x1.z + (float)(q >> 28) * x1.w;
            float xs = ((x0.x + x0.y) + (x0.z + x0.w)) + ((x1.x + x1.y) + (x1.z + x1.w));
            acc += half_val(__ldg(s + g), w.scale_bf16) * qx + half_val(__ldg(b + g), w.scale_bf16) * xs;
        }
    } else if (w.qt == QT_A8) {
        const u32* c = (const u32*)(w.codes + (size_t)r * cols);
        const int ng = cols / w.group;
        const u16* s = w.scales + (size_t)r * ng;
        const u16* b = w.biases + (size_t)r * ng;
        const int nw = cols / 4;
        // 16: a 2048-column row (the router) in one round of loads.
#pragma unroll 16
        for (int i = lane; i < nw; i += 32) {
            u32 q = __ldg(c + i);
            int j = i * 4;
            int g = j / w.group;
            float4 x0 = *(const float4*)(x + j);
            float qx = (float)(q & 255u) * x0.x + (float)((q >> 8) & 255u) * x0.y +
                       (float)((q >> 16) & 255u) * x0.z + (float)(q >> 24) * x0.w;
            float xs = (x0.x + x0.y) + (x0.z + x0.w);
            acc += half_val(__ldg(s + g), w.scale_bf16) * qx + half_val(__ldg(b + g), w.scale_bf16) * xs;
        }
    } else if (w.qt == QT_F32) {
        const float* row = (const float*)w.codes + (size_t)r * cols;
        for (int j = lane; j < cols; j += 32) acc += __ldg(row + j) * x[j];
    } else if (w.qt >= QT_Q4_0) {
        // GGML blocks: lane takes 32-element sub-blocks lane, lane + 32, ..
        const int per = w.group >> 5, bb = ggml_block_bytes(w.qt);
        const u8* row = w.codes + (size_t)r * (cols / w.group) * bb;
        for (int u = lane; u < (cols >> 5); u += 32) {
            float wv[32];
            ggml_sub(row + (size_t)(u / per) * bb, w.qt, u % per, wv);
            const float* xs = x + 32 * u;
            float s = 0.0f;
#pragma unroll
            for (int l = 0; l < 32; l++) s += wv[l] * xs[l];
            acc += s;
        }
    } else {
        const u16* row = (const u16*)w.codes + (size_t)r * cols;
        const int bf = w.qt == QT_BF16;
        if ((cols & 1) == 0) {
            const u32* r2 = (const u32*)row;
#pragma unroll 4
            for (int i = lane; i < cols / 2; i += 32) {
                u32 v = __ldg(r2 + i);
                acc += half_val((u16)(v & 0xffffu), bf) * x[2 * i] + half_val((u16)(v >> 16), bf) * x[2 * i + 1];
            }
        } else {
            for (int j = lane; j < cols; j += 32) acc += half_val(__ldg(row + j), bf) * x[j];
        }
    }
    return warp_sum(acc);
}

