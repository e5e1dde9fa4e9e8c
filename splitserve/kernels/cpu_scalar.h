// Scalar helpers the native CPU kernels share: bfloat16 storage, and an exp the compiler can
// vectorise. Header-only; cpu_native.py compiles every kernel source with it.
#pragma once
#include <cstdint>
#include <cstring>

namespace splitserve {

struct Bf16 { uint16_t bits; };

inline float load(float x) { return x; }
inline float load(Bf16 x) {
    uint32_t bits = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(Bf16* dst, float x) {  // round to nearest even, as torch's float -> bfloat16
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { dst->bits = uint16_t((bits >> 16) | 0x40); return; }  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    dst->bits = uint16_t(bits >> 16);
}

// x as storage type T would hold it: what torch's op-by-op bfloat16 arithmetic rounds to.
template <typename T>
inline float rounded(float x) {
    T t;
    store(&t, x);
    return load(t);
}

// exp(x), Cephes' expf polynomial: within 2 ulp of std::exp, and, unlike the libm call, the
// compiler vectorises the loop around it (scalar expf was a quarter of the decode attention's
// time). Clamped to [-87.3, 88]: ~1e-38 instead of 0 below, ~1.6e38 instead of inf above.
inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.f ? 88.f : x);
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);  // x = n ln2 + r, |r| <= ln2 / 2
    const float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = (int32_t(n) + 127) << 23;  // 2^n, -126 <= n <= 127
    return p * __builtin_bit_cast(float, bits);
}

}  // namespace splitserve
