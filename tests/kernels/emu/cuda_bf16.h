// cuda_bf16.h for the CPU emulation (tests only): the top 16 bits of a float, round to nearest even.
#pragma once
struct __nv_bfloat16 {
    uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline float __bfloat162float(__nv_bfloat16 b) {
    const uint32_t u = uint32_t(b.bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{uint16_t(u >> 16)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 b) { return float2{__bfloat162float(b.x), __bfloat162float(b.y)}; }
