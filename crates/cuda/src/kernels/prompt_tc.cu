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

