// reshape_and_cache: writes the K and V of a step's new tokens into their slots of the paged cache.
//
// Layout (element offsets; T is float, __half or __nv_bfloat16):
//   key, value          [num_tokens, num_kv_heads, head_dim]: token t, head h, dim d at
//                       t * key_stride + h * head_dim + d  (a row may be a slice of the fused
//                       qkv projection, hence its own stride; heads and dims are contiguous)
//   key_cache, value_cache
//                       [num_blocks, block_size, num_kv_heads, head_dim], contiguous: slot s
//                       (= block * block_size + offset in block) starts at s * num_kv_heads * head_dim
//   slot_mapping        [num_tokens] int64: the slot of each token; negative = skip (the padding
//                       rows of a captured batch)
//
// Grid: one CTA per token; threads stride over the num_kv_heads * head_dim elements of its row.
// The spec is inferd.kernels.reference.write_kv.
#include "common.cuh"
#include <cuda_fp8.h>  // __nv_cvt_float_to_fp8 (on sm_89 and later, one cvt.rn.satfinite instruction)

template <typename T>
__global__ void reshape_and_cache(
    const T* __restrict__ key,
    const T* __restrict__ value,
    T* __restrict__ key_cache,
    T* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping,
    const long long key_stride,
    const long long value_stride,
    const int row_elems)  // num_kv_heads * head_dim
{
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;
    const T* k = key + token * key_stride;
    const T* v = value + token * value_stride;
    T* kc = key_cache + slot * row_elems;
    T* vc = value_cache + slot * row_elems;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        kc[i] = k[i];
        vc[i] = v[i];
    }
}

// reshape_and_cache_fp8: the same into an 8-bit cache (KV = kKvE4M3 or kKvE5M2; the spec:
// inferd.kernels.kv_quant.write). Each (token, KV head) row of K and of V gets its exponent e
// (row_exponent) and its codes x * 2**-e rounded to nearest even; no code can overflow (the row's
// largest element lands at most on the format's largest value), so __NV_SATFINITE never acts.
//   key_cache, value_cache   [num_blocks, block_size, num_kv_heads, head_dim] 8-bit codes
//   key_exps, value_exps     [num_blocks, block_size, num_kv_heads] int8: slot s, head h at
//                            s * num_kv_heads + h
// Grid: one CTA per token; its warps take the rows (K of head 0, V of head 0, K of head 1, ...) in
// turn, the lanes of a warp striding over the row's head_dim elements.

namespace inferd {
// The least e with max|x| <= 2**e * 0.875 * 2**B (the format's largest value; B = 9 for e4m3, 16
// for e5m2), without a division, from max|x|'s bits `top`: max|x| = m * 2**k with m in [0.5, 1)
// (frexp: k = biased exponent - 126, m > 0.875 iff the mantissa bits exceed 0.75 * 2**23),
// e = k - B, or k - B + 1 when m > 0.875; clamped to [-127, 127]. A zero row, and one whose largest
// |x| is subnormal (k <= -126), gets -127.
template <int KV>
__device__ __forceinline__ int row_exponent(unsigned top) {
    constexpr int B = KV == kKvE4M3 ? 9 : 16;
    const int biased = (int)(top >> 23);
    if (biased == 0) return -127;
    return max(-127, min(127, biased - 126 - B + ((top & 0x7fffffu) > 0x600000u ? 1 : 0)));
}

// x * 2**-e, exactly, for e in [-127, 120], where it is at least 2**-126 (below, it may come out as
// zero of x's sign: an 8-bit code rounds it to that anyway). A subnormal x never meets a float
// operation (-ftz=true would flush it): its mantissa, an integer, is scaled instead.
__device__ __forceinline__ float scaled(float x, int e) {
    const unsigned bits = __float_as_uint(x);
    if (bits & 0x7f800000u) return x * exp2i(-e);
    // 0 or subnormal: mantissa * 2**(-149 - e); when that factor is under 2**-126, so is the result
    // (the mantissa is under 2**23): 2**-126 stands in for it
    const float magnitude = (float)(bits & 0x7fffffu) * exp2i(max(-149 - e, -126));
    return __int_as_float(__float_as_int(magnitude) | (int)(bits & 0x80000000u));
}
}  // namespace inferd

template <typename T, int KV>
__global__ void reshape_and_cache_fp8(
    const T* __restrict__ key,
    const T* __restrict__ value,
    unsigned char* __restrict__ key_cache,
    unsigned char* __restrict__ value_cache,
    signed char* __restrict__ key_exps,
    signed char* __restrict__ value_exps,
    const long long* __restrict__ slot_mapping,
    const long long key_stride,
    const long long value_stride,
    const int num_kv_heads,
    const int head_dim)
{
    using namespace inferd;
    static_assert(KV == kKvE4M3 || KV == kKvE5M2, "an 8-bit format");
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;
    const int warp = threadIdx.x / INFERD_WARP;
    const int lane = threadIdx.x % INFERD_WARP;
    for (int r = warp; r < 2 * num_kv_heads; r += blockDim.x / INFERD_WARP) {  // (warp-uniform: shuffles)
        const bool is_key = r % 2 == 0;
        const int head = r / 2;
        const T* x = (is_key ? key + token * key_stride : value + token * value_stride) + (long long)head * head_dim;
        // max|x| as bits, which order as the magnitudes do (no float operation: subnormals count)
        unsigned top = 0;
        for (int d = lane; d < head_dim; d += INFERD_WARP) {
            top = max(top, __float_as_uint(to_float(x[d])) & 0x7fffffffu);
        }
#pragma unroll
        for (int offset = INFERD_WARP / 2; offset > 0; offset /= 2) {
            top = max(top, __shfl_xor_sync(0xffffffffu, top, offset));
        }
        const int e = row_exponent<KV>(top);  // <= 120 for finite x
        const long long row = slot * num_kv_heads + head;
        unsigned char* codes = (is_key ? key_cache : value_cache) + row * head_dim;
        for (int d = lane; d < head_dim; d += INFERD_WARP) {
            codes[d] = __nv_cvt_float_to_fp8(scaled(to_float(x[d]), e), __NV_SATFINITE,
                                             KV == kKvE4M3 ? __NV_E4M3 : __NV_E5M2);
        }
        if (lane == 0) (is_key ? key_exps : value_exps)[row] = (signed char)e;
    }
}
