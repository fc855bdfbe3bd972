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

