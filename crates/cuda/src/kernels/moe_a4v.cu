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

