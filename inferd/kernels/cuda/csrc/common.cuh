// Shared by every kernel of inferd: float conversions and vector loads for the three cache dtypes
// (float, __half, __nv_bfloat16) and the two 8-bit KV formats, and warp reductions. Header-only;
// NVRTC sees it through -I.
//
// NVRTC compiles without the host headers: nothing from <cmath> or <cfloat> (no INFINITY,
// no FLT_MAX), so the constants we need are spelled out here.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define INFERD_NEG_INF __int_as_float(0xff800000)
#define INFERD_WARP 32

// The tests' CPU emulation of these kernels (tests/kernels/emu) defines this to check the
// alignment of vector loads, which a GPU would fault on; on a GPU it is nothing.
#ifndef INFERD_CHECK_ALIGNED
#define INFERD_CHECK_ALIGNED(p, bytes)
#endif

namespace inferd {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Elements of T in one 16-byte load.
template <typename T> struct Vec16 { static constexpr int N = 16 / sizeof(T); };

// Loads 16 aligned bytes (Vec16<T>::N elements) and widens them to float.
template <typename T>
__device__ __forceinline__ void load16(const T* __restrict__ p, float* f);

template <>
__device__ __forceinline__ void load16<float>(const float* __restrict__ p, float* f) {
    INFERD_CHECK_ALIGNED(p, 16);
    const float4 v = *reinterpret_cast<const float4*>(p);
    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
}

template <>
__device__ __forceinline__ void load16<__half>(const __half* __restrict__ p, float* f) {
    INFERD_CHECK_ALIGNED(p, 16);
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 two = __half22float2(h[i]);
        f[2 * i] = two.x; f[2 * i + 1] = two.y;
    }
}

template <>
__device__ __forceinline__ void load16<__nv_bfloat16>(const __nv_bfloat16* __restrict__ p, float* f) {
    INFERD_CHECK_ALIGNED(p, 16);
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 two = __bfloat1622float2(h[i]);
        f[2 * i] = two.x; f[2 * i + 1] = two.y;
    }
}

// ------------------------------------------------------------------------------ 8-bit KV
// A paged KV cache holds the model's dtype T (kKvPlain), or 8-bit codes with one exponent per
// (token, KV head) row: value = float(code) * 2**exponent (the spec: inferd/kernels/kv_quant.py).
constexpr int kKvPlain = 0;
constexpr int kKvE4M3 = 1;  // float8_e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, largest 448
constexpr int kKvE5M2 = 2;  // float8_e5m2: 5 exponent bits (bias 15), 2 mantissa bits, largest 57344

// A cache's element type and elements per vector load. 8-bit codes load 8 at a time (8 bytes), as
// many as a 16-bit cache's 16-byte load: the same lanes per row and registers per thread.
template <typename T, int KV> struct KvCache {
    using type = unsigned char;
    static constexpr int VEC = 8;
};
template <typename T> struct KvCache<T, kKvPlain> {
    using type = T;
    static constexpr int VEC = Vec16<T>::N;
};

// NOTE: CuPy compiles every kernel with -ftz=true: float operations flush subnormal inputs and
// results to zero (of their sign). So the 8-bit paths never let a subnormal float carry a value
// they need: the write scales subnormal inputs as integers (reshape_and_cache.cu), and the decode
// widens codes through __half, whose conversion to float (inline PTX, cvt.f32.f16) is exact for
// every half, subnormal ones included.

// 2**e as a float, exactly, for e in [-126, 127].
__device__ __forceinline__ float exp2i(int e) { return __int_as_float((e + 127) << 23); }

// The power of two between an 8-bit code's value and the half its bits make (load_kv): e4m3 codes
// read as halves are their value * 2**-8 (4 exponent bits of bias 7 in a half's 5 of bias 15,
// subnormals onto subnormals); e5m2 codes are a half's top byte, their value itself.
template <int KV> struct Fp8AsHalf { static constexpr int SHIFT = KV == kKvE4M3 ? 8 : 0; };

// The scale of cache row `row` (slot * num_kv_heads + head), 2**(exponent + SHIFT): what load_kv's
// widened elements are multiplied by (per row: decode scales a K row's dot product and a V row's
// softmax weight with it) to give float(code) * 2**exponent. 1 for a plain cache (whose `exps` is
// null and never read). Exact for every exponent a finite input gives but two, whose scale no
// float holds: e4m3's 120 (max|x| above 0.875 * 2**128) reads as half its value, e5m2's -127
// (max|x| under 2**-111) as twice (the clamp keeps them finite: rows nothing real produces).
template <int KV>
__device__ __forceinline__ float row_scale(const signed char* __restrict__ exps, long long row) {
    if constexpr (KV == kKvPlain) {
        return 1.f;
    } else {
        return exp2i(max(-126, min(127, exps[row] + Fp8AsHalf<KV>::SHIFT)));
    }
}

// Loads KvCache<T, KV>::VEC elements of a cache row, widened to float, exactly: a plain cache's
// (load16), or 8 codes as halves (their value * 2**-SHIFT: row_scale restores it), two at a time:
// byte_perm moves two codes into the top bytes of a half2's lanes, which is an e5m2 half; e4m3's
// exponent and mantissa bits move down one place under the sign.
template <int KV, typename C>
__device__ __forceinline__ void load_kv(const C* __restrict__ p, float* f) {
    if constexpr (KV == kKvPlain) {
        load16(p, f);
    } else {
        INFERD_CHECK_ALIGNED(p, 8);
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        unsigned pairs[4] = {__byte_perm(raw.x, 0u, 0x1404u), __byte_perm(raw.x, 0u, 0x3424u),
                             __byte_perm(raw.y, 0u, 0x1404u), __byte_perm(raw.y, 0u, 0x3424u)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if constexpr (KV == kKvE4M3) pairs[i] = (pairs[i] & 0x80008000u) | ((pairs[i] >> 1) & 0x3f803f80u);
            const float2 two = __half22float2(*reinterpret_cast<const __half2*>(&pairs[i]));
            f[2 * i] = two.x;
            f[2 * i + 1] = two.y;
        }
    }
}

// Sum / max over the WIDTH lanes of an aligned group of a warp (WIDTH a power of two <= 32);
// every lane of the group gets the result. All 32 lanes must call it.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int offset = WIDTH / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

template <int WIDTH>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int offset = WIDTH / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

}  // namespace inferd
