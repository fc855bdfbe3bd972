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

