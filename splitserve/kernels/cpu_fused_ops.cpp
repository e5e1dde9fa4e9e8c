// The small per-layer ops of a CPU decode step, each one pass over its rows instead of the
// five to ten torch ops (and temporaries) of the reference: RMSNorm, rotary embedding fused
// with the KV-cache write, and the gated MLP's activation times up. At decode batch sizes
// these rows are a few KB, so the reference's time was per-op dispatch, not arithmetic.
// Built with cpu_decode_attention.cpp into one library by splitserve/kernels/cpu_native.py.
//
// Numerics follow splitserve/kernels/reference.py: statistics in float32, and with bfloat16
// storage each step is rounded where the reference's op-by-op bfloat16 arithmetic rounds.
// Every function returns 0, or an error code cpu_native.py explains.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_scalar.h"

namespace {

using splitserve::Bf16;
using splitserve::exp_approx;
using splitserve::Fp8;
using splitserve::load;
using splitserve::rounded;
using splitserve::store;

// RMSNorm of each row. Llama form: out = w * T(x * rsqrt(mean(x^2) + eps)). Gemma form
// (gemma != 0): out = T((1 + w) * x * rsqrt(...)), all in float32.
template <typename T>
inline void scale_row(const T* __restrict xr, const T* __restrict w, T* __restrict o, float sum_sq, int hidden,
                      float eps, int gemma) {
    const float inv = 1.f / std::sqrt(sum_sq / hidden + eps);
    if (gemma) {
        for (int i = 0; i < hidden; i++) store(o + i, (load(w[i]) + 1.f) * (load(xr[i]) * inv));
    } else {
        for (int i = 0; i < hidden; i++) store(o + i, load(w[i]) * rounded<T>(load(xr[i]) * inv));
    }
}

template <typename T>
void rms_norm(const T* x, int64_t x_row, const T* w, T* out, int rows, int hidden, float eps, int gemma) {
    for (int r = 0; r < rows; r++) {
        const T* xr = x + r * x_row;
        float sum = 0.f;
        for (int i = 0; i < hidden; i++) {
            const float v = load(xr[i]);
            sum += v * v;
        }
        scale_row(xr, w, out + int64_t(r) * hidden, sum, hidden, eps, gemma);
    }
}

// The residual add fused with the norm that reads its result: sum = T(x + delta) (as torch's
// add in T), out = rms_norm(sum); one pass over the rows instead of an add, a temporary and a
// norm (two ops and their dispatch per norm of every layer, twice a layer).
template <typename T>
void add_rms_norm(const T* x, int64_t x_row, const T* delta, int64_t d_row, const T* w, T* sum_out, T* out,
                  int rows, int hidden, float eps, int gemma) {
    for (int r = 0; r < rows; r++) {
        const T* __restrict xr = x + r * x_row;
        const T* __restrict dr = delta + r * d_row;
        T* __restrict sr = sum_out + int64_t(r) * hidden;
        float sum = 0.f;
        for (int i = 0; i < hidden; i++) {
            const float v = rounded<T>(load(xr[i]) + load(dr[i]));
            store(sr + i, v);
            sum += v * v;
        }
        scale_row(static_cast<const T*>(sr), w, out + int64_t(r) * hidden, sum, hidden, eps, gemma);
    }
}

// Neox rotary on the first `rot` dims of one head (x1 = first half, x2 = second half):
// out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, rounded as the reference's
// q * cos + rotate_half(q) * sin; dims from `rot` on are copied.
// (restrict: the output never overlaps the inputs, which lets the loop vectorise)
template <typename T>
inline void rotate_head(const T* __restrict x, const T* __restrict cos, const T* __restrict sin,
                        T* __restrict out, int rot, int dim) {
    const int half = rot / 2;
    for (int i = 0; i < half; i++) {
        const float x1 = load(x[i]), x2 = load(x[i + half]);
        store(out + i, rounded<T>(x1 * load(cos[i])) + rounded<T>(-x2 * load(sin[i])));
        store(out + i + half, rounded<T>(x2 * load(cos[i + half])) + rounded<T>(x1 * load(sin[i + half])));
    }
    for (int i = rot; i < dim; i++) out[i] = x[i];
}

constexpr int kMaxDim = 512;

struct Pool {
    int64_t num_blocks, block_stride, slot_stride, head_stride;
    int block_size;
};

// One head's row (dim values of T) into an fp8 cache row as reference.quantize_fp8 writes it:
// x / scale rounded to T (torch divides in x's dtype), then e4m3, saturating at +-448.
template <typename T>
inline void quantize_row(const T* x, Fp8* dst, float scale, int dim) {
    for (int i = 0; i < dim; i++) store(dst + i, splitserve::rounded<T>(load(x[i]) / scale));
}

// Rotates q into q_out [n, heads, dim] and k into the cache at each token's slot; copies v
// there too. Rows of q, k, v are `*_row` elements apart, heads `dim` apart within a row. An
// fp8 cache (C = Fp8) gets rotated k and v quantized with their scales.
template <typename T, typename C>
int rotary_store(const T* q, int64_t q_row, const T* k, int64_t k_row, const T* v, int64_t v_row,
                 const T* cos, const T* sin, int64_t cs_row, int rot, T* q_out, C* k_cache, C* v_cache,
                 const int64_t* slots, int n, int heads, int kv_heads, int dim, const Pool& p, float k_scale,
                 float v_scale) {
    for (int t = 0; t < n; t++) {  // every slot checked before anything is written
        if (slots[t] < 0 || slots[t] / p.block_size >= p.num_blocks) return 4;
    }
    for (int t = 0; t < n; t++) {
        const T* c = cos + t * cs_row;
        const T* s = sin + t * cs_row;
        for (int h = 0; h < heads; h++) {
            rotate_head(q + t * q_row + h * dim, c, s, q_out + (int64_t(t) * heads + h) * dim, rot, dim);
        }
        const int64_t base = slots[t] / p.block_size * p.block_stride + slots[t] % p.block_size * p.slot_stride;
        for (int h = 0; h < kv_heads; h++) {
            const T* vr = v + t * v_row + h * dim;
            C* kd = k_cache + base + h * p.head_stride;
            C* vd = v_cache + base + h * p.head_stride;
            if constexpr (std::is_same<C, Fp8>::value) {
                T rotated[kMaxDim];
                rotate_head(k + t * k_row + h * dim, c, s, rotated, rot, dim);
                quantize_row(rotated, kd, k_scale, dim);
                quantize_row(vr, vd, v_scale, dim);
            } else {
                rotate_head(k + t * k_row + h * dim, c, s, kd, rot, dim);
                for (int i = 0; i < dim; i++) vd[i] = vr[i];
            }
        }
    }
    return 0;
}

inline float silu(float g) { return g / (1.f + exp_approx(-g)); }

inline float gelu_tanh(float g) {  // 0.5 g (1 + tanh(u)) = g sigmoid(2u): no cancellation near tanh = -1
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.f + exp_approx(-2.f * u));
}

// out[r] = act(x[r, :inter]) * x[r, inter:], act = SiLU (or GELU-tanh, gelu != 0); the
// activation is rounded to T before the product, as the reference's two ops round.
template <typename T>
void act_and_mul(const T* x, int64_t x_row, T* out, int rows, int inter, int gelu) {
    for (int r = 0; r < rows; r++) {
        const T* __restrict gate = x + r * x_row;
        const T* __restrict up = gate + inter;
        T* __restrict o = out + int64_t(r) * inter;
        if (gelu) {
            for (int i = 0; i < inter; i++) store(o + i, rounded<T>(gelu_tanh(load(gate[i]))) * load(up[i]));
        } else {
            for (int i = 0; i < inter; i++) store(o + i, rounded<T>(silu(load(gate[i]))) * load(up[i]));
        }
    }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (as cpu_native.DTYPE_CODES).
int splitserve_rms_norm(int dtype, const void* x, int64_t x_row, const void* w, void* out, int rows, int hidden,
                        float eps, int gemma) {
    if (dtype == 0) {
        rms_norm(static_cast<const float*>(x), x_row, static_cast<const float*>(w), static_cast<float*>(out), rows,
                 hidden, eps, gemma);
    } else {
        rms_norm(static_cast<const Bf16*>(x), x_row, static_cast<const Bf16*>(w), static_cast<Bf16*>(out), rows,
                 hidden, eps, gemma);
    }
    return 0;
}

int splitserve_add_rms_norm(int dtype, const void* x, int64_t x_row, const void* delta, int64_t d_row, const void* w,
                            void* sum_out, void* out, int rows, int hidden, float eps, int gemma) {
    if (dtype == 0) {
        add_rms_norm(static_cast<const float*>(x), x_row, static_cast<const float*>(delta), d_row,
                     static_cast<const float*>(w), static_cast<float*>(sum_out), static_cast<float*>(out), rows, hidden,
                     eps, gemma);
    } else {
        add_rms_norm(static_cast<const Bf16*>(x), x_row, static_cast<const Bf16*>(delta), d_row,
                     static_cast<const Bf16*>(w), static_cast<Bf16*>(sum_out), static_cast<Bf16*>(out), rows, hidden,
                     eps, gemma);
    }
    return 0;
}

// cache_code: 2 for a float8_e4m3fn cache (k and v stored as codes of x / scale), else the same as dtype.
int splitserve_rotary_store(int dtype, int cache_code, const void* q, int64_t q_row, const void* k, int64_t k_row, const void* v,
                            int64_t v_row, const void* cos, const void* sin, int64_t cs_row, int rot, void* q_out,
                            void* k_cache, void* v_cache, const int64_t* slots, int n, int heads, int kv_heads,
                            int dim, int64_t num_blocks, int block_size, int64_t block_stride, int64_t slot_stride,
                            int64_t head_stride, float k_scale, float v_scale) {
    if (rot > dim || rot % 2 || (cache_code == 2 && dim > kMaxDim)) return 1;
    const Pool p{num_blocks, block_stride, slot_stride, head_stride, block_size};
    if (dtype == 0 && cache_code == 2) {
        return rotary_store(static_cast<const float*>(q), q_row, static_cast<const float*>(k), k_row,
                            static_cast<const float*>(v), v_row, static_cast<const float*>(cos),
                            static_cast<const float*>(sin), cs_row, rot, static_cast<float*>(q_out),
                            static_cast<Fp8*>(k_cache), static_cast<Fp8*>(v_cache), slots, n, heads, kv_heads,
                            dim, p, k_scale, v_scale);
    }
    if (cache_code == 2) {
        return rotary_store(static_cast<const Bf16*>(q), q_row, static_cast<const Bf16*>(k), k_row,
                            static_cast<const Bf16*>(v), v_row, static_cast<const Bf16*>(cos),
                            static_cast<const Bf16*>(sin), cs_row, rot, static_cast<Bf16*>(q_out),
                            static_cast<Fp8*>(k_cache), static_cast<Fp8*>(v_cache), slots, n, heads, kv_heads,
                            dim, p, k_scale, v_scale);
    }
    if (dtype == 0) {
        return rotary_store(static_cast<const float*>(q), q_row, static_cast<const float*>(k), k_row,
                            static_cast<const float*>(v), v_row, static_cast<const float*>(cos),
                            static_cast<const float*>(sin), cs_row, rot, static_cast<float*>(q_out),
                            static_cast<float*>(k_cache), static_cast<float*>(v_cache), slots, n, heads, kv_heads,
                            dim, p, 1.f, 1.f);
    }
    return rotary_store(static_cast<const Bf16*>(q), q_row, static_cast<const Bf16*>(k), k_row,
                        static_cast<const Bf16*>(v), v_row, static_cast<const Bf16*>(cos),
                        static_cast<const Bf16*>(sin), cs_row, rot, static_cast<Bf16*>(q_out),
                        static_cast<Bf16*>(k_cache), static_cast<Bf16*>(v_cache), slots, n, heads, kv_heads, dim, p,
                        1.f, 1.f);
}

int splitserve_act_and_mul(int dtype, const void* x, int64_t x_row, void* out, int rows, int inter, int gelu) {
    if (dtype == 0) {
        act_and_mul(static_cast<const float*>(x), x_row, static_cast<float*>(out), rows, inter, gelu);
    } else {
        act_and_mul(static_cast<const Bf16*>(x), x_row, static_cast<Bf16*>(out), rows, inter, gelu);
    }
    return 0;
}

}  // extern "C"
