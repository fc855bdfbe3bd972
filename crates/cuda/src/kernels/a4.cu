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

