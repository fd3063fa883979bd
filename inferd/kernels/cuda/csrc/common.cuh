// Shared by every kernel of inferd: float conversions and vector loads for the three cache dtypes
// (float, __half, __nv_bfloat16), and warp reductions. Header-only; NVRTC sees it through -I.
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
