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

// Code k (0..3) of a word of four byte-sized codes as an exact float:
// PRMT builds 0x4B0000cc (= 2^23 + c), one FADD removes 2^23 (no I2F).
__device__ __forceinline__ float nib(u32 v, int k) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7540u + k)) - 8388608.0f;
}

// Affine 4-bit dot products of rows r0..r0+R of `w` with `x`, one warp:
// each lane loads NW words (8*NW codes, one group or less) per step, keeps
// those 8*NW values of x in registers and reuses them for all R rows, so x
// costs one read per R rows. Requires group % (8*NW) == 0. out[rr] is valid
// in every lane.
template <int R, int NW>
__device__ __forceinline__ void rows_a4(const W& w, int r0, const float* __restrict__ x, int lane, float* out) {
    const int cols = w.cols;
    const int per = 8 * NW;
    const int nv = cols / per;
    const int ng = cols / w.group;
    float acc[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) acc[rr] = 0.0f;
    for (int i = lane; i < nv; i += 32) {
        const int j = i * per;
        float xv[8 * NW];
        float xs = 0.0f;
#pragma unroll
        for (int c = 0; c < 2 * NW; c++) {
            float4 t = *(const float4*)(x + j + 4 * c);
            xv[4 * c] = t.x;
            xv[4 * c + 1] = t.y;
            xv[4 * c + 2] = t.z;
            xv[4 * c + 3] = t.w;
            xs += (t.x + t.y) + (t.z + t.w);
        }
        const int g = j / w.group;
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            const int r = r0 + rr;
            if (r >= w.rows) break;
            const u32* cp = (const u32*)(w.codes + (size_t)r * cols / 2) + (size_t)i * NW;
            u32 q[NW];
            if (NW == 4) {
                uint4 v = __ldg((const uint4*)cp);
                q[0] = v.x; q[NW > 1 ? 1 : 0] = v.y; q[NW > 2 ? 2 : 0] = v.z; q[NW > 3 ? 3 : 0] = v.w;
            } else if (NW == 2) {
                uint2 v = __ldg((const uint2*)cp);
                q[0] = v.x; q[NW > 1 ? 1 : 0] = v.y;
            } else {
                q[0] = __ldg(cp);
            }
            float qx = 0.0f;
#pragma unroll
            for (int wi = 0; wi < NW; wi++) {
                u32 lo = q[wi] & 0x0F0F0F0Fu;
                u32 hi = (q[wi] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    qx += nib(lo, m) * xv[wi * 8 + 2 * m];
                    qx += nib(hi, m) * xv[wi * 8 + 2 * m + 1];
                }
            }
            const size_t gi = (size_t)r * ng + g;
            acc[rr] += half_val(__ldg(w.scales + gi), w.scale_bf16) * qx +
                       half_val(__ldg(w.biases + gi), w.scale_bf16) * xs;
        }
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) out[rr] = warp_sum(acc[rr]);
}

#define A4_R 4
// rows_a4 with the load width chosen at run time (nw in {4, 2, 1}).
__device__ __forceinline__ void rows_a4_any(const W& w, int r0, const float* __restrict__ x, int lane, int nw,
                                            float* out) {
    if (nw == 4)
        rows_a4<A4_R, 4>(w, r0, x, lane, out);
    else if (nw == 2)
        rows_a4<A4_R, 2>(w, r0, x, lane, out);
    else
        rows_a4<A4_R, 1>(w, r0, x, lane, out);
}

// Affine 4-bit matvec: 128 threads, A4_R rows per warp (16 per block);
// grid (ceil(rows / 16), n).
extern "C" __global__ void matvec_a4(W w, const float* __restrict__ x, float* __restrict__ y, int nw) {
    PDL_START();
    int lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * A4_R;
    int t = blockIdx.y;
    if (r0 >= w.rows) return;
    float o[A4_R];
    rows_a4_any(w, r0, x + (size_t)t * w.cols, lane, nw, o);
    if (lane < A4_R && r0 + lane < w.rows) {
        float v = o[0];
#pragma unroll
        for (int rr = 1; rr < A4_R; rr++)
            if (lane == rr) v = o[rr];
        y[(size_t)t * w.rows + r0 + lane] = v;
    }
}

// moe_gate_up for affine 4-bit experts (see below); grid (ceil(I / 16), pairs), 128 threads.
extern "C" __global__ void moe_gate_up_a4(W gt, W ut, const u64* __restrict__ gbase, const u64* __restrict__ ubase,
                                          const int* __restrict__ xrow, const float* __restrict__ x,
                                          float* __restrict__ h, int nw) {
    PDL_EXPERTS_START();
    int lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * A4_R;
    int p = blockIdx.y;
    if (r0 >= gt.rows) return;
    W g = at_base(gt, (const u8*)gbase[p]);
    W u = at_base(ut, (const u8*)ubase[p]);
    const float* xp = x + (size_t)xrow[p] * gt.cols;
    float go[A4_R], uo[A4_R];
    rows_a4_any(g, r0, xp, lane, nw, go);
    rows_a4_any(u, r0, xp, lane, nw, uo);
    if (lane < A4_R && r0 + lane < gt.rows) {
        float gv = go[0], uv = uo[0];
#pragma unroll
        for (int rr = 1; rr < A4_R; rr++)
            if (lane == rr) {
                gv = go[rr];
                uv = uo[rr];
            }
        h[(size_t)p * gt.rows + r0 + lane] = siluf_(gv) * uv;
    }
}

// moe_down for affine 4-bit experts (see below); grid (ceil(H / 16), tokens), 128 threads.
extern "C" __global__ void moe_down_a4(W dt, const u64* __restrict__ dbase, const float* __restrict__ h,
                                       const float* __restrict__ wts, int K, const float* __restrict__ shared,
                                       const float* __restrict__ sg, float* __restrict__ x, int nw) {
    PDL_START();
    int lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * A4_R;
    int t = blockIdx.y;
    if (r0 >= dt.rows) return;
    float acc[A4_R];
#pragma unroll
    for (int rr = 0; rr < A4_R; rr++) acc[rr] = 0.0f;
    for (int k = 0; k < K; k++) {
        int p = t * K + k;
        W d = at_base(dt, (const u8*)dbase[p]);
        float o[A4_R];
        rows_a4_any(d, r0, h + (size_t)p * dt.cols, lane, nw, o);
        float wk = wts[p];
#pragma unroll
        for (int rr = 0; rr < A4_R; rr++) acc[rr] += o[rr] * wk;
    }
    if (lane < A4_R && r0 + lane < dt.rows) {
        float v = acc[0];
#pragma unroll
        for (int rr = 1; rr < A4_R; rr++)
            if (lane == rr) v = acc[rr];
        int r = r0 + lane;
        float s = 0.0f;
        if (shared) s = sigmoidf_(sg[t]) * shared[(size_t)t * dt.rows + r];
        x[(size_t)t * dt.rows + r] += v + s;
    }
}

// ---- Wide affine 4-bit kernels ("a4v"): group % 32 == 0 and cols = 32 * S
// with S a power of two <= 32, or S = 32 * C with C in {1, 2, 4}.
// A chunk is 16 bytes of codes: 32 values under one scale and bias. A row's
// S chunks are spread over L = min(32, S) lanes (C chunks per lane), so a
// warp step covers RW = 32 / L rows and every lane issues all its 16-byte
// loads (R rows x C chunks, for each matrix) before it waits on any; x is
// staged meanwhile in shared memory, padded by 4 floats per 32 so the lanes'
// 128-byte-strided reads fall on distinct banks. Partial sums are reduced
// over the L lanes of a row with shuffles (a fixed tree: deterministic).

#define XPAD(i) ((i) + ((i) >> 5) * 4)

// Dynamic shared memory of the a4v kernels (16-byte aligned).
extern __shared__ float4 a4v_dyn[];

// Copies n floats (n % 4 == 0, 16-byte aligned) of src into padded shared
// memory xs, all threads of the block.
__device__ __forceinline__ void stage_x(float* xs, const float* __restrict__ src, int n) {
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
        float4 v = *(const float4*)(src + i);
        *(float4*)(xs + XPAD(i)) = v;
    }
}

// The 32 staged x values of chunk j.
__device__ __forceinline__ void load_chunk_x(const float* xs, int j, float* xv) {
    const float* p = xs + 36 * j;
#pragma unroll
    for (int c = 0; c < 8; c++) {
        float4 t = *(const float4*)(p + 4 * c);
        xv[4 * c] = t.x;
        xv[4 * c + 1] = t.y;
        xv[4 * c + 2] = t.z;
        xv[4 * c + 3] = t.w;
    }
}

// After staging nch chunks: the sum of each chunk's 32 values into
// sums[j] (once per block instead of once per lane and chunk). The block
// must synchronise before and after.
__device__ __forceinline__ void chunk_sums(const float* xs, int nch, float* sums) {
    for (int j = threadIdx.x; j < nch; j += blockDim.x) {
        const float* p = xs + 36 * j;
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; c++) {
            float4 t = *(const float4*)(p + 4 * c);
            s += (t.x + t.y) + (t.z + t.w);
        }
        sums[j] = s;
    }
}

// sum_i (0.5 + code_i / 32) * xv[i] over the 32 codes of q (low nibble =
// even element). Each code becomes an exact float in one PRMT: the words
// are pre-shifted so a code sits at bits 3..6 of its byte, and PRMT moves
// that byte under the exponent byte 0x3F (0x3F000000 | c << 19 = 0.5 + c/32).
// With A this sum and xs the sum of xv, sum_i c_i xv[i] = 32 A - 16 xs, so
// scale * qx + bias * xs = (32 scale) A + (bias - 16 scale) xs
// ([`chunk_dot`]): no per-code subtraction. Two chains per row for ILP.
// Byte m of a pre-shifted word (lo = (w << 3) & 0x78787878 for the low
// nibbles, hi = (w >> 1) & 0x78787878 for the high ones) as 0.5 + c / 32.
__device__ __forceinline__ float code_f(u32 shifted, int m) {
    return __uint_as_float(__byte_perm(shifted, 0x3F000000u, 0x7054u | (m << 8)));
}
__device__ __forceinline__ float chunk_a(uint4 q, const float* xv) {
    u32 w[4] = {q.x, q.y, q.z, q.w};
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
    for (int wi = 0; wi < 4; wi++) {
        const u32 lo = (w[wi] << 3) & 0x78787878u;
        const u32 hi = (w[wi] >> 1) & 0x78787878u;
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const float fl = code_f(lo, m), fh = code_f(hi, m);
            if (wi & 1) {
                a1 = fmaf(fl, xv[wi * 8 + 2 * m], a1);
                a1 = fmaf(fh, xv[wi * 8 + 2 * m + 1], a1);
            } else {
                a0 = fmaf(fl, xv[wi * 8 + 2 * m], a0);
                a0 = fmaf(fh, xv[wi * 8 + 2 * m + 1], a0);
            }
        }
    }
    return a0 + a1;
}

// A chunk's scale * sum_i code_i xv[i] + bias * xs from chunk_a's sum a.
__device__ __forceinline__ float chunk_combine(float a, float xs, float scale, float bias) {
    return fmaf(32.0f * scale, a, fmaf(-16.0f, scale, bias) * xs);
}

// scale * sum_i code_i xv[i] + bias * xs for one chunk (see chunk_a).
__device__ __forceinline__ float chunk_dot(uint4 q, const float* xv, float xs, float scale, float bias) {
    return chunk_combine(chunk_a(q, xv), xs, scale, bias);
}

// Makes n loaded code/scale/bias entries opaque to the compiler, so a loop
// over tokens converts the codes in the loop instead of hoisting n * 32
// converted floats out of it (registers).
template <int N>
__device__ __forceinline__ void launder_codes(uint4* q, u16* sr, u16* br) {
#pragma unroll
    for (int e = 0; e < N; e++) {
        asm volatile("" : "+r"(q[e].x), "+r"(q[e].y), "+r"(q[e].z), "+r"(q[e].w));
        asm volatile("" : "+h"(sr[e]), "+h"(br[e]));
    }
}

// Sum over the L lanes of a row segment (L a power of two, <= 32).
__device__ __forceinline__ float seg_sum(float v, int L) {
    for (int o = L >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Rows of M matrices sharing x (gate and up: M = 2) for one x row, in two
// steps: tile_a4v_load issues the 16-byte code loads (and scales, biases)
// into flat arrays of M * R * C entries, index (m * R + rr) * C + c;
// tile_a4v_dot stages x, then computes the dot products. Block: 256
// threads; a warp owns rows base + rr * RW + sub (rr < R). out[m][rr] is
// valid in the lanes with li == 0. Every thread of the block must call
// tile_a4v_dot (barrier).
template <int C, int R, int M>
__device__ __forceinline__ void tile_a4v_load(const W* w, int base, int sub, int li, int L, int RW, uint4* q,
                                              u16* sr, u16* br) {
    const int cols = w[0].cols;
    const int rows = w[0].rows;
    const int gsh = __ffs(w[0].group) - 1;  // group = 2^gsh (a4v only takes those)
    const int ng = cols >> gsh;
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            const int r = min(base + rr * RW + sub, rows - 1);
            const uint4* cp = (const uint4*)(w[m].codes + (size_t)r * cols / 2);
#pragma unroll
            for (int c = 0; c < C; c++) {
                const int j = li + L * c;
                const int e = (m * R + rr) * C + c;
                q[e] = __ldg(cp + j);
                const size_t gi = (size_t)r * ng + ((j * 32) >> gsh);
                sr[e] = __ldg(w[m].scales + gi);
                br[e] = __ldg(w[m].biases + gi);
            }
        }
}

template <int C, int R, int M>
__device__ __forceinline__ void tile_a4v_dot(const W* w, const float* __restrict__ x, float* xs, int li, int L,
                                             const uint4* q, const u16* sr, const u16* br, float (*out)[R]) {
    const int cols = w[0].cols;
    stage_x(xs, x, cols);
    __syncthreads();
    float* sums = xs + 36 * (cols >> 5);
    chunk_sums(xs, cols >> 5, sums);
    __syncthreads();
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int rr = 0; rr < R; rr++) acc[m][rr] = 0.0f;
    const int bf = w[0].scale_bf16;
#pragma unroll
    for (int c = 0; c < C; c++) {
        float xv[32];
        load_chunk_x(xs, li + L * c, xv);
        const float xsum = sums[li + L * c];
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                const int e = (m * R + rr) * C + c;
                acc[m][rr] += chunk_dot(q[e], xv, xsum, half_val(sr[e], bf), half_val(br[e], bf));
            }
    }
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int rr = 0; rr < R; rr++) out[m][rr] = seg_sum(acc[m][rr], L);
}

// Floats of one staged x row of nch chunks (padded chunks, then the chunk
// sums), rounded up to 16 bytes so consecutive rows stay aligned.
__device__ __forceinline__ int a4v_region(int nch) { return (37 * nch + 3) & ~3; }

// tile_a4v_dot for T tokens at once, x staged for each token t in region
// xs + t * a4v_region(nch) (padded chunks, then the chunk sums), the block
// synchronised after staging. Each code is converted once for the T
// tokens and each staged x value read once for the M * R rows; every
// (row, token) gets chunk_a's and chunk_dot's operations in their order,
// then seg_sum, so the bits of a one-token launch. out[m][rr][t] is valid
// in the lanes with li == 0.
template <int C, int R, int M, int T>
__device__ __forceinline__ void tile_a4v_dot_tokens(const W* w, const float* xs, int li, int L, const uint4* q,
                                                    const u16* sr, const u16* br, float (*out)[R][T]) {
    const int nch = w[0].cols >> 5;
    const int region = a4v_region(nch);
    const int bf = w[0].scale_bf16;
    float acc[M][R][T];
#pragma unroll
    for (int e = 0; e < M * R; e++)
#pragma unroll
        for (int t = 0; t < T; t++) acc[e / R][e % R][t] = 0.0f;
#pragma unroll
    for (int c = 0; c < C; c++) {
        const int j = li + L * c;
        float a0[M * R][T], a1[M * R][T];
#pragma unroll
        for (int e = 0; e < M * R; e++)
#pragma unroll
            for (int t = 0; t < T; t++) a0[e][t] = a1[e][t] = 0.0f;
#pragma unroll
        for (int wi = 0; wi < 4; wi++) {
            float xv[T][8];
#pragma unroll
            for (int t = 0; t < T; t++) {
                const float* p = xs + t * region + 36 * j + wi * 8;
                const float4 u = *(const float4*)p, v = *(const float4*)(p + 4);
                xv[t][0] = u.x, xv[t][1] = u.y, xv[t][2] = u.z, xv[t][3] = u.w;
                xv[t][4] = v.x, xv[t][5] = v.y, xv[t][6] = v.z, xv[t][7] = v.w;
            }
#pragma unroll
            for (int e = 0; e < M * R; e++) {
                const uint4 qe = q[e * C + c];
                const u32 word = wi == 0 ? qe.x : wi == 1 ? qe.y : wi == 2 ? qe.z : qe.w;
                const u32 lo = (word << 3) & 0x78787878u;
                const u32 hi = (word >> 1) & 0x78787878u;
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    const float fl = code_f(lo, m), fh = code_f(hi, m);
#pragma unroll
                    for (int t = 0; t < T; t++) {
                        float& a = (wi & 1) ? a1[e][t] : a0[e][t];
                        a = fmaf(fl, xv[t][2 * m], a);
                        a = fmaf(fh, xv[t][2 * m + 1], a);
                    }
                }
            }
        }
#pragma unroll
        for (int e = 0; e < M * R; e++) {
            const float scale = half_val(sr[e * C + c], bf), bias = half_val(br[e * C + c], bf);
#pragma unroll
            for (int t = 0; t < T; t++) {
                const float xsum = xs[t * region + 36 * nch + j];
                acc[e / R][e % R][t] += chunk_combine(a0[e][t] + a1[e][t], xsum, scale, bias);
            }
        }
    }
#pragma unroll
    for (int e = 0; e < M * R; e++)
#pragma unroll
        for (int t = 0; t < T; t++) out[e / R][e % R][t] = seg_sum(acc[e / R][e % R][t], L);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define CP_ASYNC_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")
#else
#define CP_ASYNC_COMMIT() do {} while (0)
#define CP_ASYNC_WAIT(n) do {} while (0)
#endif
// Issues asynchronous copies (cp.async, 16 bytes each, no registers; plain
// copies below sm_80) of
// the T x rows at `rows(u)` (u < T) into the padded regions of buf, as one
// commit group. All threads of the block call it.
template <int T, typename Row>
__device__ __forceinline__ void stage_x_tokens_async(float* buf, int cols, Row rows) {
    const int region = a4v_region(cols >> 5);
#pragma unroll
    for (int u = 0; u < T; u++) {
        const float* src = rows(u);
        float* dst = buf + u * region;
        for (int i = threadIdx.x * 4; i < cols; i += blockDim.x * 4) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
            const u32 sa = (u32)__cvta_generic_to_shared(dst + XPAD(i));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(src + i) : "memory");
#else
            *(float4*)(dst + XPAD(i)) = *(const float4*)(src + i);
#endif
        }
    }
    CP_ASYNC_COMMIT();
}

// Runs `tile(buf, i)` over tiles i = 0 .. ntiles - 1 of T staged x rows
// each (`rows(i, u)`: the x row of slot u of tile i), double-buffered: the
// copies of tile i + 1 are in flight while tile i is computed. Before
// `tile` runs, buf holds tile i's rows and their chunk sums and the block
// is synchronised; `tile` must not synchronise. xs: 2 * T *
// a4v_region(cols / 32) floats. All threads of the block call it.
template <int T, typename Row, typename Tile>
__device__ __forceinline__ void a4v_tiles(float* xs, int cols, int ntiles, Row rows, Tile tile) {
    const int nch = cols >> 5, region = a4v_region(nch);
    if (ntiles <= 0) return;
    stage_x_tokens_async<T>(xs, cols, [&](int u) { return rows(0, u); });
#pragma unroll 1
    for (int i = 0; i < ntiles; i++) {
        float* cur = xs + (i & 1) * T * region;
        if (i + 1 < ntiles) {
            // The other buffer was last read by tile i - 1, before the
            // barrier that ended it.
            stage_x_tokens_async<T>(xs + ((i + 1) & 1) * T * region, cols, [&](int u) { return rows(i + 1, u); });
            CP_ASYNC_WAIT(1);
        } else {
            CP_ASYNC_WAIT(0);
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < T; u++) chunk_sums(cur + u * region, nch, cur + u * region + 36 * nch);
        __syncthreads();
        tile(cur, i);
        __syncthreads();
    }
}

// Tokens per tile of the prefill form (tile_a4v_dot_tokens).
#define A4V_TILE_TOKENS 2

// Affine 4-bit matvec, wide form: 256 threads, dynamic shared memory
// 37 * cols / 32 floats (the prefill form: a4v_tiles' 2 * A4V_TILE_TOKENS
// * a4v_region(cols / 32)). A block loads its rows' codes, scales and
// biases once (before PDL_WAIT) and runs them over tokens [t0, t0 + tn).
// MANY = false: one token (grid (ceil(rows / (8 * RW * R)), n), t0 =
// blockIdx.y); MANY = true: the prefill form, grid (ceil(n / tpb), row
// blocks) (MVT_TOKENS), the weights read once
// per tpb tokens and the tokens staged and computed A4V_TILE_TOKENS at a
// time. Either way each token gets the same operations in the same order
// (same bits).
template <int C, int R, bool MANY>
__device__ __forceinline__ void matvec_a4v_body(const W& w, const float* __restrict__ x, float* __restrict__ y,
                                                int blk, int t0, int tn) {
    float* xs = (float*)a4v_dyn;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int S = w.cols >> 5;
    const int L = S < 32 ? S : 32;
    const int RW = 32 / L;
    const int sub = lane / L, li = lane % L;
    const int base = (blk * (blockDim.x >> 5) + warp) * RW * R;
    uint4 q[R * C];
    u16 sr[R * C], br[R * C];
    tile_a4v_load<C, R, 1>(&w, base, sub, li, L, RW, q, sr, br);
    PDL_WAIT();
    auto token = [&](int t) {
        float o[1][R];
        tile_a4v_dot<C, R, 1>(&w, x + (size_t)t * w.cols, xs, li, L, q, sr, br, o);
        if (li == 0) {
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                const int r = base + rr * RW + sub;
                if (r < w.rows) y[(size_t)t * w.rows + r] = o[0][rr];
            }
        }
    };
    if constexpr (!MANY) {
        token(t0);
    } else {
        constexpr int T = A4V_TILE_TOKENS;
        // A tile past the pass's last token stages that token again
        // (computed, not written).
        auto rows = [&](int i, int u) { return x + (size_t)min(t0 + i * T + u, t0 + tn - 1) * w.cols; };
        a4v_tiles<T>(xs, w.cols, (tn + T - 1) / T, rows, [&](const float* cur, int i) {
            launder_codes<R * C>(q, sr, br);
            const int t = t0 + i * T;
            float o[1][R][T];
            tile_a4v_dot_tokens<C, R, 1, T>(&w, cur, li, L, q, sr, br, o);
            if (li == 0) {
#pragma unroll
                for (int rr = 0; rr < R; rr++) {
                    const int r = base + rr * RW + sub;
#pragma unroll
                    for (int u = 0; u < T; u++)
                        if (r < w.rows && t + u < t0 + tn) y[(size_t)(t + u) * w.rows + r] = o[0][rr][u];
                }
            }
        });
    }
}
extern "C" __global__ void matvec_a4v_c1(W w, const float* __restrict__ x, float* __restrict__ y) {
    PDL_TRIGGER();
    matvec_a4v_body<1, 8, false>(w, x, y, blockIdx.x, blockIdx.y, 1);
}
extern "C" __global__ void matvec_a4v_c2(W w, const float* __restrict__ x, float* __restrict__ y) {
    PDL_TRIGGER();
    matvec_a4v_body<2, 4, false>(w, x, y, blockIdx.x, blockIdx.y, 1);
}
extern "C" __global__ void matvec_a4v_c4(W w, const float* __restrict__ x, float* __restrict__ y) {
    PDL_TRIGGER();
    matvec_a4v_body<4, 2, false>(w, x, y, blockIdx.x, blockIdx.y, 1);
}
#define MVT_ARGS W w, const float* __restrict__ x, float* __restrict__ y, int n, int tpb
// Grid (ceil(n / tpb), row blocks): the token blocks of the same rows are
// neighbours in launch order, so they run together and their weight rows
// come from HBM once (L2 for the rest).
#define MVT_TOKENS blockIdx.y, blockIdx.x * tpb, min(tpb, n - (int)blockIdx.x * tpb)
extern "C" __global__ void __launch_bounds__(256, 2) matvec_a4v_t_c1(MVT_ARGS) {
    PDL_TRIGGER();
    matvec_a4v_body<1, 8, true>(w, x, y, MVT_TOKENS);
}
extern "C" __global__ void __launch_bounds__(256, 2) matvec_a4v_t_c2(MVT_ARGS) {
    PDL_TRIGGER();
    matvec_a4v_body<2, 4, true>(w, x, y, MVT_TOKENS);
}
extern "C" __global__ void __launch_bounds__(256, 2) matvec_a4v_t_c4(MVT_ARGS) {
    PDL_TRIGGER();
    matvec_a4v_body<4, 2, true>(w, x, y, MVT_TOKENS);
}

// Up to 4 matrices of the same column count sharing the input x in one
// launch (the projections of one layer): blocks [0, b1) compute w0 into
// y0, [b1, b2) w1 into y1, [b2, b3) w2, [b3, grid) w3; each block exactly
// as its own matvec_a4v launch would (same bits, fewer launches).
#define MULTI_ARGS W w0, W w1, W w2, W w3, int b1, int b2, int b3, const float* __restrict__ x, \
    float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2, float* __restrict__ y3
template <int C, int R>
__device__ __forceinline__ void matvec_a4v_multi(MULTI_ARGS) {
    const int b = blockIdx.x;
    if (b < b1) matvec_a4v_body<C, R, false>(w0, x, y0, b, 0, 1);
    else if (b < b2) matvec_a4v_body<C, R, false>(w1, x, y1, b - b1, 0, 1);
    else if (b < b3) matvec_a4v_body<C, R, false>(w2, x, y2, b - b2, 0, 1);
    else matvec_a4v_body<C, R, false>(w3, x, y3, b - b3, 0, 1);
}
extern "C" __global__ void matvec_a4v_multi_c1(MULTI_ARGS) { PDL_TRIGGER(); matvec_a4v_multi<1, 8>(w0, w1, w2, w3, b1, b2, b3, x, y0, y1, y2, y3); }
extern "C" __global__ void matvec_a4v_multi_c2(MULTI_ARGS) { PDL_TRIGGER(); matvec_a4v_multi<2, 4>(w0, w1, w2, w3, b1, b2, b3, x, y0, y1, y2, y3); }
extern "C" __global__ void matvec_a4v_multi_c4(MULTI_ARGS) { PDL_TRIGGER(); matvec_a4v_multi<4, 2>(w0, w1, w2, w3, b1, b2, b3, x, y0, y1, y2, y3); }

// Routed experts' gate and up, wide form (same result as moe_gate_up):
// grid (ceil(I / (8 * RW * R)), pairs), 256 threads, dynamic shared memory
// 37 * H / 32 floats. Gate and up rows are loaded together and share x.
// The geometry of one gate/up block: its two weights, first row and lane roles.
struct GuGeom {
    W w[2];
    int base, sub, li, L, RW;
};
template <int R>
__device__ __forceinline__ GuGeom gu_geom(const W& gt, const W& ut, const u64* __restrict__ gbase,
                                          const u64* __restrict__ ubase, int bx, int p) {
    GuGeom g;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int S = gt.cols >> 5;
    g.L = S < 32 ? S : 32;
    g.RW = 32 / g.L;
    g.sub = lane / g.L;
    g.li = lane % g.L;
    g.base = (bx * (blockDim.x >> 5) + warp) * g.RW * R;
    g.w[0] = at_base_a4(gt, (const u8*)gbase[p]);
    g.w[1] = at_base_a4(ut, (const u8*)ubase[p]);
    return g;
}

// Issues the loads of gate/up block (bx, p) into q/sr/br (2 * R * C entries).
template <int C, int R>
__device__ __forceinline__ void gate_up_a4v_load(const W& gt, const W& ut, const u64* __restrict__ gbase,
                                                 const u64* __restrict__ ubase, int bx, int p, uint4* q, u16* sr,
                                                 u16* br) {
    const GuGeom g = gu_geom<R>(gt, ut, gbase, ubase, bx, p);
    tile_a4v_load<C, R, 2>(g.w, g.base, g.sub, g.li, g.L, g.RW, q, sr, br);
}

// One gate/up block (bx, p): h[p, rows] = silu(gate . x) * (up . x). With
// `loaded` the block's loads were issued already (gate_up_a4v_load).
template <int C, int R>
__device__ __forceinline__ void gate_up_a4v_unit(W gt, W ut, const u64* __restrict__ gbase,
                                                 const u64* __restrict__ ubase, const int* __restrict__ xrow,
                                                 const float* __restrict__ x, float* __restrict__ h, int bx, int p,
                                                 bool loaded, uint4* q, u16* sr, u16* br) {
    float* xs = (float*)a4v_dyn;
    const GuGeom g = gu_geom<R>(gt, ut, gbase, ubase, bx, p);
    if (!loaded) tile_a4v_load<C, R, 2>(g.w, g.base, g.sub, g.li, g.L, g.RW, q, sr, br);
    PDL_WAIT();
    float o[2][R];
    tile_a4v_dot<C, R, 2>(g.w, x + (size_t)xrow[p] * gt.cols, xs, g.li, g.L, q, sr, br, o);
    if (g.li == 0) {
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            const int r = g.base + rr * g.RW + g.sub;
            if (r < gt.rows) h[(size_t)p * gt.rows + r] = siluf_(o[0][rr]) * o[1][rr];
        }
    }
}
template <int C, int R>
__device__ __forceinline__ void gate_up_a4v_kernel(W gt, W ut, const u64* __restrict__ gbase,
                                                   const u64* __restrict__ ubase, const int* __restrict__ xrow,
                                                   const float* __restrict__ x, float* __restrict__ h) {
    uint4 q[2 * R * C];
    u16 sr[2 * R * C], br[2 * R * C];
    gate_up_a4v_unit<C, R>(gt, ut, gbase, ubase, xrow, x, h, blockIdx.x, blockIdx.y, false, q, sr, br);
}
#define GU_ARGS                                                                                                \
    W gt, W ut, const u64 *__restrict__ gbase, const u64 *__restrict__ ubase, const int *__restrict__ xrow, \
        const float *__restrict__ x, float *__restrict__ h
#define GU_CALL gt, ut, gbase, ubase, xrow, x, h
// Blocks of 256 threads the routed experts' wide kernels must fit per SM
// (register cap); the host passes it (-DMOE_MINB=n).
#ifndef MOE_MINB
#define MOE_MINB 3
#endif
// The standalone gate/up kernels take half the rows per warp of the fused
// kernel (4 loads per lane: twice the blocks, each SM holding up to
// MOE_GU_MINB of them).
#ifndef MOE_GU_MINB
#define MOE_GU_MINB 4
#endif
extern "C" __global__ void __launch_bounds__(256, MOE_GU_MINB) moe_gate_up_a4v_c1(GU_ARGS) {
    PDL_EXPERTS_START();
    gate_up_a4v_kernel<1, A4V_SPLIT ? 2 : 4>(GU_CALL);
}
extern "C" __global__ void __launch_bounds__(256, MOE_GU_MINB) moe_gate_up_a4v_c2(GU_ARGS) {
    PDL_EXPERTS_START();
    gate_up_a4v_kernel<2, A4V_SPLIT ? 1 : 2>(GU_CALL);
}
extern "C" __global__ void moe_gate_up_a4v_c4(GU_ARGS) { PDL_EXPERTS_START(); gate_up_a4v_kernel<4, 1>(GU_CALL); }

// A pass's (token, rank) pairs grouped by expert (prefill): ids `[P]` ->
// off `[E + 1]` (pairs of expert e at list[off[e] .. off[e + 1]]) and list
// `[P]`. One block of 1024 threads, E <= 1024. The order inside a group is
// whatever the atomics give: every pair's gate/up output is computed on its
// own, so the order changes no bits. Ids outside 0..E are left out (the
// host rejects them when it counts the pass's routes).
extern "C" __global__ void group_pairs(const int* __restrict__ ids, int P, int E, int* __restrict__ off,
                                       int* __restrict__ list) {
    PDL_START();
    __shared__ int cnt[1024];
    __shared__ int at[1024];
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int id = ids[p];
        if (id >= 0 && id < E) atomicAdd(&cnt[id], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int e = 0; e < E; e++) {
            off[e] = s;
            at[e] = s;
            s += cnt[e];
        }
        off[E] = s;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int id = ids[p];
        if (id >= 0 && id < E) list[atomicAdd(&at[id], 1)] = p;
    }
}

// Routed experts' gate and up over pairs grouped by expert (prefill): block
// (bx, e) loads rows bx of expert e's gate and up once (the expert's record
// at addr[e], parts at off0 / off1) and runs them over every pair of its
// group, h[p, rows] = silu(gate . x[xrow[p]]) * (up . x[xrow[p]]), each pair
// with the operations of moe_gate_up_a4v (same bits), A4V_TILE_TOKENS
// pairs at a time. Grid (as moe_gate_up_a4v's x, E), 256 threads, dynamic
// shared memory as a4v_tiles takes.
template <int C, int R>
__device__ __forceinline__ void gate_up_grouped(W gt, W ut, const u64* __restrict__ addr, u64 off0, u64 off1,
                                                const int* __restrict__ goff, const int* __restrict__ list,
                                                const int* __restrict__ xrow, const float* __restrict__ x,
                                                float* __restrict__ h) {
    float* xs = (float*)a4v_dyn;
    const int e = blockIdx.y;
    const int i0 = goff[e], i1 = goff[e + 1];
    if (i0 >= i1) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int S = gt.cols >> 5;
    const int L = S < 32 ? S : 32;
    const int RW = 32 / L;
    const int sub = lane / L, li = lane % L;
    const int base = (blockIdx.x * (blockDim.x >> 5) + warp) * RW * R;
    W w[2];
    w[0] = at_base_a4(gt, (const u8*)(addr[e] + off0));
    w[1] = at_base_a4(ut, (const u8*)(addr[e] + off1));
    uint4 q[2 * R * C];
    u16 sr[2 * R * C], br[2 * R * C];
    tile_a4v_load<C, R, 2>(w, base, sub, li, L, RW, q, sr, br);
    constexpr int T = A4V_TILE_TOKENS;
    // A tile past the group's last pair stages that pair again (computed,
    // not written).
    auto rows = [&](int k, int u) { return x + (size_t)xrow[list[min(i0 + k * T + u, i1 - 1)]] * gt.cols; };
    a4v_tiles<T>(xs, gt.cols, (i1 - i0 + T - 1) / T, rows, [&](const float* cur, int k) {
        launder_codes<2 * R * C>(q, sr, br);
        const int i = i0 + k * T;
        float o[2][R][T];
        tile_a4v_dot_tokens<C, R, 2, T>(w, cur, li, L, q, sr, br, o);
        if (li == 0) {
#pragma unroll
            for (int u = 0; u < T; u++) {
                if (i + u >= i1) break;
                const int p = list[i + u];
#pragma unroll
                for (int rr = 0; rr < R; rr++) {
                    const int r = base + rr * RW + sub;
                    if (r < gt.rows) h[(size_t)p * gt.rows + r] = siluf_(o[0][rr][u]) * o[1][rr][u];
                }
            }
        }
    });
}
#define GG_ARGS                                                                                              \
    W gt, W ut, const u64 *__restrict__ addr, u64 off0, u64 off1, const int *__restrict__ goff,             \
        const int *__restrict__ list, const int *__restrict__ xrow, const float *__restrict__ x,            \
        float *__restrict__ h
#define GG_CALL gt, ut, addr, off0, off1, goff, list, xrow, x, h
extern "C" __global__ void __launch_bounds__(256, MOE_MINB) moe_gate_up_grouped_c1(GG_ARGS) {
    PDL_EXPERTS_START();
    gate_up_grouped<1, A4V_SPLIT ? 2 : 4>(GG_CALL);
}
extern "C" __global__ void __launch_bounds__(256, MOE_MINB) moe_gate_up_grouped_c2(GG_ARGS) {
    PDL_EXPERTS_START();
    gate_up_grouped<2, A4V_SPLIT ? 1 : 2>(GG_CALL);
}
extern "C" __global__ void moe_gate_up_grouped_c4(GG_ARGS) {
    PDL_EXPERTS_START();
    gate_up_grouped<4, 1>(GG_CALL);
}

#define DOWN_KB 8
// Routed experts' down projections, wide form (same result as moe_down;
// requires cols = I <= 1024, so one chunk per lane): each lane owns one
// chunk of one output row and loads it for DOWN_KB experts at once; the
// experts' h rows are staged DOWN_KB at a time. The weighted sum runs in
// rank order in each lane, then over the row's lanes. Grid
// (ceil(H / (8 * RW)), tokens), 256 threads, dynamic shared memory
// DOWN_KB * 37 * I / 32 floats.
// The geometry of one down block (block column bx): this lane's row, chunk,
// expert half and offsets inside an expert's down part. The warps of a
// block come in pairs that share rows: the even warp takes experts 0-3 of
// each batch of DOWN_KB, the odd warp experts 4-7 (more warps per row, less
// serial work per warp); their sums are added in that order.
// A4V_SPLIT (set by the host, default 1): down blocks split each batch
// over a warp pair and the standalone gate/up kernels take half the rows
// per warp; 0 restores one warp per row set (the previous layout).
#ifndef A4V_SPLIT
#define A4V_SPLIT 1
#endif
#define DOWN_WPR (A4V_SPLIT ? 2 : 1)
#define DOWN_KH (DOWN_KB / DOWN_WPR)
struct DnGeom {
    int S, L, ro, li, sub, half;
    size_t gi, roff, cb, sb;
};
__device__ __forceinline__ DnGeom dn_geom(const W& dt, int bx) {
    DnGeom g;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cols = dt.cols;
    g.S = cols >> 5;
    g.L = g.S < 32 ? g.S : 32;
    const int RW = 32 / g.L;
    g.sub = lane / g.L;
    g.li = lane % g.L;
    g.half = A4V_SPLIT ? (warp & 1) : 0;
    g.ro = (bx * ((blockDim.x >> 5) / DOWN_WPR) + warp / DOWN_WPR) * RW + g.sub;
    const int r = min(g.ro, dt.rows - 1);
    const int gsh = __ffs(dt.group) - 1;  // group = 2^gsh
    const int ng = cols >> gsh;
    g.gi = (size_t)r * ng + ((g.li * 32) >> gsh);
    g.roff = (size_t)r * cols / 2;
    g.cb = (size_t)dt.rows * cols / 2;
    g.sb = (size_t)dt.rows * ng * 2;
    return g;
}

// Issues the loads of this lane's DOWN_KH experts of batch k0 of token t.
__device__ __forceinline__ void down_a4v_load(const DnGeom& g, const u64* __restrict__ dbase, int K, int t, int k0,
                                              uint4* q, u16* sr, u16* br) {
#pragma unroll
    for (int kk = 0; kk < DOWN_KH; kk++) {
        const int k = k0 + g.half * DOWN_KH + kk;
        if (k < K) {
            const u8* b = (const u8*)dbase[(size_t)t * K + k];
            q[kk] = __ldg((const uint4*)(b + g.roff) + g.li);
            sr[kk] = __ldg((const u16*)(b + g.cb) + g.gi);
            br[kk] = __ldg((const u16*)(b + g.cb + g.sb) + g.gi);
        }
    }
}

// Stages the h rows of experts [k0, k0 + nb) of token t (read through L2)
// into xs with their chunk sums after them (at xs + 36 * DOWN_KB * S).
// All threads of the block call it; it starts and ends synchronised.
__device__ __forceinline__ void down_a4v_stage(const float* h, int t, int K, int k0, int nb, int cols, float* xs) {
    const float* src = h + ((size_t)t * K + k0) * cols;
    for (int i = threadIdx.x * 4; i < nb * cols; i += blockDim.x * 4) {
        float4 v = __ldcg((const float4*)(src + i));
        *(float4*)(xs + XPAD(i)) = v;
    }
    __syncthreads();
    const int S = cols >> 5;
    chunk_sums(xs, nb * S, xs + 36 * DOWN_KB * S);
    __syncthreads();
}

// This lane's weighted sum over the staged batch k0 of token t (loads in
// q, sr, br), added into acc in rank order.
__device__ __forceinline__ void down_a4v_dot(const DnGeom& g, const float* xs, const float* __restrict__ wts, int K,
                                             int t, int k0, int bf, const uint4* q, const u16* sr, const u16* br,
                                             float& acc) {
    const float* sums = xs + 36 * DOWN_KB * g.S;
#pragma unroll
    for (int kk = 0; kk < DOWN_KH; kk++) {
        const int kb = g.half * DOWN_KH + kk;  // expert within the batch
        if (k0 + kb < K) {
            float xv[32];
            // Row kb of the batch starts at chunk kb * S of the padded copy.
            load_chunk_x(xs, kb * g.S + g.li, xv);
            const float xsum = sums[kb * g.S + g.li];
            const float part = chunk_dot(q[kk], xv, xsum, half_val(sr[kk], bf), half_val(br[kk], bf));
            acc += wts[(size_t)t * K + k0 + kb] * part;
        }
    }
}

// The row's sum over its lanes (and the warp pair's halves, through
// pair_sum), plus the gated shared expert, added into the residual x.
// Every thread of the block calls it (barrier when A4V_SPLIT).
__device__ __forceinline__ void down_a4v_finish(const DnGeom& g, float acc, float (*pair_sum)[32], int rows,
                                                const float* __restrict__ shared, const float* __restrict__ sg,
                                                float* __restrict__ x, int t) {
    acc = seg_sum(acc, g.L);
    if (A4V_SPLIT) {
        const int warp = threadIdx.x >> 5;
        if (g.half == 1 && g.li == 0) pair_sum[warp >> 1][g.sub] = acc;
        __syncthreads();
        if (g.half == 0) acc = acc + pair_sum[warp >> 1][g.sub];
    }
    if (g.half == 0 && g.li == 0 && g.ro < rows) {
        float s = 0.0f;
        if (shared) s = sigmoidf_(sg[t]) * shared[(size_t)t * rows + g.ro];
        x[(size_t)t * rows + g.ro] += acc + s;
    }
}

// One block of moe_down_a4v: output rows of block column `bx`, token `t`.
// With `loaded` the first batch's loads were issued already
// (down_a4v_load). With `ready` set, thread 0 waits, after the first loads,
// until `*ready` reaches `ready_n` (the fused kernel: h is written by other
// blocks of the same launch); h is read through L2.
__device__ __forceinline__ void down_a4v_unit(W dt, const u64* __restrict__ dbase, const float* h,
                                              const float* __restrict__ wts, int K, const float* __restrict__ shared,
                                              const float* __restrict__ sg, float* __restrict__ x, int bx, int t,
                                              const u32* ready, u32 ready_n, bool loaded, uint4* q, u16* sr,
                                              u16* br) {
    float* xs = (float*)a4v_dyn;
    __shared__ float pair_sum[16][32];
    const DnGeom g = dn_geom(dt, bx);
    const int bf = dt.scale_bf16;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += DOWN_KB) {
        if (k0 > 0 || !loaded) down_a4v_load(g, dbase, K, t, k0, q, sr, br);
        if (k0 == 0) PDL_WAIT();
        const int nb = min(DOWN_KB, K - k0);
        if (k0 == 0 && ready) {
            if (threadIdx.x == 0) {
                while (*(volatile const u32*)ready < ready_n) __nanosleep(128);
                __threadfence();
            }
        }
        if (k0 > 0 || ready) __syncthreads();
        down_a4v_stage(h, t, K, k0, nb, dt.cols, xs);
        down_a4v_dot(g, xs, wts, K, t, k0, bf, q, sr, br, acc);
    }
    down_a4v_finish(g, acc, pair_sum, dt.rows, shared, sg, x, t);
}

// Routed experts' down projections for a prefill pass (K <= DOWN_KB): as
// moe_down_a4v, but block (t, by) stages token t's h once and runs
// DOWN_GROUPS of moe_down_a4v's row blocks (by * DOWN_GROUPS + i) over it,
// the next group's weights loading while one is computed; each row gets
// moe_down_a4v's operations (same bits). Grid (tokens, ceil(row blocks /
// DOWN_GROUPS)), 256 threads, the same shared memory.
#define DOWN_GROUPS 8
extern "C" __global__ void __launch_bounds__(256, MOE_MINB)
    moe_down_a4v_t(W dt, const u64* __restrict__ dbase, const float* __restrict__ h, const float* __restrict__ wts,
                   int K, const float* __restrict__ shared, const float* __restrict__ sg, float* __restrict__ x,
                   int nblocks) {
    PDL_TRIGGER();
    float* xs = (float*)a4v_dyn;
    __shared__ float pair_sum[16][32];
    const int t = blockIdx.x;
    const int bf = dt.scale_bf16;
    const int b0 = blockIdx.y * DOWN_GROUPS;
    const int groups = min(DOWN_GROUPS, nblocks - b0);
    // Two register sets (named, so they stay registers): group i computes
    // from one while group i + 1's loads fill the other.
    uint4 qa[DOWN_KH], qb[DOWN_KH];
    u16 sa[DOWN_KH], ba[DOWN_KH], sb[DOWN_KH], bb[DOWN_KH];
    down_a4v_load(dn_geom(dt, b0), dbase, K, t, 0, qa, sa, ba);
    PDL_WAIT();
    down_a4v_stage(h, t, K, 0, K, dt.cols, xs);
    auto group = [&](int i, const uint4* q, const u16* sr, const u16* br, uint4* qn, u16* srn, u16* brn) {
        if (i + 1 < groups) down_a4v_load(dn_geom(dt, b0 + i + 1), dbase, K, t, 0, qn, srn, brn);
        const DnGeom g = dn_geom(dt, b0 + i);
        float acc = 0.0f;
        down_a4v_dot(g, xs, wts, K, t, 0, bf, q, sr, br, acc);
        down_a4v_finish(g, acc, pair_sum, dt.rows, shared, sg, x, t);
        // pair_sum is written again by the next group.
        __syncthreads();
    };
#pragma unroll 1
    for (int i = 0; i < groups; i += 2) {
        group(i, qa, sa, ba, qb, sb, bb);
        if (i + 1 < groups) group(i + 1, qb, sb, bb, qa, sa, ba);
    }
}

extern "C" __global__ void __launch_bounds__(256, MOE_MINB) moe_down_a4v(W dt, const u64* __restrict__ dbase, const float* __restrict__ h,
                                        const float* __restrict__ wts, int K, const float* __restrict__ shared,
                                        const float* __restrict__ sg, float* __restrict__ x) {
    PDL_TRIGGER();
    uint4 q[DOWN_KH];
    u16 sr[DOWN_KH], br[DOWN_KH];
    // Grid (tokens, row blocks): a pass's tokens for the same rows run
    // together, so experts that several of them route to are read from
    // HBM once (L2 for the rest).
    down_a4v_unit(dt, dbase, h, wts, K, shared, sg, x, blockIdx.y, blockIdx.x, nullptr, 0, false, q, sr, br);
}

// All routed experts of a decode step in one launch (same numbers as
// moe_gate_up_a4v_cC followed by moe_down_a4v). Grid: ga * pairs gate/up
// blocks plus gb * tokens down blocks, 256 threads, dynamic shared memory
// for the larger of the two. A block's role comes from a ticket taken when
// it starts (sync[0]), gate/up roles first, so a down block, which waits
// for every gate/up block (sync[1]) after issuing its weight loads, only
// ever waits on blocks that are already running: no deadlock whatever the
// occupancy or the order blocks start in. Each block first issues the loads
// of the role its block index would have (blocks usually start in index
// order, so the ticket usually agrees) and only reloads when the ticket
// says otherwise: the ticket's round trip overlaps the weight loads. The
// last down block resets the counters for the next launch.
template <int C, int R>
__device__ __forceinline__ void fused_a4v_body(W gt, W ut, W dt, const u64* __restrict__ gbase,
                                               const u64* __restrict__ ubase, const u64* __restrict__ dbase,
                                               const int* __restrict__ xrow, const float* __restrict__ x, float* h,
                                               const float* __restrict__ wts, int K, const float* __restrict__ shared,
                                               const float* __restrict__ sg, float* __restrict__ xout, int ga,
                                               int pairs, int gb, int tokens, u32* sync) {
    static_assert(2 * R * C >= DOWN_KH, "one register set serves both roles");
    __shared__ u32 ticket;
    const u32 na = (u32)(ga * pairs), nb = (u32)(gb * tokens);
    const u32 guess = blockIdx.x;
    uint4 q[2 * R * C];
    u16 sr[2 * R * C], br[2 * R * C];
    if (guess < na) {
        gate_up_a4v_load<C, R>(gt, ut, gbase, ubase, guess % ga, guess / ga, q, sr, br);
    } else {
        const u32 u = guess - na;
        down_a4v_load(dn_geom(dt, u % gb), dbase, K, u / gb, 0, q, sr, br);
    }
    PDL_WAIT();
    if (threadIdx.x == 0) ticket = atomicAdd(&sync[0], 1u);
    __syncthreads();
    const u32 tk = ticket;
    if (tk < na) {
        gate_up_a4v_unit<C, R>(gt, ut, gbase, ubase, xrow, x, h, tk % ga, tk / ga, tk == guess, q, sr, br);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(&sync[1], 1u);
    } else {
        const u32 u = tk - na;
        down_a4v_unit(dt, dbase, h, wts, K, shared, sg, xout, u % gb, u / gb, &sync[1], na, tk == guess, q, sr,
                      br);
        __syncthreads();
        if (threadIdx.x == 0 && atomicAdd(&sync[2], 1u) == nb - 1) {
            // Every block has taken its ticket and every gate/up block has
            // counted itself: nobody reads the counters any more.
            sync[0] = 0;
            sync[1] = 0;
            sync[2] = 0;
            __threadfence();
        }
    }
}
#define FU_ARGS                                                                                              \
    W gt, W ut, W dt, const u64 *__restrict__ gbase, const u64 *__restrict__ ubase,                          \
        const u64 *__restrict__ dbase, const int *__restrict__ xrow, const float *__restrict__ x, float *h,   \
        const float *__restrict__ wts, int K, const float *__restrict__ shared, const float *__restrict__ sg, \
        float *__restrict__ xout, int ga, int pairs, int gb, int tokens, u32 *sync
#define FU_CALL gt, ut, dt, gbase, ubase, dbase, xrow, x, h, wts, K, shared, sg, xout, ga, pairs, gb, tokens, sync
extern "C" __global__ void __launch_bounds__(256, MOE_MINB) moe_fused_a4v_c1(FU_ARGS) { PDL_EXPERTS_START(); fused_a4v_body<1, 4>(FU_CALL); }
extern "C" __global__ void __launch_bounds__(256, MOE_MINB) moe_fused_a4v_c2(FU_ARGS) { PDL_EXPERTS_START(); fused_a4v_body<2, 2>(FU_CALL); }
extern "C" __global__ void __launch_bounds__(256, MOE_MINB) moe_fused_a4v_c4(FU_ARGS) { PDL_EXPERTS_START(); fused_a4v_body<4, 1>(FU_CALL); }

// ---- Routed experts on tensor cores (affine 4-bit, group 64) ----
// One mma.m16n8k16 (bf16 in, f32 accumulate) takes 16 weight rows x 16
// columns. The codes enter as bf16 128 + c (exact: OR into 0x4300, one LOP3
// per two codes; the 128 is folded into the group's bias term, as the a4v
// kernels fold their 0.5), and x as three bf16 parts p0 + p1 + p2 (the f32
// value to its last bit for normal numbers) in the B operand's columns
// 0-2, so one mma yields the three partial dot products, summed in f32
// after the scale. Per group of 64 columns the four lanes of a row each
// take 16 contiguous columns (8 code bytes, one 8-byte load): in step s
// (0..3) a lane's k pairs are its nibbles (s, s+4) of the first and of the
// second 4 bytes, and the staged x parts are laid out to match. About one
// instruction per code against ~6 for the a4v kernels' PRMT + FFMA form.

// The bf16 conversion and the mma need sm_80; below it these kernels
// compile to a trap and the host never launches them (`Gpu::tc_capable`),
// so the module still loads on older GPUs.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define TC_ARCH 1
#else
#define TC_ARCH 0
#endif

// bf16 (round to nearest even) of f, as the low 16 bits.
__device__ __forceinline__ u32 bf16_rn(float f) {
#if TC_ARCH
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#else
    __trap();
    return 0;
#endif
}
__device__ __forceinline__ float bf16_f(u32 b) { return __uint_as_float(b << 16); }

// Nibbles s and s + 4 of w as bf16 128 + c in the low and high halves.
__device__ __forceinline__ u32 tc_nib2(u32 w, int s) { return ((w >> (4 * s)) & 0x000F000Fu) | 0x43004300u; }

// d += A (16 x 16, rows lane/4 and lane/4 + 8) x B (16 x 8).
__device__ __forceinline__ void tc_mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if TC_ARCH
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// tf32 (round to nearest, ties away) of f, as a b32 whose low 13 bits are 0.
__device__ __forceinline__ u32 tf32_rna(float f) {
#if TC_ARCH
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
#else
    __trap();
    return 0;
#endif
}

// f = hi + lo with both parts tf32 (lo holds the 11 bits after hi's).
__device__ __forceinline__ void tf32_split(float f, u32& hi, u32& lo) {
    hi = tf32_rna(f);
    lo = tf32_rna(f - __uint_as_float(hi));
}

// d += A (16 x 8, rows lane/4 and lane/4 + 8) x B (8 x 8) in f32 to about
// 2^-21 relative (3xTF32: hi*hi + hi*lo + lo*hi, the small products
// first; lo*lo is below f32's last bit).
__device__ __forceinline__ void tf32x3_mma(float* d, const u32* ah, const u32* al, const u32* bh, const u32* bl) {
#if TC_ARCH
#define TF32_MMA(A, B)                                                                                      \
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "      \
                 "{%8,%9}, {%0,%1,%2,%3};"                                                                  \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                           \
                 : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B[0]), "r"(B[1]))
    TF32_MMA(al, bh);
    TF32_MMA(ah, bl);
    TF32_MMA(ah, bh);
#undef TF32_MMA
#else
    __trap();
#endif
}

// Stages groups [g0, g0 + gn) of one x row for one warp of a tensor-core
// kernel: xp[((i * 4 + s) * 4 + c) * 3 + n] (two u32 each) holds part n of
// x at group g0 + i's columns (16c + s, 16c + s + 4) and (16c + 8 + s,
// 16c + 12 + s) as bf16 pairs; gs[i] = the group's sum of x in f32 (a
// fixed shuffle tree). Each warp stages what its own tile reads, so no
// block barrier: every lane of the warp calls it (it ends with
// __syncwarp).
__device__ __forceinline__ void tc_stage_warp(const float* __restrict__ x, int g0, int gn, uint2* xp, float* gs,
                                              int lane) {
    for (int i = lane; i < gn * 16; i += 32) {
        const int g = g0 + (i >> 4), st = (i >> 2) & 3, c = i & 3;
        const float* xg = x + g * 64 + 16 * c + st;
        u32 part[3][4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float v = xg[4 * j];
            const u32 p0 = bf16_rn(v);
            const float r1 = v - bf16_f(p0);
            const u32 p1 = bf16_rn(r1);
            part[0][j] = p0;
            part[1][j] = p1;
            part[2][j] = bf16_rn(r1 - bf16_f(p1));
        }
#pragma unroll
        for (int n = 0; n < 3; n++)
            xp[i * 3 + n] = make_uint2(part[n][0] | (part[n][1] << 16), part[n][2] | (part[n][3] << 16));
    }
#pragma unroll 4
    for (int i = 0; i < gn; i++) {
        const float a = warp_sum(x[(g0 + i) * 64 + lane] + x[(g0 + i) * 64 + 32 + lane]);
        if (lane == 0) gs[i] = a;
    }
    __syncwarp();
}

// The B fragment of step st of staged group g for this lane: part lane / 4
// (zero for lanes 12-31: columns 3-7 of B are unused).
__device__ __forceinline__ uint2 tc_b(const uint2* xp, int g, int st, int lane) {
    const int n = lane >> 2, c = lane & 3;
    return n < 3 ? xp[((g * 4 + st) * 4 + c) * 3 + n] : make_uint2(0u, 0u);
}

// The weights of a tensor-core tile's two rows ra of wa and rb of wb as
// this lane (column c = lane % 4 of each group's 8-byte code blocks) reads
// them: codes, scales, biases.
struct TcRows {
    const uint2* ca;
    const uint2* cb;
    const u16* sa;
    const u16* ba;
    const u16* sb;
    const u16* bb;
};
__device__ __forceinline__ TcRows tc_rows(const W& wa, int ra, const W& wb, int rb, int c) {
    const int cols = wa.cols, ng = cols >> 6;
    TcRows r;
    r.ca = (const uint2*)(wa.codes + (size_t)ra * cols / 2) + c;
    r.cb = (const uint2*)(wb.codes + (size_t)rb * cols / 2) + c;
    r.sa = wa.scales + (size_t)ra * ng;
    r.ba = wa.biases + (size_t)ra * ng;
    r.sb = wb.scales + (size_t)rb * ng;
    r.bb = wb.biases + (size_t)rb * ng;
    return r;
}

// Loads G groups of both rows, g0 + k0 + j for j < G (clamped to the last
// of the gn groups, so every load is in bounds), all in flight at once.
template <int G>
__device__ __forceinline__ void tc_load(const TcRows& r, int g0, int k0, int gn, uint2* qa, uint2* qb, u16* ssa,
                                        u16* sba, u16* ssb, u16* sbb) {
#pragma unroll
    for (int j = 0; j < G; j++) {
        const int g = g0 + min(k0 + j, gn - 1);
        qa[j] = __ldg(r.ca + g * 4);
        qb[j] = __ldg(r.cb + g * 4);
        ssa[j] = __ldg(r.sa + g);
        sba[j] = __ldg(r.ba + g);
        ssb[j] = __ldg(r.sb + g);
        sbb[j] = __ldg(r.bb + g);
    }
}

#define TC_GCHUNK 8
// One warp's 16-row tile over groups [g0, g0 + gn) of x, staged by this
// warp (tc_stage_warp: xp, gs hold exactly these groups): mma rows 0-7 are
// row `ra` of `wa` (this lane's row lane / 4), rows 8-15 row `rb` of `wb`.
// Adds into acc the scaled partial sums of x part columns 2c and 2c + 1
// (c = lane % 4) for row a (acc[0], acc[1]) and row b (acc[2], acc[3]),
// the group's bias term in column 0 (lanes c = 0). Loads go out a chunk of
// TC_GCHUNK groups at a time; `stage` (the warp's staging, and any wait
// for the kernel that wrote x) runs once, after the first chunk's weight
// loads are issued, so they are in flight while x is staged.
template <typename Stage>
__device__ __forceinline__ void tc_tile(const W& wa, int ra, const W& wb, int rb, int g0, int gn,
                                        const uint2* xp, const float* gs, int lane, float* acc, Stage stage) {
    const int c = lane & 3;
    const TcRows r = tc_rows(wa, ra, wb, rb, c);
    const int bf = wa.scale_bf16;
    bool staged = false;
    for (int k0 = 0; k0 < gn; k0 += TC_GCHUNK) {
        uint2 qa[TC_GCHUNK], qb[TC_GCHUNK];
        u16 ssa[TC_GCHUNK], sba[TC_GCHUNK], ssb[TC_GCHUNK], sbb[TC_GCHUNK];
        tc_load<TC_GCHUNK>(r, g0, k0, gn, qa, qb, ssa, sba, ssb, sbb);
        if (!staged) {
            stage();
            staged = true;
        }
#pragma unroll
        for (int j = 0; j < TC_GCHUNK; j++) {
            if (k0 + j >= gn) break;
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int st = 0; st < 4; st++) {
                const uint2 b = tc_b(xp, k0 + j, st, lane);
                tc_mma(d, tc_nib2(qa[j].x, st), tc_nib2(qb[j].x, st), tc_nib2(qa[j].y, st), tc_nib2(qb[j].y, st),
                       b.x, b.y);
            }
            const float fa = half_val(ssa[j], bf), fb = half_val(ssb[j], bf);
            acc[0] = fmaf(fa, d[0], acc[0]);
            acc[1] = fmaf(fa, d[1], acc[1]);
            acc[2] = fmaf(fb, d[2], acc[2]);
            acc[3] = fmaf(fb, d[3], acc[3]);
            if (c == 0) {
                acc[0] = fmaf(fmaf(-128.0f, fa, half_val(sba[j], bf)), gs[k0 + j], acc[0]);
                acc[2] = fmaf(fmaf(-128.0f, fb, half_val(sbb[j], bf)), gs[k0 + j], acc[2]);
            }
        }
    }
    if (!staged) stage();
}

// The dot products of a tile's rows a and b (lanes c = 0) from tc_tile's
// accumulators: x part columns (0 + 1) + 2. Every lane of the warp calls it.
__device__ __forceinline__ void tc_rows_out(const float* acc, float* va, float* vb) {
    const float a2 = __shfl_down_sync(0xffffffffu, acc[0], 1);
    const float b2 = __shfl_down_sync(0xffffffffu, acc[2], 1);
    *va = (acc[0] + acc[1]) + a2;
    *vb = (acc[2] + acc[3]) + b2;
}

// The column quarters of a block's two tiles (warp = tile * 4 + quarter)
// summed in order through shared memory `red` ([2][4][32][4] floats), then
// tc_rows_out: true in the quarter-0 warps, whose lanes c = 0 then hold
// their rows' dot products in *va, *vb. Every thread of the block calls it.
__device__ __forceinline__ bool tc_quarters(float* red, int tile, int quarter, int lane, const float* acc,
                                            float* va, float* vb) {
    float* my = red + ((tile * 4 + quarter) * 32 + lane) * 4;
#pragma unroll
    for (int e = 0; e < 4; e++) my[e] = acc[e];
    __syncthreads();
    if (quarter != 0) return false;
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float a = 0.0f;
        for (int q = 0; q < 4; q++) a += red[((tile * 4 + q) * 32 + lane) * 4 + e];
        v[e] = a;
    }
    tc_rows_out(v, va, vb);
    return true;
}

// Routed experts' gate and up on tensor cores (same role as
// moe_gate_up_a4v): grid (ceil(I / 16), pairs), 256 threads. Warp w takes
// 8 intermediate rows (w / 4: the block's first or second 8) over a
// quarter of the columns (w % 4); its tile's rows 0-7 are the gate rows,
// 8-15 the up rows, so a lane ends with both of its row. Each warp stages
// its quarter of x; the quarters are summed in order through shared
// memory. Requires cols % 256 == 0. Dynamic shared memory: 8 warps x
// cols / 256 groups x 388 + 4096 bytes.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_tc(W gt, W ut, const u64* __restrict__ gbase,
                                                                 const u64* __restrict__ ubase,
                                                                 const int* __restrict__ xrow,
                                                                 const float* __restrict__ x, float* __restrict__ h) {
    PDL_EXPERTS_START();
    const int p = blockIdx.y;
    const int cols = gt.cols, ng = cols >> 6, I = gt.rows;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tile = warp >> 2, quarter = warp & 3;
    const int gpq = ng >> 2;
    uint2* xp = (uint2*)a4v_dyn + warp * gpq * 48;
    float* gs = (float*)((uint2*)a4v_dyn + 8 * gpq * 48) + warp * gpq;
    float* red = (float*)((uint2*)a4v_dyn + 8 * gpq * 48) + 8 * gpq;  // [2 tiles][4 quarters][32 lanes][4]
    const W g = at_base_a4(gt, (const u8*)gbase[p]);
    const W u = at_base_a4(ut, (const u8*)ubase[p]);
    const int row_raw = blockIdx.x * 16 + tile * 8 + (lane >> 2);
    const int row = min(row_raw, I - 1);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    tc_tile(g, row, u, row, quarter * gpq, gpq, xp, gs, lane, acc,
            [&]() { tc_stage_warp(x + (size_t)xrow[p] * cols, quarter * gpq, gpq, xp, gs, lane); });
    float gv, uv;
    if (tc_quarters(red, tile, quarter, lane, acc, &gv, &uv) && (lane & 3) == 0 && row_raw < I)
        h[(size_t)p * I + row_raw] = siluf_(gv) * uv;
}

// Token t's routed down outputs (vals[kk * stride], rank kk < K) summed
// in rank order with their weights, the gated shared expert added, into
// the residual row x[t, row]: the one sum both tensor-core down forms end
// with (moe_down_tc, moe_down_combine), so they give the same bits.
__device__ __forceinline__ void tc_down_sum(const float* vals, int stride, const float* __restrict__ wts, int K,
                                            const float* __restrict__ shared, const float* __restrict__ sgate,
                                            float* __restrict__ x, int t, int H, int row) {
    float a = 0.0f;
    for (int kk = 0; kk < K; kk++) a += wts[(size_t)t * K + kk] * vals[kk * stride];
    float sh = 0.0f;
    if (shared) sh = sigmoidf_(sgate[t]) * shared[(size_t)t * H + row];
    x[(size_t)t * H + row] += a + sh;
}

// Routed experts' down projections on tensor cores (same role as
// moe_down_a4v): grid (ceil(H / 16), tokens), 256 threads; warp k takes
// expert rank k (K <= 8; warps past K run rank 0's rows and drop them) for
// the block's 16 output rows over all columns (cols = I, a multiple of
// 64); the ranks are then summed in order with their weights, the gated
// shared expert added, into the residual x. Each warp stages its rank's h
// after issuing its weight loads, and only then waits for the kernel that
// wrote h (programmatic dependent launch), so the loads overlap it.
// Dynamic shared memory: 8 * I / 64 * 388 + 512 bytes.
extern "C" __global__ void __launch_bounds__(256) moe_down_tc(W dt, const u64* __restrict__ dbase,
                                                              const float* __restrict__ h,
                                                              const float* __restrict__ wts, int K,
                                                              const float* __restrict__ shared,
                                                              const float* __restrict__ sgate, float* __restrict__ x) {
    // The bases were written by the router, which the preceding gate/up
    // kernel waited for before it let this one launch.
    PDL_TRIGGER();
    const int t = blockIdx.y;
    const int cols = dt.cols, ng = cols >> 6, H = dt.rows;
    const int k = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint2* xp = (uint2*)a4v_dyn + k * ng * 48;
    float* gs = (float*)((uint2*)a4v_dyn + 8 * ng * 48) + k * ng;
    float* red = (float*)((uint2*)a4v_dyn + 8 * ng * 48) + 8 * ng;  // [8 ranks][16 rows]
    const int kr = k < K ? k : 0;
    const int r0 = min(blockIdx.x * 16 + (lane >> 2), H - 1), r1 = min(blockIdx.x * 16 + (lane >> 2) + 8, H - 1);
    const W d = at_base_a4(dt, (const u8*)dbase[(size_t)t * K + kr]);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    tc_tile(d, r0, d, r1, 0, ng, xp, gs, lane, acc, [&]() {
        PDL_WAIT();
        tc_stage_warp(h + ((size_t)t * K + kr) * cols, 0, ng, xp, gs, lane);
    });
    float v0, v1;
    tc_rows_out(acc, &v0, &v1);
    if (k < K && (lane & 3) == 0) {
        red[k * 16 + (lane >> 2)] = v0;
        red[k * 16 + (lane >> 2) + 8] = v1;
    }
    __syncthreads();
    const int row = blockIdx.x * 16 + threadIdx.x;
    if (threadIdx.x < 16 && row < H) tc_down_sum(red + threadIdx.x, 16, wts, K, shared, sgate, x, t, H, row);
}

// Dense affine 4-bit matvec on tensor cores (group 64, cols % 256 == 0),
// one token, up to 4 matrices of the same columns sharing x in one launch
// (blocks [0, b1) compute w0 into y0, [b1, b2) w1, [b2, b3) w2, the rest
// w3: as matvec_a4v_multi). 256 threads per block; warp w takes 16 rows
// (w / 4: rows r and r + 8 of the block's first or second 16) over a
// quarter of the columns (w % 4), the quarters summed in order. Each warp
// issues its weight loads, then waits for the kernel that wrote x and
// stages its quarter of x. Dynamic shared memory as moe_gate_up_tc.
extern "C" __global__ void __launch_bounds__(256) matvec_tc(MULTI_ARGS) {
    PDL_TRIGGER();
    const int b = blockIdx.x;
    const int m = b < b1 ? 0 : b < b2 ? 1 : b < b3 ? 2 : 3;
    const W& w = m == 0 ? w0 : m == 1 ? w1 : m == 2 ? w2 : w3;
    float* y = m == 0 ? y0 : m == 1 ? y1 : m == 2 ? y2 : y3;
    const int blk = b - (m == 0 ? 0 : m == 1 ? b1 : m == 2 ? b2 : b3);
    const int cols = w.cols, ng = cols >> 6, rows = w.rows;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tile = warp >> 2, quarter = warp & 3;
    const int gpq = ng >> 2;
    uint2* xp = (uint2*)a4v_dyn + warp * gpq * 48;
    float* gs = (float*)((uint2*)a4v_dyn + 8 * gpq * 48) + warp * gpq;
    float* red = (float*)((uint2*)a4v_dyn + 8 * gpq * 48) + 8 * gpq;
    const int ra_raw = blk * 32 + tile * 16 + (lane >> 2);
    const int ra = min(ra_raw, rows - 1), rb = min(ra_raw + 8, rows - 1);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    tc_tile(w, ra, w, rb, quarter * gpq, gpq, xp, gs, lane, acc, [&]() {
        PDL_WAIT();
        tc_stage_warp(x, quarter * gpq, gpq, xp, gs, lane);
    });
    float va, vb;
    if (tc_quarters(red, tile, quarter, lane, acc, &va, &vb) && (lane & 3) == 0) {
        if (ra_raw < rows) y[ra_raw] = va;
        if (ra_raw + 8 < rows) y[ra_raw + 8] = vb;
    }
}

// ---- Tensor-core prefill forms: the one-token tensor-core kernels' per-row
// operations, over many tokens at once. Their input rows are split once per
// pass (tc_split) into the staged form each one-token kernel's warps build
// in shared memory (tc_stage_warp, the same function, so the same bits),
// and the B fragments are read from there. Two tokens share an mma: token
// 2p's parts in B columns 0-2, token 2p + 1's in columns 3-5, each output
// column the dot product of its own B column (column 3 of token 2p + 1 is
// what column 0 would be for it alone); every other operation is the
// one-token kernel's, per column, in the same order. The kernel tests check
// each token's bits against its one-token launch.

// Rows x [n, cols] (cols % 64 == 0) in the staged form: xs [n][cols / 64][48]
// bf16-pair entries (tc_stage_warp's layout), gs [n][cols / 64] group sums.
// Grid (ceil(cols / 512), n), 256 threads: warp w stages group
// blockIdx.x * 8 + w of token blockIdx.y.
extern "C" __global__ void tc_split(const float* __restrict__ x, int cols, uint2* __restrict__ xs,
                                    float* __restrict__ gs) {
    PDL_START();
    const int t = blockIdx.y, ng = cols >> 6;
    const int g = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (g >= ng) return;
    tc_stage_warp(x + (size_t)t * cols, g, 1, xs + ((size_t)t * ng + g) * 48, gs + (size_t)t * ng + g, lane);
}

// Tokens a prefill tensor-core block computes at once, and tokens per mma
// (2: columns 0-2 and 3-5; 1: columns 0-2 only, the one-token kernels'
// layout, which the host picks with SLIPSTREAM_CUDA_TC_TPM=1).
#define TC_TOKENS 8
#ifndef TC_TPM
#define TC_TPM 2
#endif
#define TC_SETS (TC_TOKENS / TC_TPM)

// tc_tile over TC_TOKENS tokens tok[] of the split rows (xs, gsum:
// tc_split's output over rows of ng groups), TC_TPM per mma: acc[s] holds
// mma set s's accumulators, token s TC_TPM's columns 0-2 as tc_tile's
// (lanes c = 0, 1), with two per mma token s TC_TPM + 1's columns 3-5
// (lanes c = 1, 2). `wait` runs once, after the first groups' weight loads
// are issued and before xs is read. The weights of G groups are loaded
// at a time (registers against round trips; no effect on the sums).
template <int G, typename Wait>
__device__ __forceinline__ void tc_tile_t(const W& wa, int ra, const W& wb, int rb, int g0, int gn,
                                          const uint2* __restrict__ xs, const float* __restrict__ gsum, int ng,
                                          const int* tok, int lane, float (*acc)[4], Wait wait) {
    const int c = lane & 3, nb = lane >> 2;
    const TcRows r = tc_rows(wa, ra, wb, rb, c);
    const int bf = wa.scale_bf16;
    // This lane's B column: part nb % 3 of the set's token nb / 3 (lanes
    // past the set's tokens hold zero columns); its group sums: the token
    // whose column 0 or 3 it holds (lanes c < TC_TPM add a bias term).
    const bool live = nb < 3 * TC_TPM;
    const uint2* xb[TC_SETS];
    const float* gp[TC_SETS];
#pragma unroll
    for (int s = 0; s < TC_SETS; s++) {
        xb[s] = xs + (size_t)tok[s * TC_TPM + (TC_TPM == 2 && nb >= 3)] * ng * 48 + c * 3 + (nb % 3);
        gp[s] = gsum + (size_t)tok[s * TC_TPM + (TC_TPM == 2 ? (c & 1) : 0)] * ng;
    }
    bool waited = false;
    for (int k0 = 0; k0 < gn; k0 += G) {
        uint2 qa[G], qb[G];
        u16 ssa[G], sba[G], ssb[G], sbb[G];
        tc_load<G>(r, g0, k0, gn, qa, qb, ssa, sba, ssb, sbb);
        if (!waited) {
            wait();
            waited = true;
        }
#pragma unroll
        for (int j = 0; j < G; j++) {
            if (k0 + j >= gn) break;
            const int g = g0 + k0 + j;
            uint2 b[TC_SETS][4];
#pragma unroll
            for (int s = 0; s < TC_SETS; s++)
#pragma unroll
                for (int st = 0; st < 4; st++) b[s][st] = live ? xb[s][g * 48 + st * 12] : make_uint2(0u, 0u);
            float d[TC_SETS][4];
#pragma unroll
            for (int s = 0; s < TC_SETS; s++) d[s][0] = d[s][1] = d[s][2] = d[s][3] = 0.0f;
#pragma unroll
            for (int st = 0; st < 4; st++) {
                const u32 a0 = tc_nib2(qa[j].x, st), a1 = tc_nib2(qb[j].x, st);
                const u32 a2 = tc_nib2(qa[j].y, st), a3 = tc_nib2(qb[j].y, st);
#pragma unroll
                for (int s = 0; s < TC_SETS; s++) tc_mma(d[s], a0, a1, a2, a3, b[s][st].x, b[s][st].y);
            }
            const float fa = half_val(ssa[j], bf), fb = half_val(ssb[j], bf);
            const float ta = fmaf(-128.0f, fa, half_val(sba[j], bf));
            const float tb = fmaf(-128.0f, fb, half_val(sbb[j], bf));
#pragma unroll
            for (int s = 0; s < TC_SETS; s++) {
                acc[s][0] = fmaf(fa, d[s][0], acc[s][0]);
                acc[s][1] = fmaf(fa, d[s][1], acc[s][1]);
                acc[s][2] = fmaf(fb, d[s][2], acc[s][2]);
                acc[s][3] = fmaf(fb, d[s][3], acc[s][3]);
                const float gsv = c < TC_TPM ? gp[s][g] : 0.0f;
                if (c == 0) {
                    acc[s][0] = fmaf(ta, gsv, acc[s][0]);
                    acc[s][2] = fmaf(tb, gsv, acc[s][2]);
                } else if (TC_TPM == 2 && c == 1) {
                    acc[s][1] = fmaf(ta, gsv, acc[s][1]);
                    acc[s][3] = fmaf(tb, gsv, acc[s][3]);
                }
            }
        }
    }
    if (!waited) wait();
}

// tc_rows_out for an mma set's accumulators v: the first token's rows
// (col 0 + col 1) + col 2 in lanes c = 0, with two tokens per mma the
// second's (col 3 + col 4) + col 5 in lanes c = 1 (va row a, vb row b).
// Every lane of the warp calls it.
__device__ __forceinline__ void tc_rows_out_t(const float* v, float* va, float* vb, int lane) {
    const float s0 = __shfl_down_sync(0xffffffffu, v[0], 1);
    const float s1 = __shfl_down_sync(0xffffffffu, v[1], 1);
    const float s2 = __shfl_down_sync(0xffffffffu, v[2], 1);
    const float s3 = __shfl_down_sync(0xffffffffu, v[3], 1);
    const bool second = TC_TPM == 2 && (lane & 3) == 1;
    *va = second ? (v[1] + s0) + s1 : (v[0] + v[1]) + s0;
    *vb = second ? (v[3] + s2) + s3 : (v[2] + v[3]) + s2;
}

// The column quarters of a prefill block's two tiles summed in order for
// every mma set (tc_quarters' sums, red [TC_SETS][2][4][32][4] f32), then
// the rows' dot products, tc_rows_out's operations on each token's three
// columns: token s TC_TPM + (lane % 4)'s in lanes lane % 4 < TC_TPM (va[s]
// row a, vb[s] row b). True in the quarter-0 warps. Every thread of the
// block calls it; it leaves `red` free for the next call.
__device__ __forceinline__ bool tc_quarters_t(float* red, int tile, int quarter, int lane, float (*acc)[4],
                                              float* va, float* vb) {
#pragma unroll
    for (int s = 0; s < TC_SETS; s++) {
        float* my = red + (((s * 2 + tile) * 4 + quarter) * 32 + lane) * 4;
#pragma unroll
        for (int e = 0; e < 4; e++) my[e] = acc[s][e];
    }
    __syncthreads();
    const bool out = quarter == 0;
    if (out) {
#pragma unroll
        for (int s = 0; s < TC_SETS; s++) {
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float a = 0.0f;
                for (int q = 0; q < 4; q++) a += red[(((s * 2 + tile) * 4 + q) * 32 + lane) * 4 + e];
                v[e] = a;
            }
            tc_rows_out_t(v, &va[s], &vb[s], lane);
        }
    }
    __syncthreads();
    return out;
}

// matvec_tc over a pass: y[t, r] = W[r, :] . x[t, :] for n tokens split by
// tc_split (xs, gs), each token's row the bits of its one-token matvec_tc.
// Grid (ceil(n / TC_TOKENS), ceil(rows / 32)), 256 threads, TC_SETS * 4096
// bytes of dynamic shared memory; the blocks of one row block (same
// weights) are adjacent in launch order.
extern "C" __global__ void __launch_bounds__(256) matvec_tc_t(W w, const uint2* __restrict__ xs,
                                                              const float* __restrict__ gs, float* __restrict__ y,
                                                              int n) {
    PDL_TRIGGER();
    const int cols = w.cols, ng = cols >> 6, rows = w.rows, gpq = ng >> 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tile = warp >> 2, quarter = warp & 3;
    const int t0 = blockIdx.x * TC_TOKENS;
    int tok[TC_TOKENS];
#pragma unroll
    for (int u = 0; u < TC_TOKENS; u++) tok[u] = min(t0 + u, n - 1);
    const int ra_raw = blockIdx.y * 32 + tile * 16 + (lane >> 2);
    const int ra = min(ra_raw, rows - 1), rb = min(ra_raw + 8, rows - 1);
    float acc[TC_SETS][4] = {};
    tc_tile_t<4>(w, ra, w, rb, quarter * gpq, gpq, xs, gs, ng, tok, lane, acc, []() { PDL_WAIT(); });
    float va[TC_SETS], vb[TC_SETS];
    if (tc_quarters_t((float*)a4v_dyn, tile, quarter, lane, acc, va, vb) && (lane & 3) < TC_TPM) {
#pragma unroll
        for (int s = 0; s < TC_SETS; s++) {
            const int t = t0 + s * TC_TPM + (lane & 3);
            if (t >= n) continue;
            if (ra_raw < rows) y[(size_t)t * rows + ra_raw] = va[s];
            if (ra_raw + 8 < rows) y[(size_t)t * rows + ra_raw + 8] = vb[s];
        }
    }
}

// moe_gate_up_tc over pairs grouped by expert (prefill; group_pairs gives
// goff, list): block (bx, e) runs rows bx of expert e's gate and up (the
// record at addr[e], parts at off0 / off1) over every pair of its group,
// TC_TOKENS pairs at a time, x rows split by tc_split (xs, gs; pair p's
// row xrow[p]); each pair's h the bits of its moe_gate_up_tc block. Grid
// (ceil(I / 16), E), 256 threads, dynamic shared memory as matvec_tc_t.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_tc_grouped(
    W gt, W ut, const u64* __restrict__ addr, u64 off0, u64 off1, const int* __restrict__ goff,
    const int* __restrict__ list, const int* __restrict__ xrow, const uint2* __restrict__ xs,
    const float* __restrict__ gs, float* __restrict__ h) {
    PDL_EXPERTS_START();
    const int e = blockIdx.y;
    const int i0 = goff[e], i1 = goff[e + 1];
    if (i0 >= i1) return;
    const int cols = gt.cols, ng = cols >> 6, I = gt.rows, gpq = ng >> 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tile = warp >> 2, quarter = warp & 3;
    const W g = at_base_a4(gt, (const u8*)(addr[e] + off0));
    const W u = at_base_a4(ut, (const u8*)(addr[e] + off1));
    const int row_raw = blockIdx.x * 16 + tile * 8 + (lane >> 2);
    const int row = min(row_raw, I - 1);
    for (int i = i0; i < i1; i += TC_TOKENS) {
        int tok[TC_TOKENS];
#pragma unroll
        for (int v = 0; v < TC_TOKENS; v++) tok[v] = xrow[list[min(i + v, i1 - 1)]];
        float acc[TC_SETS][4] = {};
        tc_tile_t<8>(g, row, u, row, quarter * gpq, gpq, xs, gs, ng, tok, lane, acc, []() {});
        float gv[TC_SETS], uv[TC_SETS];
        if (tc_quarters_t((float*)a4v_dyn, tile, quarter, lane, acc, gv, uv) && (lane & 3) < TC_TPM &&
            row_raw < I) {
#pragma unroll
            for (int s = 0; s < TC_SETS; s++) {
                const int k = i + s * TC_TPM + (lane & 3);
                if (k < i1) h[(size_t)list[k] * I + row_raw] = siluf_(gv[s]) * uv[s];
            }
        }
    }
}

// Routed experts' down projections over pairs grouped by expert (prefill,
// the tensor-core form): block (bx, e) runs 128 rows of expert e's down
// (record at addr[e], part at off2; warp w rows bx * 128 + 16 w + 0..15)
// over every pair of its group, TC_TOKENS at a time, h rows split by
// tc_split (xs, gs: row p = pair p); v[p, row] gets pair p's dot products,
// the bits of moe_down_tc's warp for that rank (one warp over all
// columns). moe_down_combine then sums each token's ranks. Grid
// (ceil(H / 128), E), 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_down_tc_grouped(
    W dt, const u64* __restrict__ addr, u64 off2, const int* __restrict__ goff, const int* __restrict__ list,
    const uint2* __restrict__ xs, const float* __restrict__ gs, float* __restrict__ v) {
    PDL_START();
    const int e = blockIdx.y;
    const int i0 = goff[e], i1 = goff[e + 1];
    if (i0 >= i1) return;
    const int ng = dt.cols >> 6, H = dt.rows;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const W d = at_base_a4(dt, (const u8*)(addr[e] + off2));
    const int r0_raw = blockIdx.x * 128 + warp * 16 + (lane >> 2);
    const int r0 = min(r0_raw, H - 1), r1 = min(r0_raw + 8, H - 1);
    for (int i = i0; i < i1; i += TC_TOKENS) {
        int tok[TC_TOKENS];
#pragma unroll
        for (int u = 0; u < TC_TOKENS; u++) tok[u] = list[min(i + u, i1 - 1)];
        float acc[TC_SETS][4] = {};
        tc_tile_t<8>(d, r0, d, r1, 0, ng, xs, gs, ng, tok, lane, acc, []() {});
#pragma unroll
        for (int s = 0; s < TC_SETS; s++) {
            float va, vb;
            tc_rows_out_t(acc[s], &va, &vb, lane);
            const int k = i + s * TC_TPM + (lane & 3);
            if ((lane & 3) < TC_TPM && k < i1) {
                const int p = list[k];
                if (r0_raw < H) v[(size_t)p * H + r0_raw] = va;
                if (r0_raw + 8 < H) v[(size_t)p * H + r0_raw + 8] = vb;
            }
        }
    }
}

// x[t, :] += the routed down outputs v [tokens K, H] of token t's K ranks
// summed in order with their weights, plus the gated shared expert, as
// moe_down_tc ends (tc_down_sum). Grid (ceil(H / 256), tokens), 256 threads.
extern "C" __global__ void moe_down_combine(const float* __restrict__ v, int H, const float* __restrict__ wts,
                                            int K, const float* __restrict__ shared,
                                            const float* __restrict__ sgate, float* __restrict__ x) {
    PDL_START();
    const int t = blockIdx.y, row = blockIdx.x * 256 + threadIdx.x;
    if (row < H) tc_down_sum(v + (size_t)t * K * H + row, H, wts, K, shared, sgate, x, t, H, row);
}

// Row block `blk` (8 rows, one per warp) of y[t, :] = W x[t, :] for token
// t = blockIdx.y.
__device__ __forceinline__ void matvec_rows(const W& w, int blk, const float* __restrict__ x,
                                            float* __restrict__ y) {
    const int lane = threadIdx.x & 31;
    const int r = blk * 8 + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (r >= w.rows) return;
    const float v = row_dot(w, r, x + (size_t)t * w.cols, lane);
    if (lane == 0) y[(size_t)t * w.rows + r] = v;
}

// y[t, r] = W[r, :] . x[t, :] for `n` tokens. Block: 256 threads, one warp
// per row; grid (ceil(rows / 8), n).
extern "C" __global__ void matvec(W w, const float* __restrict__ x, float* __restrict__ y) {
    PDL_START();
    matvec_rows(w, blockIdx.x, x, y);
}

// matvec of up to four matrices over the same x in one launch (a MoE
// layer's router and shared-expert gate): blocks [0, b1) run w0's row
// blocks, [b1, b2) w1's, [b2, b3) w2's, the rest w3's; each block the bits
// of its own matvec launch. Grid (total row blocks, n), 256 threads.
extern "C" __global__ void matvec_multi(W w0, W w1, W w2, W w3, int b1, int b2, int b3,
                                        const float* __restrict__ x, float* __restrict__ y0,
                                        float* __restrict__ y1, float* __restrict__ y2, float* __restrict__ y3) {
    PDL_START();
    const int b = blockIdx.x;
    if (b < b1) matvec_rows(w0, b, x, y0);
    else if (b < b2) matvec_rows(w1, b - b1, x, y1);
    else if (b < b3) matvec_rows(w2, b - b2, x, y2);
    else matvec_rows(w3, b - b3, x, y3);
}

// Routed experts' gate and up for `pairs` (token, rank) pairs in one launch:
// h[p, i] = silu(gate_p[i] . x[xrow[p]]) * (up_p[i] . x[xrow[p]]).
// `gbase[p]`/`ubase[p]` are the device addresses of pair p's gate and up
// parts. Grid (ceil(I / 8), pairs), 256 threads.
extern "C" __global__ void moe_gate_up(W gt, W ut, const u64* __restrict__ gbase, const u64* __restrict__ ubase,
                                       const int* __restrict__ xrow, const float* __restrict__ x,
                                       float* __restrict__ h) {
    PDL_EXPERTS_START();
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    int p = blockIdx.y;
    if (r >= gt.rows) return;
    W g = at_base(gt, (const u8*)gbase[p]);
    W u = at_base(ut, (const u8*)ubase[p]);
    const float* xp = x + (size_t)xrow[p] * gt.cols;
    float gv = row_dot(g, r, xp, lane);
    float uv = row_dot(u, r, xp, lane);
    if (lane == 0) h[(size_t)p * gt.rows + r] = siluf_(gv) * uv;
}

// Routed experts' down projections and their weighted sum in rank order,
// plus the gated shared expert, added to the residual:
// x[t, r] += sum_k wts[t, k] * (down_{t,k}[r] . h[t*K + k]) + sigmoid(sg[t]) * shared[t, r].
// `shared` may be null (no shared expert). Grid (ceil(H / 8), tokens).
extern "C" __global__ void moe_down(W dt, const u64* __restrict__ dbase, const float* __restrict__ h,
                                    const float* __restrict__ wts, int K, const float* __restrict__ shared,
                                    const float* __restrict__ sg, float* __restrict__ x) {
    PDL_START();
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    int t = blockIdx.y;
    if (r >= dt.rows) return;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) {
        int p = t * K + k;
        W d = at_base(dt, (const u8*)dbase[p]);
        float v = row_dot(d, r, h + (size_t)p * dt.cols, lane);
        acc += v * wts[p];
    }
    if (lane == 0) {
        float s = 0.0f;
        if (shared) s = sigmoidf_(sg[t]) * shared[(size_t)t * dt.rows + r];
        x[(size_t)t * dt.rows + r] += acc + s;
    }
}

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

#define ATT_CHUNK 128
#define ATT_MAXG 16

// Decode attention, pass 1 (split over keys). Block (kv head, split): the
// `group` query heads of that KV head walk keys [split*ATT_CHUNK, ..) of the
// first `keys` together, so each K and V row is read once per KV head.
// Writes per (head, split) the running max m, sum l and unnormalised
// acc[hd]. `dpos`, when not null, replaces keys with dpos[0] + 1 (the
// position in device memory, for graph replay): nsplit follows from it and
// the blocks of a grid sized for the cache's capacity past nsplit return at
// once, so both forms compute the same bits. Without `dpos`, grid z runs a
// causal batch of queries: query z (q + z nh hd) sees keys + z keys and
// writes its own scratch (pm, pl, pacc + z zs), each with the numbers of
// its own one-query launch. 256 threads; group <= ATT_MAXG; hd <= 256.
__device__ __forceinline__ int att_splits(int keys, int chunk = ATT_CHUNK) { return (keys + chunk - 1) / chunk; }
extern "C" __global__ void attn_partial(const float* __restrict__ q, const float* __restrict__ kc,
                                       const float* __restrict__ vc, int keys, int nh, int nkv, int hd,
                                       float scale, int nsplit, float* __restrict__ pm, float* __restrict__ pl,
                                       float* __restrict__ pacc, const int* __restrict__ dpos, int zs) {
    PDL_START();
    if (dpos) {
        keys = dpos[0] + 1;
        nsplit = att_splits(keys);
    } else {
        // Query z of a causal batch: one more key than query z - 1, its
        // own scratch area of zs floats (z = 0: the arguments as given).
        const int z = blockIdx.z;
        keys += z;
        nsplit = att_splits(keys);
        q += (size_t)z * nh * hd;
        pm += (size_t)z * zs;
        pl += (size_t)z * zs;
        pacc += (size_t)z * zs;
    }
    if ((int)blockIdx.y >= nsplit) return;
    __shared__ float qs[ATT_MAXG * 256];
    __shared__ float sc[ATT_MAXG * ATT_CHUNK];
    __shared__ float mx[ATT_MAXG];
    __shared__ float sm[ATT_MAXG];
    int kvh = blockIdx.x, sp = blockIdx.y;
    int group = nh / nkv;
    int j0 = sp * ATT_CHUNK;
    int nj = min(ATT_CHUNK, keys - j0);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x) qs[i] = q[(size_t)kvh * group * hd + i];
    __syncthreads();
    size_t kvs = (size_t)nkv * hd;
    for (int j = wid; j < nj; j += nwarp) {
        const float* kr = kc + (size_t)(j0 + j) * kvs + (size_t)kvh * hd;
        float kreg[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int d = lane + 32 * u;
            kreg[u] = d < hd ? kr[d] : 0.0f;
        }
        for (int g = 0; g < group; g++) {
            float a = 0.0f;
#pragma unroll
            for (int u = 0; u < 8; u++) {
                int d = lane + 32 * u;
                if (d < hd) a += qs[g * hd + d] * kreg[u];
            }
            a = warp_sum(a);
            if (lane == 0) sc[g * ATT_CHUNK + j] = a * scale;
        }
    }
    __syncthreads();
    for (int g = wid; g < group; g += nwarp) {
        float m = -INFINITY;
        for (int j = lane; j < nj; j += 32) m = fmaxf(m, sc[g * ATT_CHUNK + j]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.0f;
        for (int j = lane; j < nj; j += 32) {
            float e = expf(sc[g * ATT_CHUNK + j] - m);
            sc[g * ATT_CHUNK + j] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            mx[g] = m;
            sm[g] = l;
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc[ATT_MAXG];
#pragma unroll
        for (int g = 0; g < ATT_MAXG; g++) acc[g] = 0.0f;
        for (int j = 0; j < nj; j++) {
            float v = vc[(size_t)(j0 + j) * kvs + (size_t)kvh * hd + d];
#pragma unroll
            for (int g = 0; g < ATT_MAXG; g++)
                if (g < group) acc[g] += sc[g * ATT_CHUNK + j] * v;
        }
#pragma unroll
        for (int g = 0; g < ATT_MAXG; g++)
            if (g < group) pacc[((size_t)(kvh * group + g) * nsplit + sp) * hd + d] = acc[g];
    }
    if (threadIdx.x < group) {
        pm[(size_t)(kvh * group + threadIdx.x) * nsplit + sp] = mx[threadIdx.x];
        pl[(size_t)(kvh * group + threadIdx.x) * nsplit + sp] = sm[threadIdx.x];
    }
}

// Decode attention, pass 2: combine the splits of head blockIdx.x and apply
// the sigmoid output gate (when `gate` is not null); `dpos` as in
// attn_partial. Splits of `chunk` keys (ATT_CHUNK after attn_partial,
// PA_SPLIT after attn_prompt_tc). 256 threads.
extern "C" __global__ void attn_combine(const float* __restrict__ pm, const float* __restrict__ pl,
                                       const float* __restrict__ pacc, int nsplit, int hd,
                                       const float* __restrict__ gate, float* __restrict__ out,
                                       const int* __restrict__ dpos, int keys, int zs, int chunk) {
    PDL_START();
    if (dpos) {
        nsplit = att_splits(dpos[0] + 1, chunk);
    } else {
        // Query z of a causal batch (see attn_partial).
        const int z = blockIdx.z;
        nsplit = att_splits(keys + z, chunk);
        pm += (size_t)z * zs;
        pl += (size_t)z * zs;
        pacc += (size_t)z * zs;
        if (gate) gate += (size_t)z * gridDim.x * hd;
        out += (size_t)z * gridDim.x * hd;
    }
    int h = blockIdx.x;
    float m = -INFINITY;
    for (int s = 0; s < nsplit; s++) m = fmaxf(m, pm[(size_t)h * nsplit + s]);
    float l = 0.0f;
    for (int s = 0; s < nsplit; s++) l += expf(pm[(size_t)h * nsplit + s] - m) * pl[(size_t)h * nsplit + s];
    float inv = 1.0f / l;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < nsplit; s++)
            a += expf(pm[(size_t)h * nsplit + s] - m) * pacc[((size_t)h * nsplit + s) * hd + d];
        float o = a * inv;
        if (gate) o *= sigmoidf_(gate[(size_t)h * hd + d]);
        out[(size_t)h * hd + d] = o;
    }
}

// Prompt attention on tensor cores, pass 1. Block (row tile x, key split
// y, KV head z) takes PA_ROWS rows of the pass, row R = (query R / group,
// head kvh * group + R % group), over the keys [y PA_SPLIT, ..) up to the
// tile's last position, PA_KEYS at a time: S = Q K^T and O += P V on
// tensor cores in 3xTF32 (about f32), online softmax per row. Query t sits
// at position pos0 + t and sees keys 0 ..= pos0 + t. It writes per (row,
// split) what attn_partial writes per (head, split): max m, sum l and the
// unnormalised acc[hd] (query t in its own scratch area z = t of zs
// floats, split count att_splits(pos0 + t + 1, PA_SPLIT)), for
// attn_combine with chunk PA_SPLIT. A row's numbers depend only on its
// own query and keys: key blocks start at multiples of PA_KEYS, a block
// past a row's position leaves its state exactly as it was (alpha 1, P 0),
// the mma's rows are independent and every sum runs in a fixed order. So a
// query gets the same bits in a pass of any length, alone or in a tile with
// others. 128 threads (warp w: keys 8w.. of S, dims w hd/4.. of O); hd a
// multiple of 32, at most 256; dynamic smem prompt_attn_smem(hd).
#define PA_ROWS 16
#define PA_KEYS 32
#define PA_SPLIT 1024
extern "C" __global__ void __launch_bounds__(128) attn_prompt_tc(
    const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc, int pos0, int n,
    int nh, int nkv, int hd, float scale, float* __restrict__ pm, float* __restrict__ pl,
    float* __restrict__ pacc, int zs) {
    PDL_START();
    const int group = nh / nkv, kvh = blockIdx.z, sp = blockIdx.y;
    const int rows = n * group, r0 = blockIdx.x * PA_ROWS;
    const int last = pos0 + min(n - 1, (r0 + PA_ROWS - 1) / group);
    const int k0 = sp * PA_SPLIT;
    if (k0 > last) return;
    const int k1 = min(k0 + PA_SPLIT, last + 1);
    const int sq = hd + 4, sv = hd + 8, spp = PA_KEYS + 4, h4 = hd >> 2;
    float* qs = (float*)a4v_dyn;
    float* ks = qs + PA_ROWS * sq;
    float* vs = ks + PA_KEYS * sq;
    float* ps = vs + PA_KEYS * sv;
    float* als = ps + PA_ROWS * spp;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int i = tid; i < PA_ROWS * h4; i += 128) {
        const int r = i / h4, c = i - r * h4, R = r0 + r;
        float4 v = zero4;
        if (R < rows) v = *(const float4*)(q + ((size_t)(R / group) * nh + kvh * group + R % group) * hd + 4 * c);
        *(float4*)(qs + r * sq + 4 * c) = v;
    }
    // The softmax lanes: eight per row, keys 4 sub .. 4 sub + 3 of a block.
    const int sr = tid >> 3, sub = tid & 7;
    const int spos = r0 + sr < rows ? pos0 + (r0 + sr) / group : -1;
    float m_run = -INFINITY, l_run = 0.0f;
    // O of rows g, g + 8, dims d0 + 8j + 2 t4 (+1).
    const int nt = hd >> 5, d0 = w * (hd >> 2);
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int j0 = k0; j0 < k1; j0 += PA_KEYS) {
        for (int i = tid; i < PA_KEYS * h4; i += 128) {
            const int j = i / h4, c = i - j * h4, key = j0 + j;
            float4 kv = zero4, vv = zero4;
            if (key < k1) {
                const size_t o = ((size_t)key * nkv + kvh) * hd + 4 * c;
                kv = *(const float4*)(kc + o);
                vv = *(const float4*)(vc + o);
            }
            *(float4*)(ks + j * sq + 4 * c) = kv;
            *(float4*)(vs + j * sv + 4 * c) = vv;
        }
        __syncthreads();
        {
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const float* qa = qs + g * sq + t4;
            const float* kb = ks + (8 * w + g) * sq + t4;
            for (int kk = 0; kk < hd; kk += 8) {
                u32 ah[4], al[4], bh[2], bl[2];
                tf32_split(qa[kk], ah[0], al[0]);
                tf32_split(qa[8 * sq + kk], ah[1], al[1]);
                tf32_split(qa[kk + 4], ah[2], al[2]);
                tf32_split(qa[8 * sq + kk + 4], ah[3], al[3]);
                tf32_split(kb[kk], bh[0], bl[0]);
                tf32_split(kb[kk + 4], bh[1], bl[1]);
                tf32x3_mma(s, ah, al, bh, bl);
            }
            float* pr = ps + g * spp + 8 * w + 2 * t4;
            pr[0] = s[0] * scale;
            pr[1] = s[1] * scale;
            pr[8 * spp] = s[2] * scale;
            pr[8 * spp + 1] = s[3] * scale;
        }
        __syncthreads();
        {
            // Keys of row sr in this block: nv <= 0 leaves its state as is.
            const int nv = min(PA_KEYS, spos - j0 + 1);
            float sv4[4], mb = -INFINITY;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                sv4[i] = 4 * sub + i < nv ? ps[sr * spp + 4 * sub + i] : -INFINITY;
                mb = fmaxf(mb, sv4[i]);
            }
            for (int o = 4; o > 0; o >>= 1) mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, o));
            float alpha = 1.0f, mn = m_run;
            if (nv > 0) {
                mn = fmaxf(m_run, mb);
                alpha = expf(m_run - mn);
            }
            float p[4], sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                p[i] = 4 * sub + i < nv ? expf(sv4[i] - mn) : 0.0f;
                sum += p[i];
            }
            // An xor tree: every lane of the row ends with the same sum.
            for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (nv > 0) {
                l_run = l_run * alpha + sum;
                m_run = mn;
            }
#pragma unroll
            for (int i = 0; i < 4; i++) ps[sr * spp + 4 * sub + i] = p[i];
            if (sub == 0) als[sr] = alpha;
        }
        __syncthreads();
        {
            const float a_lo = als[g], a_hi = als[g + 8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                acc[j][0] *= a_lo;
                acc[j][1] *= a_lo;
                acc[j][2] *= a_hi;
                acc[j][3] *= a_hi;
            }
#pragma unroll
            for (int kk = 0; kk < PA_KEYS; kk += 8) {
                u32 ah[4], al[4];
                const float* pa = ps + g * spp + kk + t4;
                tf32_split(pa[0], ah[0], al[0]);
                tf32_split(pa[8 * spp], ah[1], al[1]);
                tf32_split(pa[4], ah[2], al[2]);
                tf32_split(pa[8 * spp + 4], ah[3], al[3]);
                const float* vb = vs + (kk + t4) * sv + d0 + g;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (j < nt) {
                        u32 bh[2], bl[2];
                        tf32_split(vb[8 * j], bh[0], bl[0]);
                        tf32_split(vb[4 * sv + 8 * j], bh[1], bl[1]);
                        tf32x3_mma(acc[j], ah, al, bh, bl);
                    }
                }
            }
        }
        __syncthreads();
    }
    // Rows with keys in this split write their partials.
    if (sub == 0 && spos >= k0) {
        const int t = (r0 + sr) / group, head = kvh * group + (r0 + sr) % group;
        const int ns = (pos0 + t + PA_SPLIT) / PA_SPLIT;
        pm[(size_t)t * zs + head * ns + sp] = m_run;
        pl[(size_t)t * zs + head * ns + sp] = l_run;
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int R = r0 + g + 8 * half;
        if (R >= rows) continue;
        const int t = R / group, head = kvh * group + R % group;
        if (pos0 + t < k0) continue;
        const int ns = (pos0 + t + PA_SPLIT) / PA_SPLIT;
        float* dst = pacc + (size_t)t * zs + ((size_t)head * ns + sp) * hd + d0 + 2 * t4;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < nt) *(float2*)(dst + 8 * j) = make_float2(acc[j][2 * half], acc[j][2 * half + 1]);
    }
}

// Gated DeltaNet causal depthwise conv + SiLU for `n` tokens, one thread per
// channel: window = [state (K-1 rows) ++ x rows]; the state keeps the last
// K-1 rows. conv_w is `[C, K]`, state `[K-1, C]`.
extern "C" __global__ void gdn_conv(const float* __restrict__ x, int n, const float* __restrict__ cw, int C,
                                   int K, float* __restrict__ state, float* __restrict__ out) {
    PDL_START();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    float win[8];
    int hist = K - 1;
    for (int i = 0; i < hist; i++) win[i] = state[(size_t)i * C + ch];
    for (int t = 0; t < n; t++) {
        win[hist] = x[(size_t)t * C + ch];
        float acc = 0.0f;
        for (int j = 0; j < K; j++) acc += cw[(size_t)ch * K + j] * win[j];
        out[(size_t)t * C + ch] = siluf_(acc);
        for (int i = 0; i < hist; i++) win[i] = win[i + 1];
    }
    for (int i = 0; i < hist; i++) state[(size_t)i * C + ch] = win[i];
}

// One Gated DeltaNet value head (blockIdx.x = j) over `n` tokens of the
// recurrent form. Each thread owns column(s) d of the state S `[dk, dv]`:
// pass 1 decays S and accumulates kv = k^T S; delta = (v - kv) * beta;
// pass 2 adds k delta^T and accumulates o = q^T S (the order of
// slipstream_kernels::recurrence::delta_rule_step). Then the gated RMS
// norm: core = o * inv_rms(o) * norm * silu(z). dk, dv <= 256.
extern "C" __global__ void gdn_step(const float* __restrict__ conv_out, const float* __restrict__ z,
                                   const float* __restrict__ b, const float* __restrict__ a,
                                   const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                   const float* __restrict__ nw, float* __restrict__ S, int n, int nk, int dk,
                                   int nv, int dv, float eps, float* __restrict__ core) {
    PDL_START();
    __shared__ float qs[256];
    __shared__ float ks[256];
    int j = blockIdx.x;
    int kh = j / (nv / nk);
    int C = 2 * nk * dk + nv * dv;
    float* s = S + (size_t)j * dk * dv;
    float decay_rate = -expf(a_log[j]);
    float q_scale = 1.0f / sqrtf((float)dk);
    for (int t = 0; t < n; t++) {
        const float* row = conv_out + (size_t)t * C;
        double sq = 0.0, sk = 0.0;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            float qv = row[kh * dk + i], kv = row[nk * dk + kh * dk + i];
            qs[i] = qv;
            ks[i] = kv;
            sq += (double)qv * qv;
            sk += (double)kv * kv;
        }
        sq = block_sum_d(sq);
        sk = block_sum_d(sk);
        float iq = 1.0f / sqrtf((float)sq + 1e-6f), ik = 1.0f / sqrtf((float)sk + 1e-6f);
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = (qs[i] * iq) * q_scale;
            ks[i] = ks[i] * ik;
        }
        __syncthreads();
        float beta = sigmoidf_(b[(size_t)t * nv + j]);
        float ax = a[(size_t)t * nv + j] + dt_bias[j];
        float sp = ax > 20.0f ? ax : log1pf(expf(ax));
        float decay = expf(decay_rate * sp);
        const float* v = row + 2 * nk * dk + (size_t)j * dv;
        double oo = 0.0;
        float ov[2] = {0.0f, 0.0f};
        for (int u = 0; u < 2; u++) {
            int d = threadIdx.x + u * blockDim.x;
            if (d >= dv) continue;
            float kv = 0.0f;
            for (int i = 0; i < dk; i++) {
                float x = s[(size_t)i * dv + d] * decay;
                s[(size_t)i * dv + d] = x;
                kv += ks[i] * x;
            }
            float delta = (v[d] - kv) * beta;
            float o = 0.0f;
            for (int i = 0; i < dk; i++) {
                float x = s[(size_t)i * dv + d] + ks[i] * delta;
                s[(size_t)i * dv + d] = x;
                o += qs[i] * x;
            }
            ov[u] = o;
            oo += (double)o * o;
        }
        oo = block_sum_d(oo);
        float inv = 1.0f / sqrtf((float)(oo / dv) + eps);
        for (int u = 0; u < 2; u++) {
            int d = threadIdx.x + u * blockDim.x;
            if (d >= dv) continue;
            float zz = z[(size_t)t * nv * dv + (size_t)j * dv + d];
            core[(size_t)t * nv * dv + (size_t)j * dv + d] = (ov[u] * inv) * nw[d] * siluf_(zz);
        }
        __syncthreads();
    }
}

// gdn_step for dk <= 128 and dv <= 128 (the Qwen3.5/3-Next heads): 512
// threads, column d = tid % 128 of the state and rows i = 4 r + tid / 128,
// so each thread keeps its 32 state values in registers for all n tokens
// (the state is read once and written once, instead of twice each per
// token). The dot products over rows are summed per row group, then over
// the 4 groups in a fixed order. Same grid (nv heads) and outputs as gdn_step.
#define GDN_RG 4
#define GDN_RPT 32
extern "C" __global__ void __launch_bounds__(512) gdn_step_r(
    const float* __restrict__ conv_out, const float* __restrict__ z, const float* __restrict__ b,
    const float* __restrict__ a, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const float* __restrict__ nw, float* __restrict__ S, int n, int nk, int dk, int nv, int dv, float eps,
    float* __restrict__ core) {
    PDL_START();
    __shared__ float qs[128];
    __shared__ float ks[128];
    __shared__ float red[GDN_RG][128];
    const int j = blockIdx.x;
    const int kh = j / (nv / nk);
    const int C = 2 * nk * dk + nv * dv;
    const int d = threadIdx.x & 127, rg = threadIdx.x >> 7;
    const bool col = d < dv;
    float* s = S + (size_t)j * dk * dv;
    float st[GDN_RPT];
#pragma unroll
    for (int r = 0; r < GDN_RPT; r++) {
        const int i = r * GDN_RG + rg;
        st[r] = (col && i < dk) ? s[(size_t)i * dv + d] : 0.0f;
    }
    const float decay_rate = -expf(a_log[j]);
    const float q_scale = 1.0f / sqrtf((float)dk);
    // A token's inputs (thread i < dk: q[i], k[i]; every thread: b, a and
    // column d's v and z) are loaded one step ahead, so each step of a
    // multi-token pass finds them in registers instead of waiting on four
    // dependent rounds of loads. The arithmetic is unchanged (same bits).
    const int i0 = threadIdx.x;  // dk <= 128 < blockDim.x: one q/k element per thread at most
    float nq = 0.0f, nk_ = 0.0f, nb = 0.0f, na = 0.0f, nv_ = 0.0f, nz = 0.0f;
    auto fetch = [&](int t) {
        const float* row = conv_out + (size_t)t * C;
        if (i0 < dk) {
            nq = row[kh * dk + i0];
            nk_ = row[nk * dk + kh * dk + i0];
        }
        nb = b[(size_t)t * nv + j];
        na = a[(size_t)t * nv + j];
        if (col) {
            nv_ = row[2 * nk * dk + (size_t)j * dv + d];
            nz = z[(size_t)t * nv * dv + (size_t)j * dv + d];
        }
    };
    fetch(0);
    for (int t = 0; t < n; t++) {
        const float cq = nq, ck = nk_, cb = nb, ca = na, cv = nv_, cz = nz;
        if (t + 1 < n) fetch(t + 1);
        double sq = 0.0, sk = 0.0;
        if (i0 < dk) {
            qs[i0] = cq;
            ks[i0] = ck;
            sq += (double)cq * cq;
            sk += (double)ck * ck;
        }
        block_sum_d2(sq, sk);
        const float iq = 1.0f / sqrtf((float)sq + 1e-6f), ik = 1.0f / sqrtf((float)sk + 1e-6f);
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = (qs[i] * iq) * q_scale;
            ks[i] = ks[i] * ik;
        }
        __syncthreads();
        const float beta = sigmoidf_(cb);
        const float ax = ca + dt_bias[j];
        const float sp = ax > 20.0f ? ax : log1pf(expf(ax));
        const float decay = expf(decay_rate * sp);
        float p = 0.0f;
#pragma unroll
        for (int r = 0; r < GDN_RPT; r++) {
            const int i = r * GDN_RG + rg;
            if (i < dk) {
                st[r] *= decay;
                p += ks[i] * st[r];
            }
        }
        red[rg][d] = p;
        __syncthreads();
        const float kv = ((red[0][d] + red[1][d]) + red[2][d]) + red[3][d];
        const float delta = col ? (cv - kv) * beta : 0.0f;
        __syncthreads();
        float po = 0.0f;
#pragma unroll
        for (int r = 0; r < GDN_RPT; r++) {
            const int i = r * GDN_RG + rg;
            if (i < dk) {
                st[r] += ks[i] * delta;
                po += qs[i] * st[r];
            }
        }
        red[rg][d] = po;
        __syncthreads();
        const float o = ((red[0][d] + red[1][d]) + red[2][d]) + red[3][d];
        double oo = (rg == 0 && col) ? (double)o * o : 0.0;
        oo = block_sum_d(oo);
        const float inv = 1.0f / sqrtf((float)(oo / dv) + eps);
        if (rg == 0 && col) {
            core[(size_t)t * nv * dv + (size_t)j * dv + d] = (o * inv) * nw[d] * siluf_(cz);
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < GDN_RPT; r++) {
        const int i = r * GDN_RG + rg;
        if (col && i < dk) s[(size_t)i * dv + d] = st[r];
    }
}

// Column sums of a warp's 8 columns: p[c] is this lane's part of column c;
// returns the warp's total of column lane >> 2 (the 4 lanes of a group hold
// the same bits). A transposed butterfly: each exchange halves the columns
// a lane carries, so 8 sums take 9 shuffles instead of 40.
__device__ __forceinline__ float warp_sum8_t(const float (&p)[8], int lane) {
    const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
    float q4[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float send = b4 ? p[k] : p[k + 4], keep = b4 ? p[k + 4] : p[k];
        q4[k] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
    }
    float q2[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const float send = b3 ? q4[k] : q4[k + 2], keep = b3 ? q4[k + 2] : q4[k];
        q2[k] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    const float send = b2 ? q2[0] : q2[1], keep = b2 ? q2[1] : q2[0];
    float q1 = keep + __shfl_xor_sync(0xffffffffu, send, 4);
    q1 += __shfl_xor_sync(0xffffffffu, q1, 2);
    q1 += __shfl_xor_sync(0xffffffffu, q1, 1);
    return q1;
}

// gdn_step for dk <= 128 and dv <= 128 with no block barrier in a step's
// dot products: warp w owns state columns 8 w .. 8 w + 7 and lane the rows
// lane + 32 r (r < 4), 32 values in registers for all n tokens. k^T S and
// q^T S are sums over one warp's lanes (warp_sum8_t), |q|^2 and |k|^2 are
// summed by every warp alike (the rows a lane owns are the q/k elements it
// loads), and the only barrier per token is the gated RMS norm's sum over
// the head's columns (its partials double-buffered by token parity).
// Same grid (nv heads) and outputs as gdn_step; 512 threads.
extern "C" __global__ void __launch_bounds__(512) gdn_step_w(
    const float* __restrict__ conv_out, const float* __restrict__ z, const float* __restrict__ b,
    const float* __restrict__ a, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const float* __restrict__ nw, float* __restrict__ S, int n, int nk, int dk, int nv, int dv, float eps,
    float* __restrict__ core) {
    PDL_START();
    __shared__ double red[2][16];
    const int j = blockIdx.x;
    const int kh = j / (nv / nk);
    const int C = 2 * nk * dk + nv * dv;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int c0 = 8 * w;
    // The column whose sums this lane ends with (warp_sum8_t).
    const int my_d = c0 + (lane >> 2);
    const bool my_col = my_d < dv, writer = my_col && (lane & 3) == 0;
    float* s = S + (size_t)j * dk * dv;
    // Rows past dk stay 0 (their q and k are 0, so they add nothing).
    float st[4][8] = {};
    // The state goes through shared memory, 64 rows at a time: read from
    // memory in row order (thread t: column t % 128, rows t / 128 + 4 m),
    // then each thread takes its rows' columns (a lane's rows are 32
    // apart, so its direct loads would each touch another sector: 3x the
    // kernel's time for a one-token pass).
    __shared__ float stage[64][129];
    const int tid = threadIdx.x;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int rows = min(64, dk - 64 * half);  // <= 0: nothing to move
        if ((tid & 127) < dv)
            for (int row = tid >> 7; row < rows; row += 4)
                stage[row][tid & 127] = s[(size_t)(64 * half + row) * dv + (tid & 127)];
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            const int r = 2 * half + rr, i = r * 32 + lane;
#pragma unroll
            for (int c = 0; c < 8; c++)
                st[r][c] = (i < dk && c0 + c < dv) ? stage[i - 64 * half][c0 + c] : 0.0f;
        }
        __syncthreads();
    }
    const float decay_rate = -expf(a_log[j]);
    const float q_scale = 1.0f / sqrtf((float)dk);
    const float dtb = dt_bias[j];
    // A token's inputs are loaded one step ahead (see gdn_step_r).
    float nq[4], nk4[4], nb = 0.0f, na = 0.0f, nvv = 0.0f, nz = 0.0f;
    auto fetch = [&](int t) {
        const float* row = conv_out + (size_t)t * C;
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int i = r * 32 + lane;
            nq[r] = i < dk ? row[kh * dk + i] : 0.0f;
            nk4[r] = i < dk ? row[nk * dk + kh * dk + i] : 0.0f;
        }
        nb = b[(size_t)t * nv + j];
        na = a[(size_t)t * nv + j];
        if (my_col) {
            nvv = row[2 * nk * dk + (size_t)j * dv + my_d];
            nz = z[(size_t)t * nv * dv + (size_t)j * dv + my_d];
        }
    };
    fetch(0);
    for (int t = 0; t < n; t++) {
        float cq[4], ck[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            cq[r] = nq[r];
            ck[r] = nk4[r];
        }
        const float cb = nb, ca = na, cv = nvv, cz = nz;
        if (t + 1 < n) fetch(t + 1);
        double sq = 0.0, sk = 0.0;
#pragma unroll
        for (int r = 0; r < 4; r++) {
            sq += (double)cq[r] * cq[r];
            sk += (double)ck[r] * ck[r];
        }
        sq = warp_sum_d(sq);
        sk = warp_sum_d(sk);
        const float iq = 1.0f / sqrtf((float)sq + 1e-6f), ik = 1.0f / sqrtf((float)sk + 1e-6f);
        float qn[4], kn[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            qn[r] = (cq[r] * iq) * q_scale;
            kn[r] = ck[r] * ik;
        }
        const float beta = sigmoidf_(cb);
        const float ax = ca + dtb;
        const float sp = ax > 20.0f ? ax : log1pf(expf(ax));
        const float decay = expf(decay_rate * sp);
        float p[8];
#pragma unroll
        for (int c = 0; c < 8; c++) {
            p[c] = 0.0f;
#pragma unroll
            for (int r = 0; r < 4; r++) {
                st[r][c] *= decay;
                p[c] += kn[r] * st[r][c];
            }
        }
        const float kv = warp_sum8_t(p, lane);
        const float delta = my_col ? (cv - kv) * beta : 0.0f;
#pragma unroll
        for (int c = 0; c < 8; c++) {
            const float dc = __shfl_sync(0xffffffffu, delta, 4 * c);
            p[c] = 0.0f;
#pragma unroll
            for (int r = 0; r < 4; r++) {
                st[r][c] += kn[r] * dc;
                p[c] += qn[r] * st[r][c];
            }
        }
        const float o = warp_sum8_t(p, lane);
        double oo = writer ? (double)o * o : 0.0;
        oo = warp_sum_d(oo);
        if (lane == 0) red[t & 1][w] = oo;
        __syncthreads();
        double tot = 0.0;
#pragma unroll
        for (int ww = 0; ww < 16; ww++) tot += red[t & 1][ww];
        const float inv = 1.0f / sqrtf((float)(tot / dv) + eps);
        if (writer) core[(size_t)t * nv * dv + (size_t)j * dv + my_d] = (o * inv) * nw[my_d] * siluf_(cz);
    }
    // Back through shared memory, as it came in.
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int rows = min(64, dk - 64 * half);  // <= 0: nothing to move
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            const int r = 2 * half + rr, i = r * 32 + lane;
#pragma unroll
            for (int c = 0; c < 8; c++)
                if (i < dk && c0 + c < dv) stage[i - 64 * half][c0 + c] = st[r][c];
        }
        __syncthreads();
        if ((tid & 127) < dv)
            for (int row = tid >> 7; row < rows; row += 4)
                s[(size_t)(64 * half + row) * dv + (tid & 127)] = stage[row][tid & 127];
    }
}

// Router of token blockIdx.x: softmax over E <= 32 RT_PER logits, top-K
// (ties to the lower id), optional renormalisation. One warp (32 threads):
// lane holds logits lane + 32 j in registers, so the K rounds of selection
// are shuffles, no block barriers.
//
// With `pub` set (page-locked host memory the device can write), block 0
// also publishes its K ids and K weights there, then, after a system-wide
// fence, `seq` at pub[2K]: the host polls that word instead of waiting for
// a device-to-host copy and an event.
#define RT_PER 32
extern "C" __global__ void router_topk(const float* __restrict__ logits, int E, int K, int renorm,
                                      int* __restrict__ ids, float* __restrict__ wts, u32* pub, u32 seq,
                                      const u64* __restrict__ addr, u64 off0, u64 off1, u64 off2,
                                      u64* __restrict__ bases) {
    PDL_START();
    __shared__ float wsel[64];
    __shared__ int isel[64];
    const float* lg = logits + (size_t)blockIdx.x * E;
    const int lane = threadIdx.x & 31;
    float p[RT_PER];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < RT_PER; j++) {
        const int e = lane + 32 * j;
        p[j] = e < E ? lg[e] : -INFINITY;
        m = fmaxf(m, p[j]);
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    double sum = 0.0;
#pragma unroll
    for (int j = 0; j < RT_PER; j++) {
        if (lane + 32 * j < E) {
            p[j] = expf(p[j] - m);
            sum += p[j];
        }
    }
    // An xor tree: every lane ends with the same sum.
    sum = warp_sum_d(sum);
    const float inv = (float)(1.0 / sum);
    // Probabilities, -2 past E and for ids already taken (below any).
#pragma unroll
    for (int j = 0; j < RT_PER; j++) p[j] = lane + 32 * j < E ? p[j] * inv : -2.0f;
    for (int k = 0; k < K; k++) {
        float bv = -1.0f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < RT_PER; j++) {
            const int e = lane + 32 * j;
            if (p[j] > bv || (p[j] == bv && e < bi)) {
                bv = p[j];
                bi = e;
            }
        }
        // Ties to the lower id: a total order, so every lane ends with
        // the same winner.
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            ids[(size_t)blockIdx.x * K + k] = bi;
            isel[k] = bi;
            wsel[k] = bv;
        }
#pragma unroll
        for (int j = 0; j < RT_PER; j++)
            if (lane + 32 * j == bi) p[j] = -2.0f;
    }
    __syncwarp();
    // Lane k writes rank k's weight and bases (the bases' loads of
    // addr[] overlap instead of following one another); the weights' sum
    // is taken in rank order by every lane, so the bits are one sum's.
    float s = 0.0f;
    for (int k = 0; k < K; k++) s += wsel[k];
    const size_t tk = (size_t)gridDim.x * K, r0 = (size_t)blockIdx.x * K;
    for (int k = lane; k < K; k += 32) {
        wts[r0 + k] = renorm ? wsel[k] / s : wsel[k];
        // Device routing: the experts' bases table from the expert -> VRAM
        // record table, in rank order: gate `[T, K]`, then up, then down
        // (T = tokens = gridDim.x). An id outside 0..E (NaN logits) reads
        // record 0 and stays visible in `ids` for the host to reject.
        if (addr) {
            const int i = isel[k];
            const u64 a = addr[(i >= 0 && i < E) ? i : 0];
            bases[r0 + k] = a + off0;
            bases[tk + r0 + k] = a + off1;
            bases[2 * tk + r0 + k] = a + off2;
        }
    }
    if (pub && blockIdx.x == 0 && lane == 0) {
        for (int k = 0; k < K; k++) {
            pub[k] = (u32)isel[k];
            pub[K + k] = __float_as_uint(renorm ? wsel[k] / s : wsel[k]);
        }
        __threadfence_system();
        *(volatile u32*)(pub + 2 * K) = seq;
    }
}

// Index of the largest of n values (ties to the lower index; NaN never
// wins, and n - 1 when all are NaN, as the engine's argmax), in two
// launches: argmax_part, block b over its contiguous chunk of the values,
// writes its best (value, index) to part[b] / part[ARGMAX_BLOCKS + b]
// (index 0x7fffffff: none but NaN); argmax_final (one block of
// ARGMAX_BLOCKS threads) combines them in the same order.
__device__ __forceinline__ void argmax_keep(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

__device__ void argmax_block(float& bv, int& bi) {
    __shared__ float rv[32];
    __shared__ int ri[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_keep(bv, bi, ov, oi);
    }
    if (lane == 0) {
        rv[wid] = bv;
        ri[wid] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < nw; w++) argmax_keep(bv, bi, rv[w], ri[w]);
}

extern "C" __global__ void argmax_part(const float* __restrict__ x, int n, float* __restrict__ part) {
    PDL_START();
    const int chunk = (n + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) argmax_keep(bv, bi, x[i], i);
    argmax_block(bv, bi);
    if (threadIdx.x == 0) {
        part[blockIdx.x] = bv;
        part[ARGMAX_BLOCKS + blockIdx.x] = __int_as_float(bi);
    }
}

extern "C" __global__ void argmax_final(const float* __restrict__ part, int n, int* __restrict__ out) {
    PDL_START();
    float bv = part[threadIdx.x];
    int bi = __float_as_int(part[ARGMAX_BLOCKS + threadIdx.x]);
    argmax_block(bv, bi);
    if (threadIdx.x == 0) *out = bi == 0x7fffffff ? n - 1 : bi;
}

// ---- Seeded draw (the reference: slipstream_kernels::sample) ----
// Gpu::sample launches, after the argmax (kept when no logit is finite):
// samp_init; samp_top; with top-k, four (samp_hist, samp_select) passes,
// one per 8-bit digit of the order key, then samp_tie; samp_weights; with
// top-p the same four passes over masses, then samp_tie; samp_part;
// samp_draw. Weights are u64 multiples of 2^-44 computed by a fixed
// sequence of IEEE operations, so every sum is an integer sum and the
// order of the atomics changes no bit: the token is the reference's.
// Mode m: 0 = the top-k cut (counts), 1 = the top-p cut (masses).
// SAMP_STATE_BYTES (the state buffer's size) comes from the host.
struct SampState {
    u64 top;         // max over finite logits of (key << 32 | ~id); 0: none
    u64 total;       // the top-k set's weights (before min-p)
    u64 kept;        // the same after min-p
    u64 need;        // count or mass still to reach inside the current prefix
    u32 finite;      // finite logits
    u32 prefix;      // key digits fixed so far
    u32 on[2];       // cut m applies
    u32 bkey[2];     // boundary key of cut m
    u32 bid[2];      // boundary id (0xffffffff: every tie at bkey kept)
    u32 tie_n[2];    // while non-zero: bid is the tie_n-th tie (by id) at bkey
    u32 hist_n[256]; // candidates per digit value
    u64 hist_w[256]; // their mass (top-p)
};
static_assert(sizeof(SampState) <= SAMP_STATE_BYTES, "SampState outgrew its buffer");

__device__ __forceinline__ u32 samp_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float samp_logit(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ bool samp_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}
__device__ __forceinline__ double samp_bits(u64 b) { return __longlong_as_double((long long)b); }

// e^x for x <= 0: exp_nonpositive's operations in its order (no
// contraction: every product and sum is an explicit round-to-nearest
// intrinsic or fma).
__device__ double samp_exp(double x) {
    if (isnan(x) || x < -40.0) return 0.0;
    const double k = rint(__dmul_rn(x, samp_bits(0x3ff71547652b82feull)));
    double r = fma(-k, samp_bits(0x3fe62e42fee00000ull), x);
    r = fma(-k, samp_bits(0x3dea39ef35793c76ull), r);
    const u64 inv_fact[12] = {0x3fe0000000000000ull, 0x3fc5555555555555ull, 0x3fa5555555555555ull,
                              0x3f81111111111111ull, 0x3f56c16c16c16c17ull, 0x3f2a01a01a01a01aull,
                              0x3efa01a01a01a01aull, 0x3ec71de3a556c734ull, 0x3e927e4fb7789f5cull,
                              0x3e5ae64567f544e4ull, 0x3e21eed8eff8d898ull, 0x3de6124613a86d09ull};
    double p = samp_bits(inv_fact[11]);
#pragma unroll
    for (int c = 10; c >= 0; c--) p = fma(p, r, samp_bits(inv_fact[c]));
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    return __dmul_rn(p, samp_bits((u64)(1023 + (int)k) << 52));
}

__device__ __forceinline__ u64 samp_goal(float top_p, u64 total) {
    const u64 g = __double2ull_rz(ceil(__dmul_rn((double)top_p, __ull2double_rn(total))));
    return g > 0 ? g : 1;
}

// Whether cut m applies (the same answer in every kernel of one draw).
__device__ __forceinline__ bool samp_active(const SampState* st, int m, u32 top_k, float top_p) {
    return m == 0 ? top_k > 0 && top_k < st->finite : top_p < 1.0f && st->kept >= samp_goal(top_p, st->total);
}

// Whether (key, id) is at or above cut m's boundary.
__device__ __forceinline__ bool samp_kept(const SampState* st, int m, u32 key, u32 id) {
    return !st->on[m] || key > st->bkey[m] || (key == st->bkey[m] && id <= st->bid[m]);
}

// Block-wide inclusive prefix sum (thread order) of u64; blockDim a
// multiple of 32 up to 1024. Ends with a barrier.
__device__ u64 samp_scan(u64 v) {
    __shared__ u64 warp_tot[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    if (lane == 31) warp_tot[wid] = v;
    __syncthreads();
    if (wid == 0) {
        u64 t = lane < nw ? warp_tot[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const u64 y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        if (lane < nw) warp_tot[lane] = t;
    }
    __syncthreads();
    if (wid > 0) v += warp_tot[wid - 1];
    __syncthreads();
    return v;
}

// Block sum (or maximum) of u64, valid in thread 0.
template <bool MAX>
__device__ u64 samp_reduce(u64 v) {
    __shared__ u64 part[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const u64 y = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? (y > v ? y : v) : v + y;
    }
    if (lane == 0) part[wid] = v;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < nw; w++) v = MAX ? (part[w] > v ? part[w] : v) : v + part[w];
    return v;
}

extern "C" __global__ void samp_init(SampState* st) {
    PDL_START();
    u32* w = (u32*)st;
    for (int i = threadIdx.x; i < (int)(sizeof(SampState) / 4); i += blockDim.x) w[i] = 0;
}

extern "C" __global__ void samp_top(const float* __restrict__ x, int n, SampState* st) {
    PDL_START();
    u64 best = 0, count = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = x[i];
        if (!samp_finite(v)) continue;
        const u64 c = ((u64)samp_key(v) << 32) | (u32)~(u32)i;
        best = c > best ? c : best;
        count++;
    }
    best = samp_reduce<true>(best);
    __syncthreads();
    count = samp_reduce<false>(count);
    if (threadIdx.x == 0) {
        if (best) atomicMax(&st->top, best);
        if (count) atomicAdd(&st->finite, (u32)count);
    }
}

// Candidates of cut m inside the digits fixed so far, counted (and, for
// top-p, weighed) by digit d (0: the key's top 8 bits).
extern "C" __global__ void samp_hist(const float* __restrict__ x, int n, const u64* __restrict__ wt,
                                     SampState* st, int m, int d, u32 top_k, float top_p) {
    __shared__ u32 hn[256];
    __shared__ u64 hw[256];
    PDL_START();
    if (!samp_active(st, m, top_k, top_p)) return;
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
        hn[b] = 0;
        hw[b] = 0;
    }
    __syncthreads();
    const u32 mask = d == 0 ? 0u : 0xffffffffu << (32 - 8 * d), prefix = st->prefix & mask;
    const int shift = 24 - 8 * d;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = x[i];
        if (!samp_finite(v)) continue;
        const u32 key = samp_key(v);
        if ((key & mask) != prefix) continue;
        const u64 w = m == 1 ? wt[i] : 0;
        if (m == 1 && w == 0) continue;
        const u32 dig = (key >> shift) & 255u;
        atomicAdd(&hn[dig], 1u);
        if (m == 1) atomicAdd(&hw[dig], w);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
        if (hn[b]) atomicAdd(&st->hist_n[b], hn[b]);
        if (hw[b]) atomicAdd(&st->hist_w[b], hw[b]);
    }
}

// One block of 256 threads: the digit value holding the crossing (the
// top_k-th candidate, or where the mass from the most likely reaches the
// goal), fixed into the prefix; after the last digit, the boundary key and
// which of its ties the boundary is. Clears the histogram.
extern "C" __global__ void samp_select(SampState* st, int m, int d, u32 top_k, float top_p) {
    PDL_START();
    if (!samp_active(st, m, top_k, top_p)) return;
    const int t = threadIdx.x, b = 255 - t;
    const u32 c = st->hist_n[b];
    const u64 v = m == 1 ? st->hist_w[b] : (u64)c;
    const u64 need = d == 0 ? (m == 1 ? samp_goal(top_p, st->total) : (u64)top_k) : st->need;
    const u32 prefix = d == 0 ? 0u : st->prefix;
    const u64 incl = samp_scan(v), excl = incl - v;
    if (v > 0 && excl < need && incl >= need) {
        const u64 rem = need - excl;
        const u32 p = prefix | ((u32)b << (24 - 8 * d));
        st->prefix = p;
        st->need = rem;
        if (d == 3) {
            const u64 n = m == 1 ? (rem + v / c - 1) / (v / c) : rem;
            st->on[m] = 1;
            st->bkey[m] = p;
            st->bid[m] = n == c ? 0xffffffffu : 0u;
            st->tie_n[m] = n == c ? 0u : (u32)n;
        }
    }
    st->hist_n[b] = 0;
    st->hist_w[b] = 0;
}

// One block of 1024 threads: when cut m's boundary falls inside a tie, the
// tie_n-th of the tied candidates in id order.
extern "C" __global__ void samp_tie(const float* __restrict__ x, int n, const u64* __restrict__ wt,
                                    SampState* st, int m) {
    PDL_START();
    if (!st->on[m] || st->tie_n[m] == 0) return;
    const u32 bkey = st->bkey[m], want = st->tie_n[m];
    const int chunk = (n + blockDim.x - 1) / blockDim.x;
    const int lo = min(n, (int)threadIdx.x * chunk), hi = min(n, lo + chunk);
    auto tied = [&](int i) {
        const float v = x[i];
        return samp_finite(v) && samp_key(v) == bkey && (m == 0 || wt[i] > 0);
    };
    u32 count = 0;
    for (int i = lo; i < hi; i++) count += tied(i);
    const u64 incl = samp_scan(count), excl = incl - count;
    if (excl < want && incl >= want) {
        u32 left = want - (u32)excl;
        for (int i = lo; i < hi; i++)
            if (tied(i) && --left == 0) {
                st->bid[m] = (u32)i;
                st->tie_n[m] = 0;
                break;
            }
    }
}

// Fixed-point weights of the top-k set with min-p applied into wt (0
// elsewhere), and the sums before and after min-p.
extern "C" __global__ void samp_weights(const float* __restrict__ x, int n, u64* __restrict__ wt,
                                        SampState* st, float temperature, float min_p) {
    PDL_START();
    const u64 top = st->top;
    const double max = (double)samp_logit((u32)(top >> 32)), temp = (double)temperature;
    const u32 top_id = ~(u32)top;
    u64 total = 0, kept = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = x[i];
        u64 wf = 0, wk = 0;
        if (samp_finite(v) && samp_kept(st, 0, samp_key(v), (u32)i)) {
            const double w = samp_exp(__ddiv_rn(__dsub_rn((double)v, max), temp));
            wf = __double2ull_rz(__dmul_rn(w, 17592186044416.0));
            wk = min_p > 0.0f && w < (double)min_p && (u32)i != top_id ? 0 : wf;
        }
        wt[i] = wk;
        total += wf;
        kept += wk;
    }
    total = samp_reduce<false>(total);
    __syncthreads();
    kept = samp_reduce<false>(kept);
    if (threadIdx.x == 0) {
        if (total) atomicAdd(&st->total, total);
        if (kept) atomicAdd(&st->kept, kept);
    }
}

__device__ __forceinline__ u64 samp_final_weight(const float* x, const u64* wt, const SampState* st, int i) {
    const u64 w = wt[i];
    return w && samp_kept(st, 1, samp_key(x[i]), (u32)i) ? w : 0;
}

// Block b: the kept mass of its contiguous chunk of ids into part[b].
extern "C" __global__ void samp_part(const float* __restrict__ x, int n, const u64* __restrict__ wt,
                                     const SampState* st, u64* __restrict__ part) {
    PDL_START();
    const int chunk = (n + gridDim.x - 1) / gridDim.x;
    const int lo = min(n, (int)blockIdx.x * chunk), hi = min(n, lo + chunk);
    u64 s = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) s += samp_final_weight(x, wt, st, i);
    s = samp_reduce<false>(s);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// One block, one thread per samp_part block: r = u * mass, then the id
// where the kept mass in id order passes r, into *out. No finite logit:
// *out keeps the argmax.
extern "C" __global__ void samp_draw(const float* __restrict__ x, int n, const u64* __restrict__ wt,
                                     const SampState* st, const u64* __restrict__ part, double u,
                                     int* __restrict__ out) {
    __shared__ u64 mass, left;
    __shared__ int chunk_of, found;
    PDL_START();
    if (st->top == 0) return;
    const int t = threadIdx.x;
    const u64 v = part[t];
    const u64 incl = samp_scan(v), excl = incl - v;
    if (t == blockDim.x - 1) mass = incl;
    __syncthreads();
    const u64 m = mass;
    u64 r = __double2ull_rz(__dmul_rn(u, __ull2double_rn(m)));
    r = r < m - 1 ? r : m - 1;
    if (v > 0 && excl <= r && r < incl) {
        chunk_of = t;
        left = r - excl;
        found = 0;
    }
    __syncthreads();
    const int chunk = (n + blockDim.x - 1) / blockDim.x;
    const int lo = min(n, chunk_of * chunk), hi = min(n, lo + chunk);
    for (int base = lo; base < hi; base += blockDim.x) {
        const int i = base + t;
        const u64 w = i < hi ? samp_final_weight(x, wt, st, i) : 0;
        const u64 wi = samp_scan(w), we = wi - w;
        const u64 l = left;
        if (w > 0 && we <= l && l < wi) {
            *out = i;
            found = 1;
        }
        __syncthreads();
        if (found) return;
        if (t == blockDim.x - 1) left = l - wi;
        __syncthreads();
    }
}

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
