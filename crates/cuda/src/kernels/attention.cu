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

