// cuda_fp8.h for the CPU emulation (tests only): __nv_cvt_float_to_fp8 in plain C++, float ->
// float8_e4m3fn / float8_e5m2 rounded to nearest even (ties to the even code), __NV_SATFINITE
// clamping to the largest finite value, NaN -> the NaN code 0x7f (as CUDA's header does).
#pragma once
typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t saturate,
                                                __nv_fp8_interpretation_t interpretation) {
    const int mantissa = interpretation == __NV_E4M3 ? 3 : 2;
    const int bias = interpretation == __NV_E4M3 ? 7 : 15;
    const unsigned largest = interpretation == __NV_E4M3 ? 0x7eu : 0x7bu;  // 448, 57344
    const unsigned overflow = interpretation == __NV_E4M3 ? 0x7fu : 0x7cu;  // NaN, infinity
    uint32_t bits;
    memcpy(&bits, &x, 4);
    const unsigned sign = (bits >> 24) & 0x80u;
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7f;  // NaN
    const double a = fabs((double)x);
    if (a == 0.0) return (__nv_fp8_storage_t)sign;
    // a in [2**k, 2**(k+1)); below the smallest normal binade (1 - bias) the spacing stays that
    // binade's. With the spacing q of a's binade, n = a / q rounded to nearest even (exact: q is a
    // power of two), and the code ((binade + bias - 1) << mantissa) + n: a carry of n into the
    // next binade, or out of the subnormals, is the next code.
    int k;
    frexp(a, &k);
    const int binade = std::max(k - 1, 1 - bias);
    if (binade + bias > 31) return (__nv_fp8_storage_t)(sign | (saturate == __NV_SATFINITE ? largest : overflow));
    const double n = nearbyint(ldexp(a, mantissa - binade));
    unsigned code = (unsigned)((binade + bias - 1) << mantissa) + (unsigned)n;
    if (code > largest) code = saturate == __NV_SATFINITE ? largest : overflow;
    return (__nv_fp8_storage_t)(sign | code);
}
