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

