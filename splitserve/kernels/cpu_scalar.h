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

// float8_e4m3fn KV codes (engine/kv_cache.py): 1 sign, 4 exponent (bias 7), 3 mantissa bits;
// no infinity, 0x7f / 0xff are NaN, 448 the largest value. Read with integer moves and
// selects, no table and no branch, so a row's loop vectorises (a 256-entry table was a
// gather per element: decode attention over an fp8 cache ran 4.9x slower than over float32);
// written as torch's cast writes them: round to nearest even, saturating at +-448 (infinity
// too), NaN kept NaN.
struct Fp8 { uint8_t bits; };

inline float load(Fp8 x) {
    const uint32_t mag = x.bits & 0x7fu;
    // a normal code: its exponent and mantissa shifted into float32's, the bias moved 7 -> 127
    const float normal = __builtin_bit_cast(float, (mag << 20) + (120u << 23));
    const float subnormal = float(mag) * (1.f / 512.f);  // exponent 0: mag * 2^-9 (mag < 8)
    float v = mag < 8 ? subnormal : normal;
    v = mag == 0x7f ? __builtin_nanf("") : v;
    return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, v) | (uint32_t(x.bits & 0x80u) << 24));
}
inline void store(Fp8* dst, float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
    const uint32_t mag = bits & 0x7fffffffu;
    if (mag > 0x7f800000u) { dst->bits = sign | 0x7f; return; }   // NaN
    if (mag >= 0x43e00000u) { dst->bits = sign | 0x7e; return; }  // >= 448 (and infinity): saturate
    if (mag < 0x3c800000u) {  // below 2^-6: a subnormal code m * 2^-9, m = round(|x| * 512), up to 8 = 2^-6
        float scaled;
        const uint32_t a = mag;
        std::memcpy(&scaled, &a, 4);
        dst->bits = sign | uint8_t(__builtin_nearbyintf(scaled * 512.f));
        return;
    }
    const uint32_t rounded = (mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20;  // keep 3 mantissa bits, to even
    dst->bits = sign | uint8_t(rounded - (120u << 3));  // rebias the exponent: 127 -> 7
}

// x as storage type T would hold it: what torch's op-by-op bfloat16 arithmetic rounds to.
template <typename T>
inline float rounded(float x) {
    T t;
    store(&t, x);
    return load(t);
}

// e^r for |r| <= ln2 / 2, Cephes' expf polynomial; T is float or a vector of floats
// (cpu_vec.h's vexp_nonpositive runs it on kLanes at once).
template <typename T>
inline T exp_polynomial(T r) {
    T p = T{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.f;
}

// exp(x), Cephes' expf polynomial: within 2 ulp of std::exp, and, unlike the libm call, the
// compiler vectorises the loop around it (scalar expf was a quarter of the decode attention's
// time). Clamped to [-87.3, 88]: ~1e-38 instead of 0 below, ~1.6e38 instead of inf above.
inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.f ? 88.f : x);
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);  // x = n ln2 + r, |r| <= ln2 / 2
    const float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    const float p = exp_polynomial(r);
    const int32_t bits = (int32_t(n) + 127) << 23;  // 2^n, -126 <= n <= 127
    return p * __builtin_bit_cast(float, bits);
}

}  // namespace splitserve
