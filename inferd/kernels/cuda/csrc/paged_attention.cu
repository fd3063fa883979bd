// Paged-attention decode: one new query token per sequence against its whole cached context.
//
// Layout (element offsets; T is float, __half or __nv_bfloat16; every tensor contiguous):
//   query         [num_seqs, num_heads, HEAD_DIM]
//   key_cache     [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]: context position p of a
//   value_cache   sequence lives in block block_tables[seq][p / BLOCK_SIZE], row p % BLOCK_SIZE;
//                 of T (KV = kKvPlain), or 8-bit codes (kKvE4M3, kKvE5M2: common.cuh)
//   key_exps      [num_blocks, BLOCK_SIZE, num_kv_heads] int8: an 8-bit cache's row exponents
//   value_exps    (value = float(code) * 2**exponent); null for a plain cache
//   block_tables  [num_seqs, max_blocks] int32
//   seq_lens      [num_seqs] int32: context length, the new token included (its K/V are already
//                 in the cache); 0 marks a padding row, whose output is zeros
//   out           [num_seqs, num_heads, HEAD_DIM]
//   part_out      [num_seqs, num_heads, num_partitions, HEAD_DIM] float32  (split variant only)
//   part_max, part_sum
//                 [num_seqs, num_heads, num_partitions] float32           (split variant only)
//   sinks         [num_heads] float32, or null                            (gpt-oss's attention sinks)
// Query head h reads KV head h / GROUP (grouped-query attention). A sliding-window layer
// (window > 0) sees only the last `window` positions of the context; softcap > 0 maps each score
// s to tanh(s / softcap) * softcap (Gemma 2). A sink (gpt-oss) is one more logit per head that
// has no value: it joins the softmax's max and denominator once, when the output is normalized
// (the single pass's last step, or paged_decode_reduce's combine; never per partition).
//
// Grid: (num_kv_heads, num_seqs, num_partitions), 128 threads. A CTA serves the GROUP query heads
// of one KV head, so every K and V row is read from memory once for all of them. It walks its
// partition of the context in tiles of 4 blocks (one per warp) with an online softmax:
//   1. q.k: lanes in groups of HEAD_DIM / 8 (16-bit types) load a K row in 16-byte vectors (8-byte
//      ones of 8 codes for an 8-bit cache, widened exactly; the row's scale, a power of two, then
//      multiplies its dot product), each group one token at a time; the scores go to shared memory;
//   2. the running max and sum per head are updated, scores become exp(score - max);
//   3. p.v: each thread owns a vector of a V row (an 8-bit row's scale goes into its softmax
//      weights) and accumulates GROUP partial outputs in registers, rescaled when the running max
//      grows.
// With num_partitions == 1 the CTA covers the whole context and writes `out`. Otherwise
// (flash-decoding, for long contexts and few sequences) partition z covers positions
// [z * partition_size, (z + 1) * partition_size) and writes its normalized output, max and sum;
// paged_decode_reduce then combines the partitions. partition_size is a multiple of BLOCK_SIZE.
// The spec is inferd.kernels.reference.decode_attention.
#include "common.cuh"

namespace inferd {
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * INFERD_WARP;
}  // namespace inferd

template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GROUP, int KV>
__global__ void __launch_bounds__(inferd::kDecodeThreads) paged_decode(
    T* __restrict__ out,
    float* __restrict__ part_out,
    float* __restrict__ part_max,
    float* __restrict__ part_sum,
    const T* __restrict__ query,
    const typename inferd::KvCache<T, KV>::type* __restrict__ key_cache,
    const typename inferd::KvCache<T, KV>::type* __restrict__ value_cache,
    const signed char* __restrict__ key_exps,
    const signed char* __restrict__ value_exps,
    const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens,
    const int max_blocks,
    const float scale,
    const int partition_size,
    const int window,
    const float softcap,
    const float* __restrict__ sinks)
{
    using namespace inferd;
    using C = typename KvCache<T, KV>::type;                  // a cache element
    constexpr int VEC = KvCache<T, KV>::VEC;                  // cache elements per vector load
    static_assert(HEAD_DIM % VEC == 0, "head size must fill whole vectors");
    constexpr int VECS = HEAD_DIM / VEC;                      // vectors per K or V row
    constexpr int K_LANES = VECS < INFERD_WARP ? VECS : INFERD_WARP;  // lanes sharing one K row
    constexpr int K_VECS = VECS / K_LANES;                    // vectors per lane per K row
    constexpr int K_TOKENS = INFERD_WARP / K_LANES;           // tokens a warp scores at once
    static_assert(BLOCK_SIZE % K_TOKENS == 0, "a block must split evenly into a warp's passes");
    constexpr int TILE = kDecodeWarps * BLOCK_SIZE;           // tokens per tile: one block per warp
    constexpr int V_LANES = VECS;                             // threads sharing one V row
    static_assert(kDecodeThreads % V_LANES == 0, "head size too large for one CTA");
    constexpr int V_ROWS = kDecodeThreads / V_LANES;          // V rows read at once
    // p.v partials are combined by shuffles inside a warp, then warp by warp in shared memory
    constexpr int PARTIALS = V_LANES < INFERD_WARP ? kDecodeWarps : V_ROWS;

    const int kv_head = blockIdx.x;
    const int seq = blockIdx.y;
    const int part = blockIdx.z;
    const int num_kv_heads = gridDim.x;
    const int num_partitions = gridDim.z;
    const int num_heads = num_kv_heads * GROUP;
    const int tid = threadIdx.x;
    const int warp = tid / INFERD_WARP;
    const int lane = tid % INFERD_WARP;
    const int ctx = seq_lens[seq];
    const int start = part * partition_size;

    if (ctx <= 0 && num_partitions == 1) {  // a padding row
        T* o = out + ((long long)seq * num_heads + kv_head * GROUP) * HEAD_DIM;
        for (int i = tid; i < GROUP * HEAD_DIM; i += kDecodeThreads) o[i] = from_float<T>(0.f);
        return;
    }
    if (start >= ctx) return;  // past this sequence's context: the reduce step never reads it
    const int end = min(start + partition_size, ctx);
    const int first = window > 0 ? max(0, ctx - window) : 0;  // the first position the query sees
    if (end <= first) {  // (split variant) a partition wholly before the window: weighs nothing
        for (int i = tid; i < GROUP * HEAD_DIM; i += kDecodeThreads) {
            const long long p = ((long long)seq * num_heads + kv_head * GROUP + i / HEAD_DIM) * num_partitions + part;
            part_out[p * HEAD_DIM + i % HEAD_DIM] = 0.f;
            if (i % HEAD_DIM == 0) {
                part_max[p] = INFERD_NEG_INF;
                part_sum[p] = 0.f;
            }
        }
        return;
    }

    __shared__ float scores[GROUP][TILE];
    __shared__ int tile_blocks[kDecodeWarps];
    __shared__ float run_max[GROUP];
    __shared__ float run_sum[GROUP];
    __shared__ float rescale[GROUP];
    __shared__ float combined[GROUP][HEAD_DIM];

    // this lane's slice of each query head, pre-scaled: vectors k_sub, k_sub + K_LANES, ...
    const int k_sub = lane % K_LANES;
    float q[GROUP][K_VECS][VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const T* qp = query + ((long long)seq * num_heads + kv_head * GROUP + g) * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < K_VECS; ++i) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) q[g][i][e] = to_float(qp[(k_sub + i * K_LANES) * VEC + e]) * scale;
        }
    }
    if (tid < GROUP) {
        run_max[tid] = INFERD_NEG_INF;
        run_sum[tid] = 0.f;
    }

    const long long slot_elems = (long long)num_kv_heads * HEAD_DIM;  // one cache slot, all KV heads
    const int* table = block_tables + (long long)seq * max_blocks;
    const int v_row = tid / V_LANES;
    const int v_col = (tid % V_LANES) * VEC;
    float acc[GROUP][VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][e] = 0.f;
    }
    __syncthreads();

    // from the tile that holds `first` (tiles stay block-aligned; positions before it are masked)
    for (int tile_start = start + max(0, first - start) / TILE * TILE; tile_start < end; tile_start += TILE) {
        // 1. scores of this warp's block
        const int block_index = tile_start / BLOCK_SIZE + warp;
        const int block_first = block_index * BLOCK_SIZE;
        const int block = block_first < end ? table[block_index] : 0;
        if (lane == 0) tile_blocks[warp] = block;
        const C* k_block = key_cache + (long long)block * BLOCK_SIZE * slot_elems + kv_head * HEAD_DIM;
#pragma unroll
        for (int pass = 0; pass < BLOCK_SIZE / K_TOKENS; ++pass) {
            const int row = pass * K_TOKENS + lane / K_LANES;
            const bool valid = block_first + row < end && block_first + row >= first;
            float dot[GROUP];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) dot[g] = 0.f;
            if (valid) {
                const C* kp = k_block + row * slot_elems;
#pragma unroll
                for (int i = 0; i < K_VECS; ++i) {
                    float k[VEC];
                    load_kv<KV>(kp + (k_sub + i * K_LANES) * VEC, k);
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) dot[g] += q[g][i][e] * k[e];
                    }
                }
                if constexpr (KV != kKvPlain) {  // the row's scale, a power of 2, once on its dot product
                    const long long k_row = ((long long)block * BLOCK_SIZE + row) * num_kv_heads + kv_head;
                    const float k_scale = row_scale<KV>(key_exps, k_row);
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) dot[g] *= k_scale;
                }
            }
#pragma unroll
            for (int g = 0; g < GROUP; ++g) dot[g] = group_sum<K_LANES>(dot[g]);
            if (softcap > 0.f) {
#pragma unroll
                for (int g = 0; g < GROUP; ++g) dot[g] = tanhf(dot[g] / softcap) * softcap;
            }
            if (k_sub == 0) {
#pragma unroll
                for (int g = 0; g < GROUP; ++g) scores[g][warp * BLOCK_SIZE + row] = valid ? dot[g] : INFERD_NEG_INF;
            }
        }
        __syncthreads();

        // 2. online softmax, one warp per head (a tile always holds a valid token)
        for (int g = warp; g < GROUP; g += kDecodeWarps) {
            float m = INFERD_NEG_INF;
            for (int i = lane; i < TILE; i += INFERD_WARP) m = fmaxf(m, scores[g][i]);
            m = group_max<INFERD_WARP>(m);
            const float old_max = run_max[g];
            const float new_max = fmaxf(old_max, m);
            float s = 0.f;
            for (int i = lane; i < TILE; i += INFERD_WARP) {
                const float p = expf(scores[g][i] - new_max);  // exp(-inf) = 0 past the end
                scores[g][i] = p;
                s += p;
            }
            s = group_sum<INFERD_WARP>(s);
            if (lane == 0) {
                const float a = expf(old_max - new_max);  // 0 on the first tile
                rescale[g] = a;
                run_sum[g] = run_sum[g] * a + s;
                run_max[g] = new_max;
            }
        }
        __syncthreads();

        // 3. p.v
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float a = rescale[g];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][e] *= a;
        }
        const int tile_len = min(TILE, end - tile_start);
#pragma unroll 4
        for (int i = v_row; i < tile_len; i += V_ROWS) {
            const long long slot = (long long)tile_blocks[i / BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE;
            float v[VEC];
            load_kv<KV>(value_cache + slot * slot_elems + kv_head * HEAD_DIM + v_col, v);
            const float v_scale = row_scale<KV>(value_exps, slot * num_kv_heads + kv_head);  // (1: plain)
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float p = scores[g][i] * v_scale;  // the row's scale, in its weight
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][e] += p * v[e];
            }
        }
        __syncthreads();  // the next tile overwrites scores and tile_blocks
    }

    // combine the partial outputs of the V rows: first inside each warp ...
    int partial = v_row;
    bool holds = true;
    if (V_LANES < INFERD_WARP) {
#pragma unroll
        for (int offset = V_LANES; offset < INFERD_WARP; offset *= 2) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], offset);
            }
        }
        partial = warp;
        holds = lane < V_LANES;
    }
    // ... then one partial after another, in a fixed order (deterministic sums)
    for (int p = 0; p < PARTIALS; ++p) {
        if (partial == p && holds) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) combined[g][v_col + e] = (p == 0 ? 0.f : combined[g][v_col + e]) + acc[g][e];
            }
        }
        __syncthreads();
    }

    for (int i = tid; i < GROUP * HEAD_DIM; i += kDecodeThreads) {
        const int g = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        const int head = kv_head * GROUP + g;
        float value = combined[g][d] / run_sum[g];
        if (num_partitions == 1) {
            if (sinks != nullptr) {  // sum and values rescaled to the max of the scores and the sink
                const float top = fmaxf(run_max[g], sinks[head]);
                const float a = expf(run_max[g] - top);
                value = combined[g][d] * a / (run_sum[g] * a + expf(sinks[head] - top));
            }
            out[((long long)seq * num_heads + head) * HEAD_DIM + d] = from_float<T>(value);
        } else {
            const long long p = ((long long)seq * num_heads + head) * num_partitions + part;
            part_out[p * HEAD_DIM + d] = value;
            if (d == 0) {
                part_max[p] = run_max[g];
                part_sum[p] = run_sum[g];
            }
        }
    }
}

// Combines the partitions of the split variant: partition z's output weighs
// part_sum[z] * exp(part_max[z] - max over z and the sink); the sink (if any) adds
// exp(sink - max) to the denominator alone. Grid: (num_heads, num_seqs), 128 threads.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(inferd::kDecodeThreads) paged_decode_reduce(
    T* __restrict__ out,
    const float* __restrict__ part_out,
    const float* __restrict__ part_max,
    const float* __restrict__ part_sum,
    const int* __restrict__ seq_lens,
    const int num_partitions,
    const int partition_size,
    const float* __restrict__ sinks)
{
    using namespace inferd;
    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const int num_heads = gridDim.x;
    const int tid = threadIdx.x;
    const int warp = tid / INFERD_WARP;
    const int lane = tid % INFERD_WARP;
    const int ctx = seq_lens[seq];
    T* o = out + ((long long)seq * num_heads + head) * HEAD_DIM;
    if (ctx <= 0) {  // a padding row
        for (int d = tid; d < HEAD_DIM; d += kDecodeThreads) o[d] = from_float<T>(0.f);
        return;
    }
    const int used = min(num_partitions, (ctx + partition_size - 1) / partition_size);
    const long long base = ((long long)seq * num_heads + head) * num_partitions;

    __shared__ float warp_values[kDecodeWarps];
    __shared__ float global_max;
    __shared__ float total;

    float m = INFERD_NEG_INF;
    for (int p = tid; p < used; p += kDecodeThreads) m = fmaxf(m, part_max[base + p]);
    m = group_max<INFERD_WARP>(m);
    if (lane == 0) warp_values[warp] = m;
    __syncthreads();
    if (tid == 0) {
        float all = warp_values[0];
        for (int w = 1; w < kDecodeWarps; ++w) all = fmaxf(all, warp_values[w]);
        global_max = sinks != nullptr ? fmaxf(all, sinks[head]) : all;
    }
    __syncthreads();
    const float top = global_max;

    float s = 0.f;
    for (int p = tid; p < used; p += kDecodeThreads) s += part_sum[base + p] * expf(part_max[base + p] - top);
    s = group_sum<INFERD_WARP>(s);
    __syncthreads();  // everyone has read warp_values
    if (lane == 0) warp_values[warp] = s;
    __syncthreads();
    if (tid == 0) {
        float all = 0.f;
        for (int w = 0; w < kDecodeWarps; ++w) all += warp_values[w];
        total = sinks != nullptr ? all + expf(sinks[head] - top) : all;
    }
    __syncthreads();
    const float inv_total = 1.f / total;

    for (int d = tid; d < HEAD_DIM; d += kDecodeThreads) {
        float value = 0.f;
        for (int p = 0; p < used; ++p) {
            const float weight = part_sum[base + p] * expf(part_max[base + p] - top);
            value += weight * part_out[(base + p) * HEAD_DIM + d];
        }
        o[d] = from_float<T>(value * inv_total);
    }
}
