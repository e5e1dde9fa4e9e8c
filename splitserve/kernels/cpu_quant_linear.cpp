// Weight-only quantized linear layers on CPU (issue 31): y = x @ dequantize(w).T for the
// QuantizedWeight layout of splitserve/kernels/quant_weight.py,
//     w[n, k] = code[n, k] * scale[n, k / group] + offset[n, k / group].
// Built with the other kernels into one library by cpu_native.py; called by quant_native.py.
//
// One entry point, splitserve_quant_gemv, for every number of rows of x: each weight row's codes
// are read once per block of x rows, dequantised in registers 16 at a time and multiplied into
// up to 8 rows of x held against 1 or 2 weight rows (the accumulators fill the registers). For
// decode (a few rows) this is where weight-only quantization pays: a step reads 1/8 (4 bits) to
// 1/4 (8 bits) of the float32 weight bytes. For prefill, dequantising tiles into torch's GEMM
// (MKL) was built and measured slower at every M from 16 to 4,096 on this project's AVX-512
// machine (bench/results/quant_linear_cpu_tiled_path.json), so it was removed.
//
// The gemv walks K in chunks of 16 codes. Byte codes (bits 5..8, fp8) are 16 consecutive
// columns; packed 4-bit codes are 8 bytes whose low nibbles (the even columns) come first and
// high nibbles (the odd columns) second (on AVX-512 with groups a multiple of 32: 16 bytes,
// 32 columns; see gemv_rows_nibbles32), and x's columns are copied once per call into that
// order. Groups are a multiple of 16 columns, so a chunk never straddles two. FP8 e4m3 codes
// become float16 bit patterns ((b & 0x7f) << 7, the sign on top), worth 2^-8 of the code,
// which the hardware converts exactly (subnormals included); the 2^8 goes into the scale.
// FP4 (E2M1: MXFP4 / NVFP4, bits 1) codes are packed like the 4-bit ones; each nibble becomes
// the e4m3 byte of the same value (one pshufb) and then as FP8, or, on AVX-512 with groups a
// multiple of 32, is looked up among the group's 16 values e2m1 * scale (gemv_rows_nibbles32).
// Sums are float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kFp8 = 0;
constexpr int kFp4 = 1;  // E2M1 nibbles (quant_weight.FP4)
// E2M1 nibble -> the float8_e4m3fn byte of the same value: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then negated
alignas(16) constexpr uint8_t kE2m1Fp8[16] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C,
                                              0x80, 0xB0, 0xB8, 0xBC, 0xC0, 0xC4, 0xC8, 0xCC};
constexpr bool packed_nibbles(int bits) { return bits == 4 || bits == kFp4; }
constexpr int kMaxRows = 8;  // rows of x per pass over a weight row: accumulators held in registers
#if defined(__AVX512F__)
constexpr int kWeightRows = 2;  // weight rows per pass of the gemv: 2 x 8 accumulators of the 32 registers
#else
constexpr int kWeightRows = 1;  // AVX2's 16 registers hold 8 two-register accumulators, no more
#endif


#if defined(__AVX512F__)
// 16 float lanes: one register.
struct Vec {
    __m512 v;
    static Vec zero() { return {_mm512_setzero_ps()}; }
    static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
    static Vec set1(float s) { return {_mm512_set1_ps(s)}; }
    static Vec from_bytes(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
    static Vec from_halves(__m256i h) { return {_mm512_cvtph_ps(h)}; }
    float sum() const { return _mm512_reduce_add_ps(v); }
};
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
#elif defined(__AVX2__)
// 16 float lanes: two registers.
struct Vec {
    __m256 a, b;
    static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
    static Vec set1(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
    static Vec from_bytes(__m128i x) {
        return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(x, 8)))};
    }
    static Vec from_halves(__m256i h) {
        return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
    }
    float sum() const {
        __m256 s = _mm256_add_ps(a, b);
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        q = _mm_add_ss(q, _mm_movehdup_ps(q));
        return _mm_cvtss_f32(q);
    }
};
inline Vec fma(Vec x, Vec y, Vec z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// 16 e4m3 bytes -> floats worth 2^-8 of their values (see the top).
inline Vec fp8_bytes(__m128i bytes) {
    const __m256i b = _mm256_cvtepu8_epi16(bytes);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
    return Vec::from_halves(_mm256_or_si256(sign, rest));
}

// 16 codes of chunk c of a weight row, as floats in the chunk's lane order (see the top).
template <int BITS>
inline Vec codes16(const uint8_t* row, int c) {
    if constexpr (packed_nibbles(BITS)) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c));
        const __m128i mask = _mm_set1_epi8(0x0f);
        const __m128i low = _mm_and_si128(b, mask), high = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m128i nibbles = _mm_unpacklo_epi64(low, high);
        if constexpr (BITS == kFp4)
            return fp8_bytes(_mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2m1Fp8)), nibbles));
        return Vec::from_bytes(nibbles);
    } else if constexpr (BITS == kFp8) {
        return fp8_bytes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
    } else {
        return Vec::from_bytes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
    }
}

// out[m, n] for rows m < R of x and weight rows [n_first, n_end), NR weight rows at a time so
// each load of x feeds NR multiply-adds: accumulators in registers (NR * R of them).
template <int BITS, int R, int NR>
void gemv_rows(const float* x, int K, const uint8_t* codes, const float* scales, const float* offsets, int group,
               const float* bias, float* out, int N, int n_first, int n_end) {
    const int64_t row_bytes = packed_nibbles(BITS) ? K / 2 : K;
    const int groups = K / group, chunks_per_group = group / 16;
    const float scale_factor = BITS == kFp8 || BITS == kFp4 ? 256.f : 1.f;  // fp8 codes arrive as 2^-8 of their value
    int n = n_first;
    for (; n + NR <= n_end; n += NR) {
        Vec acc[NR][R];
        for (int i = 0; i < NR; i++)
            for (int r = 0; r < R; r++) acc[i][r] = Vec::zero();
        for (int g = 0; g < groups; g++) {
            Vec s[NR], o[NR];
            for (int i = 0; i < NR; i++) {
                const int64_t at = int64_t(n + i) * groups + g;
                s[i] = Vec::set1(scales[at] * scale_factor);
                o[i] = Vec::set1(offsets ? offsets[at] : 0.f);
            }
            for (int c = g * chunks_per_group; c < (g + 1) * chunks_per_group; c++) {
                Vec w[NR];
                for (int i = 0; i < NR; i++) w[i] = fma(codes16<BITS>(codes + (n + i) * row_bytes, c), s[i], o[i]);
                for (int r = 0; r < R; r++) {
                    const Vec xv = Vec::load(x + int64_t(r) * K + 16 * c);
                    for (int i = 0; i < NR; i++) acc[i][r] = fma(w[i], xv, acc[i][r]);
                }
            }
        }
        for (int i = 0; i < NR; i++) {
            const float b = bias ? bias[n + i] : 0.f;
            for (int r = 0; r < R; r++) out[int64_t(r) * N + n + i] = acc[i][r].sum() + b;
        }
    }
    if constexpr (NR > 1) {
        if (n < n_end) gemv_rows<BITS, R, 1>(x, K, codes, scales, offsets, group, bias, out, N, n, n_end);
    }
}

#if defined(__AVX512F__)
// 4-bit codes on AVX-512 with groups a multiple of 32: 16 bytes (32 codes) at a time, each
// nibble looked up among the group's 16 dequantised values (one vpermps) instead of widened,
// converted and scaled: 6 instructions per 32 codes instead of 16, which is most of a decode
// step's work at M = 1. The chunk is 32 columns: the 16 even ones, then the 16 odd ones.
// FP4: the 16 values are e2m1 * scale (no offset), each rounded once as the other paths.
template <int R, int NR, bool FP4>
void gemv_rows_nibbles32(const float* x, int K, const uint8_t* codes, const float* scales, const float* offsets,
                         int group, const float* bias, float* out, int N, int n_first, int n_end) {
    const int64_t row_bytes = K / 2;
    const int groups = K / group, chunks_per_group = group / 32;
    const __m512 iota = FP4 ? _mm512_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f,
                                             -3.f, -4.f, -6.f)
                            : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i low_nibble = _mm512_set1_epi32(15);
    int n = n_first;
    for (; n + NR <= n_end; n += NR) {
        __m512 acc[NR][R];
        for (int i = 0; i < NR; i++)
            for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
        for (int g = 0; g < groups; g++) {
            __m512 table[NR];  // code -> code * scale + offset, rounded once as the other paths
            for (int i = 0; i < NR; i++) {
                const int64_t at = int64_t(n + i) * groups + g;
                table[i] = FP4 ? _mm512_mul_ps(iota, _mm512_set1_ps(scales[at]))
                               : _mm512_fmadd_ps(iota, _mm512_set1_ps(scales[at]),
                                                 _mm512_set1_ps(offsets ? offsets[at] : 0.f));
            }
            for (int c = g * chunks_per_group; c < (g + 1) * chunks_per_group; c++) {
                __m512i b[NR];
                __m512 w[NR];
                for (int i = 0; i < NR; i++) {
                    b[i] = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (n + i) * row_bytes + 16 * c)));
                    w[i] = _mm512_permutexvar_ps(_mm512_and_si512(b[i], low_nibble), table[i]);  // even columns
                }
                for (int r = 0; r < R; r++) {
                    const __m512 xv = _mm512_loadu_ps(x + int64_t(r) * K + 32 * c);
                    for (int i = 0; i < NR; i++) acc[i][r] = _mm512_fmadd_ps(w[i], xv, acc[i][r]);
                }
                for (int i = 0; i < NR; i++) w[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(b[i], 4), table[i]);  // odd
                for (int r = 0; r < R; r++) {
                    const __m512 xv = _mm512_loadu_ps(x + int64_t(r) * K + 32 * c + 16);
                    for (int i = 0; i < NR; i++) acc[i][r] = _mm512_fmadd_ps(w[i], xv, acc[i][r]);
                }
            }
        }
        for (int i = 0; i < NR; i++) {
            const float b = bias ? bias[n + i] : 0.f;
            for (int r = 0; r < R; r++) out[int64_t(r) * N + n + i] = _mm512_reduce_add_ps(acc[i][r]) + b;
        }
    }
    if constexpr (NR > 1) {
        if (n < n_end) gemv_rows_nibbles32<R, 1, FP4>(x, K, codes, scales, offsets, group, bias, out, N, n, n_end);
    }
}
#endif

#else
// Portable: one code at a time (other CPUs; the compiler vectorises what it can).
// The 256 float values of fp8 e4m3fn codes (the scalar paths).
struct Fp8Table {
    float v[256];
    Fp8Table() {
        for (int b = 0; b < 256; b++) {
            const int e = (b >> 3) & 15, m = b & 7;
            float f = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
            if ((b & 0x7f) == 0x7f) f = NAN;
            v[b] = (b & 0x80) ? -f : f;
        }
    }
};
const Fp8Table kFp8Table;
template <int BITS>
inline float code_at(const uint8_t* row, int k) {  // k in the chunk lane order (see the top)
    if constexpr (packed_nibbles(BITS)) {
        const int c = k / 16, lane = k % 16;
        const uint8_t b = row[8 * c + lane % 8];
        const int nibble = lane < 8 ? b & 15 : b >> 4;
        return BITS == kFp4 ? kFp8Table.v[kE2m1Fp8[nibble]] : float(nibble);
    } else if constexpr (BITS == kFp8) {
        return kFp8Table.v[row[k]];
    } else {
        return float(row[k]);
    }
}

template <int BITS, int R, int NR>
void gemv_rows(const float* x, int K, const uint8_t* codes, const float* scales, const float* offsets, int group,
               const float* bias, float* out, int N, int n_first, int n_end) {
    const int64_t row_bytes = packed_nibbles(BITS) ? K / 2 : K;
    const int groups = K / group;
    for (int n = n_first; n < n_end; n++) {
        const uint8_t* row = codes + n * row_bytes;
        float acc[R] = {};
        for (int g = 0; g < groups; g++) {
            const float s = scales[int64_t(n) * groups + g], o = offsets ? offsets[int64_t(n) * groups + g] : 0.f;
            for (int k = g * group; k < (g + 1) * group; k++) {
                const float w = code_at<BITS>(row, k) * s + o;
                for (int r = 0; r < R; r++) acc[r] += w * x[int64_t(r) * K + k];
            }
        }
        for (int r = 0; r < R; r++) out[int64_t(r) * N + n] = acc[r] + (bias ? bias[n] : 0.f);
    }
}
#endif

// Columns of packed 4-bit codes per chunk: 32 where the AVX-512 lookup path takes them, else 16.
inline int nibble_chunk(int group) {
#if defined(__AVX512F__)
    return group % 32 == 0 ? 32 : 16;
#else
    (void)group;
    return 16;
#endif
}

template <int BITS, int R>
inline void gemv_block(const float* x, int K, const uint8_t* codes, const float* scales, const float* offsets,
                       int group, const float* bias, float* out, int N, int n_first, int n_end) {
#if defined(__AVX512F__)
    if (packed_nibbles(BITS) && nibble_chunk(group) == 32) {
        gemv_rows_nibbles32<R, kWeightRows, BITS == kFp4>(x, K, codes, scales, offsets, group, bias, out, N, n_first,
                                                          n_end);
        return;
    }
#endif
    gemv_rows<BITS, R, kWeightRows>(x, K, codes, scales, offsets, group, bias, out, N, n_first, n_end);
}

template <int BITS>
void gemv(const float* x, int M, int K, const uint8_t* codes, const float* scales, const float* offsets, int group,
          const float* bias, float* out, int N, int n_first, int n_end) {
    // Rows of x in blocks of about 256 KB, which stay in L2 while every weight row passes; weight
    // rows in blocks of 16, which stay in L1 while every kMaxRows-row slice of the x block passes.
    constexpr int kRowBlock = 16;
    const int x_block = std::max(kMaxRows, (256 * 1024 / (4 * K)) / kMaxRows * kMaxRows);
    for (int m0 = 0; m0 < M; m0 += x_block) {
        const int m1 = std::min(M, m0 + x_block);
        for (int n0 = n_first; n0 < n_end; n0 += kRowBlock) {
            const int n1 = std::min(n_end, n0 + kRowBlock);
            for (int m = m0; m < m1; m += kMaxRows) {
                const float* xm = x + int64_t(m) * K;
                float* om = out + int64_t(m) * N;
                switch (std::min(m1 - m, kMaxRows)) {
                    case 1: gemv_block<BITS, 1>(xm, K, codes, scales, offsets, group, bias, om, N, n0, n1); break;
                    case 2: gemv_block<BITS, 2>(xm, K, codes, scales, offsets, group, bias, om, N, n0, n1); break;
                    case 3: gemv_block<BITS, 3>(xm, K, codes, scales, offsets, group, bias, om, N, n0, n1); break;
                    case 4: gemv_block<BITS, 4>(xm, K, codes, scales, offsets, group, bias, om, N, n0, n1); break;
                    case 5: gemv_block<BITS, 5>(xm, K, codes, scales, offsets, group, bias, om, N, n0, n1); break;
                    case 6: gemv_block<BITS, 6>(xm, K, codes, scales, offsets, group, bias, om, N, n0, n1); break;
                    case 7: gemv_block<BITS, 7>(xm, K, codes, scales, offsets, group, bias, om, N, n0, n1); break;
                    default: gemv_block<BITS, 8>(xm, K, codes, scales, offsets, group, bias, om, N, n0, n1); break;
                }
            }
        }
    }
}

// x's columns in the order the 4-bit kernels read nibbles: in each chunk of `width` columns the
// even ones, then the odd ones (a dot product's terms in any order).
std::vector<float> nibble_order(const float* x, int M, int K, int width) {
    std::vector<float> ordered(size_t(M) * K);
    for (int64_t at = 0; at < int64_t(M) * K; at += width)
        for (int j = 0; j < width / 2; j++) {
            ordered[at + j] = x[at + 2 * j];
            ordered[at + width / 2 + j] = x[at + 2 * j + 1];
        }
    return ordered;
}

}  // namespace

extern "C" {

// bits: 4, 5..8, 0 (fp8 e4m3) or 1 (fp4 e2m1 nibbles). x float32 [M, K], contiguous;
// out float32 [M, N]; offsets and bias may be null. Returns 0, or 5 (bits or group unsupported).
int splitserve_quant_gemv(const float* x, int M, int K, const uint8_t* codes, int bits, const float* scales,
                          const float* offsets, int group, const float* bias, float* out, int N, int n_first,
                          int n_end) {
    if (group % 16 || K % group) return 5;
    switch (bits) {
        case 4: case kFp4: {
            const std::vector<float> ordered = nibble_order(x, M, K, nibble_chunk(group));
            if (bits == 4) gemv<4>(ordered.data(), M, K, codes, scales, offsets, group, bias, out, N, n_first, n_end);
            else gemv<kFp4>(ordered.data(), M, K, codes, scales, offsets, group, bias, out, N, n_first, n_end);
            return 0;
        }
        case kFp8: gemv<kFp8>(x, M, K, codes, scales, offsets, group, bias, out, N, n_first, n_end); return 0;
        case 5: case 6: case 7: case 8:
            gemv<8>(x, M, K, codes, scales, offsets, group, bias, out, N, n_first, n_end);
            return 0;
        default: return 5;
    }
}

}  // extern "C"
