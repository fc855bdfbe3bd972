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

