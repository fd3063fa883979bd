// Linear attention (Gated DeltaNet, Qwen3.5 / Qwen3-Next): the short causal convolution and the
// gated delta rule over a step's segments, each sequence reading and writing its state slot.
//
// Layout (element offsets; T is float, __half or __nv_bfloat16):
//   x, y          [num_rows, channels]: row r at r * x_stride (x may be a slice of a wider row), y dense
//   weight        [channels, K] contiguous
//   conv_states   [num_slots, K - 1, channels] contiguous, T: a slot's last K-1 inputs, row K-2 newest
//   q, k          [num_rows, Hk, DK]: row r at r * q_stride (k_stride), heads dense
//   v             [num_rows, Hv, DV]: row r at r * v_stride, heads dense
//   g, beta       [num_rows, Hv] float32: row r at r * g_stride (beta_stride)
//   states        [num_slots, Hv, DK, DV] float32 contiguous (out = q S)
//   o             [num_rows, Hv, DV] contiguous
//   cu_seqlens    [num_seqs + 1] int64: sequence i's rows are [cu_seqlens[i], cu_seqlens[i + 1])
//   slots         [num_seqs] int64; fresh [num_seqs] bool (a zero state: the slot is not read)
//   save_rows, save_slots
//                 [num_saves] int64, rows ascending: after that row, its sequence's state is
//                 also written to that slot (a slot no sequence of the step reads)
//
// causal_conv_rows: grid (channel blocks of 128, row tiles of kConvRows); a thread is a channel and
// computes y = silu(round(sum_k window[k] * w[k])) for each row of its tile, reading the window
// from x and, before its sequence's first row, from the slot (or zeros). No state is written.
// causal_conv_states: grid (channel blocks, num_seqs), launched after: each thread reads its
// channel's old history, then writes the K-1 inputs up to each save row and up to the last row.
//
// gated_delta: grid (Hv, num_seqs), 128 threads; a CTA runs one value head of one sequence token
// by token, its state [DK, DV] in registers: thread t owns column t % DV, rows of group t / DV
// (DK / P rows each, P = 128 / DV groups). Per token: q and k of the head's key head in shared
// memory, their squares summed by warp shuffles; then S *= e^g, memory = k S (partials per
// group, summed in a fixed order), delta = beta (v - memory), S += k delta, o = q S. Every sum
// has one order, whatever the batch: a sequence's results do not depend on the others.
// The spec is inferd/kernels/linear_attention.py (causal_conv, gated_delta).
#include "common.cuh"

namespace inferd {
constexpr int kLinearThreads = 128;
constexpr int kLinearWarps = kLinearThreads / INFERD_WARP;
constexpr int kConvRows = 8;  // rows per CTA of causal_conv_rows

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// the sequence holding `row`: the last i with cu_seqlens[i] <= row
__device__ __forceinline__ int sequence_of(const long long* cu_seqlens, int num_seqs, long long row) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (cu_seqlens[mid] <= row) lo = mid; else hi = mid - 1;
    }
    return lo;
}
}  // namespace inferd

template <typename T, int K>
__global__ void __launch_bounds__(inferd::kLinearThreads) causal_conv_rows(
    const T* __restrict__ x,
    const long long x_stride,
    const T* __restrict__ weight,
    const T* __restrict__ conv_states,
    T* __restrict__ y,
    const long long* __restrict__ cu_seqlens,
    const long long* __restrict__ slots,
    const unsigned char* __restrict__ fresh,
    const int num_seqs,
    const int num_rows,
    const int channels)
{
    using namespace inferd;
    const int c = blockIdx.x * kLinearThreads + threadIdx.x;
    if (c >= channels) return;  // (no barriers in this kernel)
    float w[K];
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = to_float(weight[c * K + j]);
    const int first = blockIdx.y * kConvRows, last = min(first + kConvRows, num_rows);
    for (int r = first; r < last; ++r) {
        const int seq = sequence_of(cu_seqlens, num_seqs, r);
        const long long start = cu_seqlens[seq];
        const T* history = conv_states + slots[seq] * (K - 1) * channels;
        const bool zeros = fresh[seq] != 0;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const long long p = r - (K - 1) + j;  // position p < start: history row K-1 - (start - p)
            const float in = p >= start ? to_float(x[p * x_stride + c])
                             : zeros ? 0.0f : to_float(history[(K - 1 - (start - p)) * channels + c]);
            acc = j == 0 ? in * w[0] : acc + in * w[j];
        }
        // rounded to T before the SiLU, as transformers' conv1d output is
        y[(long long)r * channels + c] = from_float<T>(silu(to_float(from_float<T>(acc))));
    }
}

template <typename T, int K>
__global__ void __launch_bounds__(inferd::kLinearThreads) causal_conv_states(
    const T* __restrict__ x,
    const long long x_stride,
    T* __restrict__ conv_states,
    const long long* __restrict__ cu_seqlens,
    const long long* __restrict__ slots,
    const unsigned char* __restrict__ fresh,
    const long long* __restrict__ save_rows,
    const long long* __restrict__ save_slots,
    const int num_saves,
    const int channels)
{
    using namespace inferd;
    const int c = blockIdx.x * kLinearThreads + threadIdx.x;
    if (c >= channels) return;
    const int seq = blockIdx.y;
    const long long start = cu_seqlens[seq], end = cu_seqlens[seq + 1];
    T* history = conv_states + slots[seq] * (K - 1) * channels;
    T old[K - 1];  // read before anything is written: a short segment's window reaches into it
#pragma unroll
    for (int j = 0; j < K - 1; ++j) old[j] = fresh[seq] ? from_float<T>(0.0f) : history[j * channels + c];
    // the K-1 inputs up to `row` into `dst`
    auto write_window = [&](long long row, T* dst) {
#pragma unroll
        for (int j = 0; j < K - 1; ++j) {
            const long long p = row - (K - 2) + j;
            dst[j * channels + c] = p >= start ? x[p * x_stride + c] : old[K - 1 - (start - p)];
        }
    };
    for (int s = 0; s < num_saves; ++s) {
        const long long row = save_rows[s];
        if (row >= start && row < end) write_window(row, conv_states + save_slots[s] * (K - 1) * channels);
    }
    write_window(end - 1, history);
}

template <typename T, int DK, int DV>
__global__ void __launch_bounds__(inferd::kLinearThreads) gated_delta(
    T* __restrict__ o,
    float* __restrict__ states,
    const T* __restrict__ q,
    const T* __restrict__ k,
    const T* __restrict__ v,
    const float* __restrict__ g,
    const float* __restrict__ beta,
    const long long q_stride,
    const long long k_stride,
    const long long v_stride,
    const long long g_stride,
    const long long beta_stride,
    const int num_key_heads,
    const long long* __restrict__ cu_seqlens,
    const long long* __restrict__ slots,
    const unsigned char* __restrict__ fresh,
    const long long* __restrict__ save_rows,
    const long long* __restrict__ save_slots,
    const int num_saves)
{
    using namespace inferd;
    static_assert(kLinearThreads % DV == 0, "DV divides the CTA");
    constexpr int GROUPS = kLinearThreads / DV;  // row groups
    static_assert(DK % GROUPS == 0, "DK splits over the row groups");
    constexpr int ROWS = DK / GROUPS;  // state rows per thread

    __shared__ float qs[DK];
    __shared__ float ks[DK];
    __shared__ float squares[2][kLinearWarps];
    __shared__ float partial[GROUPS][DV];

    const int tid = threadIdx.x, lane = tid % INFERD_WARP, warp = tid / INFERD_WARP;
    const int col = tid % DV, group = tid / DV, row0 = group * ROWS;
    const int head = blockIdx.x, num_heads = gridDim.x, seq = blockIdx.y;
    const int key_head = head / (num_heads / num_key_heads);
    const long long start = cu_seqlens[seq], end = cu_seqlens[seq + 1];
    const long long state_size = (long long)DK * DV;
    float* own = states + (slots[seq] * num_heads + head) * state_size;
    const float scale = 1.0f / sqrtf((float)DK);

    float s[ROWS];  // S[row0 + i][col]
#pragma unroll
    for (int i = 0; i < ROWS; ++i) s[i] = fresh[seq] ? 0.0f : own[(row0 + i) * DV + col];
    // the first save at or after this sequence's start
    int save = 0;
    while (save < num_saves && save_rows[save] < start) ++save;

    for (long long t = start; t < end; ++t) {
        // q and k of the key head, and their squared norms
        float sq = 0.0f, sk = 0.0f;
        for (int i = tid; i < DK; i += kLinearThreads) {
            const float a = to_float(q[t * q_stride + key_head * DK + i]);
            const float b = to_float(k[t * k_stride + key_head * DK + i]);
            qs[i] = a;
            ks[i] = b;
            sq += a * a;
            sk += b * b;
        }
        sq = group_sum<INFERD_WARP>(sq);
        sk = group_sum<INFERD_WARP>(sk);
        if (lane == 0) {
            squares[0][warp] = sq;
            squares[1][warp] = sk;
        }
        __syncthreads();
        float total_q = 0.0f, total_k = 0.0f;
#pragma unroll
        for (int w = 0; w < kLinearWarps; ++w) {
            total_q += squares[0][w];
            total_k += squares[1][w];
        }
        const float inv_q = 1.0f / sqrtf(total_q + 1e-6f), inv_k = 1.0f / sqrtf(total_k + 1e-6f);
        const float decay = expf(g[t * g_stride + head]);
        // decay, then what the state predicts for k (this group's rows)
        float memory = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            s[i] *= decay;
            memory += s[i] * (ks[row0 + i] * inv_k);
        }
        partial[group][col] = memory;
        __syncthreads();
        memory = 0.0f;
#pragma unroll
        for (int p = 0; p < GROUPS; ++p) memory += partial[p][col];
        const float delta = (to_float(v[t * v_stride + head * DV + col]) - memory) * beta[t * beta_stride + head];
        float out = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            s[i] += (ks[row0 + i] * inv_k) * delta;
            out += s[i] * (qs[row0 + i] * inv_q * scale);
        }
        __syncthreads();  // every group has read `partial`
        partial[group][col] = out;
        __syncthreads();
        if (group == 0) {
            out = 0.0f;
#pragma unroll
            for (int p = 0; p < GROUPS; ++p) out += partial[p][col];
            o[(t * num_heads + head) * DV + col] = from_float<T>(out);
        }
        for (; save < num_saves && save_rows[save] == t; ++save) {
            float* dst = states + (save_slots[save] * num_heads + head) * state_size;
#pragma unroll
            for (int i = 0; i < ROWS; ++i) dst[(row0 + i) * DV + col] = s[i];
        }
    }
#pragma unroll
    for (int i = 0; i < ROWS; ++i) own[(row0 + i) * DV + col] = s[i];
}
