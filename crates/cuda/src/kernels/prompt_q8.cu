// ---- The prompt in 8-bit integers (`--prompt-precision int8`; the exact
// tensor-core forms of prompt_tc.cu are the default). Each row of x is quantized per group of 64
// (q8_split: scale dx = the group's largest |x| / 127, codes rounded to
// nearest), and the 4-bit weight codes (0..15) enter an int8 mma
// (m16n8k32, s32 accumulate) unchanged, so a group adds
// s * dx * (codes . xq) + b * dx * sum(xq) with the weight group's scale s
// and bias b: exactly the dequantized weights against the quantized x.
// Each token is one output column of an mma and its sums run in the same
// order whatever the other columns hold, so a token's bits do
// not depend on the pass's length, the tokens beside it or the slot
// count; every prompt token runs these kernels (one-token passes too),
// never a generated one. The weights arrive as stored: no repack.

// d += A (16 x 32 s8) x B (32 x 8 s8), s32: a0/a2 row lane / 4 (k quarter
// lane % 4 of the low and high 16), a1/a3 row lane / 4 + 8; b0/b1 column
// lane / 4, the same k as a0/a2.
__device__ __forceinline__ void q8_mma(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if TC_ARCH
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// Byte of column j (0..63) within its group in the q8 layout: the 16
// bytes of column quarter j / 16 hold its columns (0, 2, 4, 6),
// (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15): the codes' low and high
// nibbles of the quarter's two code words, as q8_tile splits them.
__device__ __forceinline__ int q8_byte(int j) {
    const int w = j & 15;
    return (j >> 4) * 16 + ((w >> 3) * 2 + (w & 1)) * 4 + ((w & 7) >> 1);
}

// Rows x [n, cols] (cols % 64 == 0) quantized per group of 64: xq
// [n][cols / 64][64] int8 in the q8 layout; ds [n][cols / 64] the group's
// (scale dx, dx * sum of the codes). Grid
// (ceil(cols / 512), n), 256 threads: warp w takes group blockIdx.x * 8 +
// w of row blockIdx.y.
extern "C" __global__ void q8_split(const float* __restrict__ x, int cols, signed char* __restrict__ xq,
                                    float2* __restrict__ ds) {
    PDL_START();
    const int t = blockIdx.y, ng = cols >> 6;
    const int g = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (g >= ng) return;
    const float* xg = x + (size_t)t * cols + g * 64;
    const float v0 = xg[lane], v1 = xg[32 + lane];
    float m = fmaxf(fabsf(v0), fabsf(v1));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float inv = m > 0.0f ? 127.0f / m : 0.0f;
    signed char* q = xq + ((size_t)t * ng + g) * 64;
    const int q0 = max(-127, min(127, __float2int_rn(v0 * inv)));
    const int q1 = max(-127, min(127, __float2int_rn(v1 * inv)));
    q[q8_byte(lane)] = (signed char)q0;
    q[q8_byte(32 + lane)] = (signed char)q1;
    // The bias term takes the sum of the *quantized* x (as ggml's q8_1 `s`):
    // then a group's error is sum_j w_j e_j (centred weights), not
    // sum_j s c_j e_j (codes 0..15, all one sign): 2-3x less. Integer
    // partial sums (|sum| <= 8128) are exact in f32.
    const float qsum = warp_sum((float)(q0 + q1));
    const float dx = m / 127.0f;
    if (lane == 0) ds[(size_t)t * ng + g] = make_float2(dx, dx * qsum);
}

// n-tiles (8 columns each) one q8 warp computes at once.
#define Q8_TILES 8

// One warp's 16 rows against nt <= Q8_TILES n-tiles of q8 rows (xq, ds:
// q8_split's output over rows of ng groups). mma rows 0-7 are row `ra` of
// `wa` (this lane's row lane / 4), rows 8-15 row `rb` of `wb`. Tile j's
// B column lane / 4 is q8 row bq[j]; its output columns 2c and 2c + 1
// (c = lane % 4) are q8 rows o0[j] and o1[j], whose sums this lane adds
// into acc[j]: [0] row a x o0, [1] row a x o1, [2] row b x o0, [3] row b
// x o1. `wait` runs once, after the first group's weight loads are issued
// and before xq is read.
template <typename Wait>
__device__ __forceinline__ void q8_tile(const W& wa, int ra, const W& wb, int rb, int ng,
                                        const uint4* __restrict__ xq, const float2* __restrict__ ds,
                                        const int* bq, const int* o0, const int* o1, int nt, int lane,
                                        float (*acc)[4], Wait wait) {
    const int c = lane & 3;
    const TcRows r = tc_rows(wa, ra, wb, rb, c);
    const int bf = wa.scale_bf16;
    const u32 lo = 0x0F0F0F0Fu;
    uint2 qa = __ldg(r.ca), qb = __ldg(r.cb);
    u16 ssa = __ldg(r.sa), sba = __ldg(r.ba), ssb = __ldg(r.sb), sbb = __ldg(r.bb);
    wait();
    for (int g = 0; g < ng; g++) {
        // This group's codes as s8 (low nibbles, high nibbles), then the
        // next group's loads go out while this one computes.
        const u32 la = qa.x & lo, ha = (qa.x >> 4) & lo, lb = qb.x & lo, hb = (qb.x >> 4) & lo;
        const u32 lay = qa.y & lo, hay = (qa.y >> 4) & lo, lby = qb.y & lo, hby = (qb.y >> 4) & lo;
        const float sa = half_val(ssa, bf), ba = half_val(sba, bf);
        const float sb = half_val(ssb, bf), bb = half_val(sbb, bf);
        if (g + 1 < ng) {
            qa = __ldg(r.ca + (g + 1) * 4);
            qb = __ldg(r.cb + (g + 1) * 4);
            ssa = __ldg(r.sa + g + 1);
            sba = __ldg(r.ba + g + 1);
            ssb = __ldg(r.sb + g + 1);
            sbb = __ldg(r.bb + g + 1);
        }
#pragma unroll
        for (int j = 0; j < Q8_TILES; j++) {
            if (j >= nt) break;
            const uint4 xb = xq[((size_t)bq[j] * ng + g) * 4 + c];
            const float2 e0 = ds[(size_t)o0[j] * ng + g], e1 = ds[(size_t)o1[j] * ng + g];
            int d[4] = {0, 0, 0, 0};
            q8_mma(d, la, lb, ha, hb, xb.x, xb.y);
            q8_mma(d, lay, lby, hay, hby, xb.z, xb.w);
            acc[j][0] = fmaf(ba, e0.y, fmaf((float)d[0], sa * e0.x, acc[j][0]));
            acc[j][1] = fmaf(ba, e1.y, fmaf((float)d[1], sa * e1.x, acc[j][1]));
            acc[j][2] = fmaf(bb, e0.y, fmaf((float)d[2], sb * e0.x, acc[j][2]));
            acc[j][3] = fmaf(bb, e1.y, fmaf((float)d[3], sb * e1.x, acc[j][3]));
        }
    }
}

// The q8 rows of a warp's tiles over items [i0, i1) (Q8_TILES * 8 from
// i0): item k is q8 row row_of(k) (clamped to the last item, so every load
// is in bounds). Returns the live tiles.
template <typename RowOf>
__device__ __forceinline__ int q8_cols(int i0, int i1, int lane, int* bq, int* o0, int* o1, RowOf row_of) {
    const int c = lane & 3;
#pragma unroll
    for (int j = 0; j < Q8_TILES; j++) {
        const int k = i0 + 8 * j;
        bq[j] = row_of(min(k + (lane >> 2), i1 - 1));
        o0[j] = row_of(min(k + 2 * c, i1 - 1));
        o1[j] = row_of(min(k + 2 * c + 1, i1 - 1));
    }
    return min(Q8_TILES, (i1 - i0 + 7) >> 3);
}

// y[t, r] = W[r, :] . x[t, :] for n tokens quantized by q8_split (xq, ds).
// Grid (ceil(n / 64), ceil(rows / 128)), 256 threads: warp w takes rows
// blockIdx.y * 128 + 16 w + 0..15 over 64 tokens; the blocks of one row
// block (same weights) are adjacent in launch order.
extern "C" __global__ void __launch_bounds__(256) matvec_q8_t(W w, const uint4* __restrict__ xq,
                                                              const float2* __restrict__ ds,
                                                              float* __restrict__ y, int n) {
    PDL_TRIGGER();
    const int ng = w.cols >> 6, rows = w.rows;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = lane & 3;
    const int t0 = blockIdx.x * 64;
    const int ra_raw = blockIdx.y * 128 + warp * 16 + (lane >> 2);
    const int ra = min(ra_raw, rows - 1), rb = min(ra_raw + 8, rows - 1);
    int bq[Q8_TILES], o0[Q8_TILES], o1[Q8_TILES];
    const int nt = q8_cols(t0, n, lane, bq, o0, o1, [](int k) { return k; });
    float acc[Q8_TILES][4] = {};
    q8_tile(w, ra, w, rb, ng, xq, ds, bq, o0, o1, nt, lane, acc, []() { PDL_WAIT(); });
#pragma unroll
    for (int j = 0; j < Q8_TILES; j++) {
        if (j >= nt) break;
        const int t = t0 + 8 * j + 2 * c;
        for (int u = 0; u < 2; u++) {
            if (t + u >= n) break;
            if (ra_raw < rows) y[(size_t)(t + u) * rows + ra_raw] = acc[j][u];
            if (ra_raw + 8 < rows) y[(size_t)(t + u) * rows + ra_raw + 8] = acc[j][2 + u];
        }
    }
}

// Rows bx * 64 + 0..63 of one expert's gate (g) and up (u) over pairs
// [i0, i1), Q8_TILES * 8 at a time: pair k is pair_of(k), its x the q8 row
// xrow[pair]; h[pair, row] = silu(gate) * up. Warp w's mma rows are gate
// and up rows bx * 64 + 8 w + lane / 4.
template <typename PairOf>
__device__ __forceinline__ void q8_gate_up(const W& g, const W& u, int i0, int i1, const int* __restrict__ xrow,
                                           const uint4* __restrict__ xq, const float2* __restrict__ ds,
                                           float* __restrict__ h, PairOf pair_of) {
    const int ng = g.cols >> 6, I = g.rows;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = lane & 3;
    const int row_raw = blockIdx.x * 64 + warp * 8 + (lane >> 2);
    const int row = min(row_raw, I - 1);
    for (int i = i0; i < i1; i += Q8_TILES * 8) {
        int bq[Q8_TILES], o0[Q8_TILES], o1[Q8_TILES];
        const int nt = q8_cols(i, i1, lane, bq, o0, o1, [&](int k) { return xrow[pair_of(k)]; });
        float acc[Q8_TILES][4] = {};
        q8_tile(g, row, u, row, ng, xq, ds, bq, o0, o1, nt, lane, acc, []() {});
#pragma unroll
        for (int j = 0; j < Q8_TILES; j++) {
            if (j >= nt) break;
            for (int v = 0; v < 2; v++) {
                const int k = i + 8 * j + 2 * c + v;
                if (k < i1 && row_raw < I) h[(size_t)pair_of(k) * I + row_raw] = siluf_(acc[j][v]) * acc[j][2 + v];
            }
        }
    }
}

// Rows bx * 128 + 0..127 of one expert's down (d) over pairs [i0, i1):
// pair k is pair_of(k), its input the q8 row pair (h split by pair);
// v[pair, row] gets the dot products (moe_down_combine sums each token's
// ranks). Warp w's rows bx * 128 + 16 w + lane / 4 and + 8.
template <typename PairOf>
__device__ __forceinline__ void q8_down(const W& d, int i0, int i1, const uint4* __restrict__ hq,
                                        const float2* __restrict__ ds, float* __restrict__ v, PairOf pair_of) {
    const int ng = d.cols >> 6, H = d.rows;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = lane & 3;
    const int r0_raw = blockIdx.x * 128 + warp * 16 + (lane >> 2);
    const int r0 = min(r0_raw, H - 1), r1 = min(r0_raw + 8, H - 1);
    for (int i = i0; i < i1; i += Q8_TILES * 8) {
        int bq[Q8_TILES], o0[Q8_TILES], o1[Q8_TILES];
        const int nt = q8_cols(i, i1, lane, bq, o0, o1, pair_of);
        float acc[Q8_TILES][4] = {};
        q8_tile(d, r0, d, r1, ng, hq, ds, bq, o0, o1, nt, lane, acc, []() {});
#pragma unroll
        for (int j = 0; j < Q8_TILES; j++) {
            if (j >= nt) break;
            for (int w = 0; w < 2; w++) {
                const int k = i + 8 * j + 2 * c + w;
                if (k >= i1) break;
                const int p = pair_of(k);
                if (r0_raw < H) v[(size_t)p * H + r0_raw] = acc[j][w];
                if (r0_raw + 8 < H) v[(size_t)p * H + r0_raw + 8] = acc[j][2 + w];
            }
        }
    }
}

// Gate/up over pairs grouped by expert (group_pairs: goff, list; prefill
// with device routing): block (bx, e) runs rows bx of expert e's gate and
// up (the record at addr[e], parts at off0 / off1). Grid (ceil(I / 64), E),
// 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_q8_grouped(
    W gt, W ut, const u64* __restrict__ addr, u64 off0, u64 off1, const int* __restrict__ goff,
    const int* __restrict__ list, const int* __restrict__ xrow, const uint4* __restrict__ xq,
    const float2* __restrict__ ds, float* __restrict__ h) {
    PDL_EXPERTS_START();
    const int e = blockIdx.y;
    const int i0 = goff[e], i1 = goff[e + 1];
    if (i0 >= i1) return;
    const W g = at_base_a4(gt, (const u8*)(addr[e] + off0));
    const W u = at_base_a4(ut, (const u8*)(addr[e] + off1));
    q8_gate_up(g, u, i0, i1, xrow, xq, ds, h, [&](int k) { return list[k]; });
}

// Gate/up of each (token, expert) pair on its own (the bases tables of
// host routing, as moe_gate_up_tc): block (bx, p) runs rows bx of pair
// p's expert; each pair gets the bits of its grouped launch. Grid
// (ceil(I / 64), pairs), 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_q8_pairs(W gt, W ut, const u64* __restrict__ gbase,
                                                                       const u64* __restrict__ ubase,
                                                                       const int* __restrict__ xrow,
                                                                       const uint4* __restrict__ xq,
                                                                       const float2* __restrict__ ds,
                                                                       float* __restrict__ h) {
    PDL_EXPERTS_START();
    const int p = blockIdx.y;
    const W g = at_base_a4(gt, (const u8*)gbase[p]);
    const W u = at_base_a4(ut, (const u8*)ubase[p]);
    q8_gate_up(g, u, p, p + 1, xrow, xq, ds, h, [](int k) { return k; });
}

// Down projections over pairs grouped by expert: block (bx, e) runs 128
// rows of expert e's down (record at addr[e], part at off2) over its
// group's pairs, h split by pair (hq, ds). Grid (ceil(H / 128), E), 256
// threads.
extern "C" __global__ void __launch_bounds__(256) moe_down_q8_grouped(
    W dt, const u64* __restrict__ addr, u64 off2, const int* __restrict__ goff, const int* __restrict__ list,
    const uint4* __restrict__ hq, const float2* __restrict__ ds, float* __restrict__ v) {
    PDL_START();
    const int e = blockIdx.y;
    const int i0 = goff[e], i1 = goff[e + 1];
    if (i0 >= i1) return;
    const W d = at_base_a4(dt, (const u8*)(addr[e] + off2));
    q8_down(d, i0, i1, hq, ds, v, [&](int k) { return list[k]; });
}

// Down projection of each pair on its own (dbase[p], host routing): the
// bits of its grouped launch. Grid (ceil(H / 128), pairs), 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_down_q8_pairs(W dt, const u64* __restrict__ dbase,
                                                                    const uint4* __restrict__ hq,
                                                                    const float2* __restrict__ ds,
                                                                    float* __restrict__ v) {
    PDL_START();
    const int p = blockIdx.y;
    const W d = at_base_a4(dt, (const u8*)dbase[p]);
    q8_down(d, p, p + 1, hq, ds, v, [](int k) { return k; });
}
