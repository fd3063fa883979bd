// cuda_fp16.h for the CPU emulation (tests only): __half on GCC's _Float16, round to nearest even.
#pragma once
struct __half {
    _Float16 v;
};
struct alignas(4) __half2 {
    __half x, y;
};
inline float __half2float(__half h) { return (float)h.v; }
inline __half __float2half_rn(float f) { return __half{(_Float16)f}; }
inline float2 __half22float2(__half2 h) { return float2{(float)h.x.v, (float)h.y.v}; }
