// Router of token blockIdx.x: softmax over E <= 32 RT_PER logits, top-K
// (ties to the lower id), optional renormalisation. One warp (32 threads):
// lane holds logits lane + 32 j in registers, so the K rounds of selection
// are shuffles, no block barriers.
//
// With `pub` set (page-locked host memory the device can write), block 0
// also publishes its K ids and K weights there, then, after a system-wide
// fence, `seq` at pub[2K]: the host polls that word instead of waiting for
// a device-to-host copy and an event.
#define RT_PER 32
extern "C" __global__ void router_topk(const float* __restrict__ logits, int E, int K, int renorm,
                                      int* __restrict__ ids, float* __restrict__ wts, u32* pub, u32 seq,
                                      const u64* __restrict__ addr, u64 off0, u64 off1, u64 off2,
                                      u64* __restrict__ bases) {
    PDL_START();
    __shared__ float wsel[64];
    __shared__ int isel[64];
    const float* lg = logits + (size_t)blockIdx.x * E;
    const int lane = threadIdx.x & 31;
    float p[RT_PER];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < RT_PER; j++) {
        const int e = lane + 32 * j;
        p[j] = e < E ? lg[e] : -INFINITY;
        m = fmaxf(m, p[j]);
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    double sum = 0.0;
#pragma unroll
    for (int j = 0; j < RT_PER; j++) {
        if (lane + 32 * j < E) {
            p[j] = expf(p[j] - m);
            sum += p[j];
        }
    }
    // An xor tree: every lane ends with the same sum.
    sum = warp_sum_d(sum);
    const float inv = (float)(1.0 / sum);
    // Probabilities, -2 past E and for ids already taken (below any).
#pragma unroll
    for (int j = 0; j < RT_PER; j++) p[j] = lane + 32 * j < E ? p[j] * inv : -2.0f;
    for (int k = 0; k < K; k++) {
        float bv = -1.0f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < RT_PER; j++) {
            const int e = lane + 32 * j;
            if (p[j] > bv || (p[j] == bv && e < bi)) {
                bv = p[j];
                bi = e;
            }
        }
        // Ties to the lower id: a total order, so every lane ends with
        // the same winner.
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            ids[(size_t)blockIdx.x * K + k] = bi;
            isel[k] = bi;
            wsel[k] = bv;
        }
#pragma unroll
        for (int j = 0; j < RT_PER; j++)
            if (lane + 32 * j == bi) p[j] = -2.0f;
    }
    __syncwarp();
    // Lane k writes rank k's weight and bases (the bases' loads of
    // addr[] overlap instead of following one another); the weights' sum
    // is taken in rank order by every lane, so the bits are one sum's.
    float s = 0.0f;
    for (int k = 0; k < K; k++) s += wsel[k];
    const size_t tk = (size_t)gridDim.x * K, r0 = (size_t)blockIdx.x * K;
    for (int k = lane; k < K; k += 32) {
        wts[r0 + k] = renorm ? wsel[k] / s : wsel[k];
        // Device routing: the experts' bases table from the expert -> VRAM
        // record table, in rank order: gate `[T, K]`, then up, then down
        // (T = tokens = gridDim.x). An id outside 0..E (NaN logits) reads
        // record 0 and stays visible in `ids` for the host to reject.
        if (addr) {
            const int i = isel[k];
            const u64 a = addr[(i >= 0 && i < E) ? i : 0];
            bases[r0 + k] = a + off0;
            bases[tk + r0 + k] = a + off1;
            bases[2 * tk + r0 + k] = a + off2;
        }
    }
    if (pub && blockIdx.x == 0 && lane == 0) {
        for (int k = 0; k < K; k++) {
            pub[k] = (u32)isel[k];
            pub[K + k] = __float_as_uint(renorm ? wsel[k] / s : wsel[k]);
        }
        __threadfence_system();
        *(volatile u32*)(pub + 2 * K) = seq;
    }
}

