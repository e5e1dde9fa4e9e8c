// float32 linear of one row on CPU, y = x @ W.T (+ bias): a decode step of one sequence
// (issue 30). Built with the other kernels into one library by cpu_native.py; called by
// cpu_linear.py.
//
// At one row a linear is a pass over the weight that does two flops per float read, so its
// speed is the rate at which one core streams the weight from memory. Measured on this
// project's AMD EPYC, one thread, SmolLM2's 30 layers (425 MB, far beyond the caches): MKL's
// gemv 17-23 GB/s, oneDNN's 22-24 GB/s, these loops 29-32 GB/s, a plain sum over the same
// bytes 36 GB/s. The loops read the weight strictly in address order with several streams in
// flight, in whichever layout the weight is stored (models/loader.py keeps decoder linears
// input-major; a tied LM head is the embedding, output-major):
//
//   input-major  W[k][n]: y += x[i] * W[i, :] for 8 weight rows at a time (8 sequential
//                streams), into at most 1,024 accumulators per pass, kept in L1.
//   output-major W[n][k]: 8 dot products at a time, each a sequential stream of k floats,
//                with 16-lane partial sums in registers.
//
// Plain loops vectorised by the compiler (-fopenmp-simd with -fassociative-math), so AVX-512,
// AVX2 and NEON builds all take them. Sums are float32, in another order than MKL's: results
// agree to float32 rounding.
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kRowsPerPass = 8;  // weight rows (input-major) or dot products (output-major) in flight
constexpr int kColumnsPerPass = 1024;  // input-major: at most this many accumulators per pass, 4 KB (L1)
constexpr int kLanes = 16;  // output-major: partial sums per dot product (one AVX-512 register)

// y[first:end] for an input-major weight (row i at w + i * n).
void gemv_input_major(const float* x, int k, const float* w, int n, float* y, int first, int end) {
    alignas(64) float acc[kColumnsPerPass];
    // passes of equal width (576 columns: one pass, not 512 + a 64-wide one of short reads)
    const int passes = (end - first + kColumnsPerPass - 1) / kColumnsPerPass;
    const int width = ((end - first + passes - 1) / passes + 15) / 16 * 16;
    for (int c0 = first; c0 < end; c0 += width) {
        const int nb = std::min(width, end - c0);
        std::fill(acc, acc + nb, 0.f);
        int i = 0;
        for (; i + kRowsPerPass <= k; i += kRowsPerPass) {
            const float* r = w + int64_t(i) * n + c0;
            const float a0 = x[i], a1 = x[i + 1], a2 = x[i + 2], a3 = x[i + 3];
            const float a4 = x[i + 4], a5 = x[i + 5], a6 = x[i + 6], a7 = x[i + 7];
            const float *r0 = r, *r1 = r0 + n, *r2 = r1 + n, *r3 = r2 + n;
            const float *r4 = r3 + n, *r5 = r4 + n, *r6 = r5 + n, *r7 = r6 + n;
#pragma omp simd
            for (int j = 0; j < nb; ++j)
                acc[j] += a0 * r0[j] + a1 * r1[j] + a2 * r2[j] + a3 * r3[j] + a4 * r4[j] + a5 * r5[j] + a6 * r6[j] +
                          a7 * r7[j];
        }
        for (; i < k; ++i) {
            const float* r = w + int64_t(i) * n + c0;
            const float a = x[i];
#pragma omp simd
            for (int j = 0; j < nb; ++j) acc[j] += a * r[j];
        }
        std::memcpy(y + c0, acc, nb * sizeof(float));
    }
}

// Dot products of x with `rows` consecutive weight rows (row j at w + j * k), rows <= kRowsPerPass.
template <int ROWS>
void dots(const float* x, int k, const float* w, float* y) {
    float part[ROWS][kLanes] = {};
    const int body = k - k % kLanes;
    for (int i = 0; i < body; i += kLanes)
        for (int q = 0; q < ROWS; ++q) {
            const float* r = w + int64_t(q) * k + i;
#pragma omp simd
            for (int l = 0; l < kLanes; ++l) part[q][l] += r[l] * x[i + l];
        }
    for (int q = 0; q < ROWS; ++q) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int l = 0; l < kLanes; ++l) s += part[q][l];
        for (int i = body; i < k; ++i) s += w[int64_t(q) * k + i] * x[i];
        y[q] = s;
    }
}

// y[first:end] for an output-major weight.
void gemv_output_major(const float* x, int k, const float* w, float* y, int first, int end) {
    int j = first;
    for (; j + kRowsPerPass <= end; j += kRowsPerPass) dots<kRowsPerPass>(x, k, w + int64_t(j) * k, y + j);
    for (; j < end; ++j) dots<1>(x, k, w + int64_t(j) * k, y + j);
}

}  // namespace

extern "C" {

// x float32 [k], contiguous; w float32 [n, k] as a torch weight, stored input-major (w_input_major:
// element (j, i) at w[i * n + j]) or output-major (at w[j * k + i]); bias float32 [n] or null;
// y float32 [n]. Computes y[first:end]. Returns 0.
int splitserve_dense_gemv(const float* x, int k, const float* w, int w_input_major, const float* bias, float* y,
                          int n, int first, int end) {
    if (w_input_major)
        gemv_input_major(x, k, w, n, y, first, end);
    else
        gemv_output_major(x, k, w, y, first, end);
    if (bias != nullptr)
        for (int j = first; j < end; ++j) y[j] += bias[j];
    return 0;
}

}  // extern "C"
