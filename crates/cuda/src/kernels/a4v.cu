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

