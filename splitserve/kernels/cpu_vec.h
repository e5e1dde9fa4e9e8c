// Vector values for the native CPU kernels: kLanes floats as one value (GCC and clang vector
// extensions, lowered to AVX-512, AVX2 or NEON by -march), and what the attention kernels do
// with them. Header-only, beside cpu_scalar.h; cpu_native.py compiles every kernel with it.
#pragma once
#include <cstdint>

#include "cpu_scalar.h"

namespace splitserve {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // one zmm register
#else
constexpr int kLanes = 8;   // AVX2's ymm (NEON splits it in two)
#endif

// kLanes floats as one value: GCC keeps arrays of these in vector registers, which plain
// float arrays indexed in loops were not: their every update went through memory, and the
// stores capped the tile at a third of the core's multiply-add rate.
typedef float Vec __attribute__((vector_size(kLanes * 4)));
typedef float VecUnaligned __attribute__((vector_size(kLanes * 4), aligned(4), may_alias));

inline Vec vload(const float* p) { return *reinterpret_cast<const VecUnaligned*>(p); }
inline void vstore(float* p, Vec v) { *reinterpret_cast<VecUnaligned*>(p) = v; }
typedef int32_t IVec __attribute__((vector_size(kLanes * 4)));

// exp(x) for x <= 0 (a score minus its row's maximum), kLanes at once: exp_approx's
// polynomial (cpu_scalar.h), with no upper clamp (x <= 0 here) and the integer part taken by
// one truncating conversion of a value made positive (floor(y) = int(y + 128) - 128 for
// y > -128) instead of a floor, a compare and a second conversion: the exps were 15% of the
// kernel. (Not the add-and-subtract-2^23 rounding trick: -fassociative-math folds it away.)
// Within 2 ulp of std::exp like exp_approx, not always its bits.
__attribute__((target("prefer-vector-width=512")))
inline Vec vexp_nonpositive(Vec x) {
    x = x < -87.3f ? Vec{} - 87.3f : x;
    const IVec whole = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, IVec) - 128;  // round(x / ln2)
    const Vec n = __builtin_convertvector(whole, Vec);
    const Vec r = x - n * 0.693359375f - n * -2.12194440e-4f;
    const Vec p = exp_polynomial(r);
    const IVec bits = (whole + 127) << 23;  // 2^n
    return p * reinterpret_cast<const Vec&>(bits);
}

// The largest and the sum of v's lanes (the compiler reduces these fixed-length loops in a tree).
inline float hmax(Vec v) {
    float m = v[0];
    for (int i = 1; i < kLanes; i++) m = v[i] > m ? v[i] : m;
    return m;
}

inline float hsum(Vec v) {
    float sum = 0.f;
    for (int i = 0; i < kLanes; i++) sum += v[i];
    return sum;
}

}  // namespace splitserve
