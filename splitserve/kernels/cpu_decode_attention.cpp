// Paged decode attention for CPUs: one new query token per sequence, read in place from the
// block-paged KV pool. The torch reference gathers every sequence's blocks into a padded
// buffer each layer and step and masks the padding; this reads each K/V row once and never
// touches padding. Built and loaded by splitserve/kernels/cpu_native.py: plain C++ with a C
// entry point and no Python API, called through ctypes, which runs it without the GIL.
//
// Layout (strides in elements): the K/V row of (block b, slot s, kv head h) starts at
// b * block_stride + s * slot_stride + h * head_stride; its head_dim elements are contiguous.
// q and out are contiguous [batch, num_heads, head_dim]; query heads h*G .. h*G+G-1 share kv
// head h (grouped-query attention). Scores, softmax and sums are float32 whatever the storage
// type, and the softmax is exact (max, exp, sum over the whole context), as SDPA's. The cache
// may hold float8_e4m3fn codes under a float32 or bfloat16 query (an fp8 KV pool): rows are
// converted through a table as they are read, and the float path stays as it was.
// Attention sinks (gpt-oss), when given: one float32 logit per query head, a softmax column
// with no value; the max is taken over the scores and the sink, exp(sink - max) joins the sum.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_scalar.h"

namespace {

constexpr int kMaxDim = 512;

using splitserve::Bf16;
using splitserve::exp_approx;
using splitserve::Fp8;
using splitserve::load;
using splitserve::store;

// r[i] = exp(r[i] - m) for i < n; returns their sum.
inline float exp_shifted(float* __restrict r, int n, float m) {
    float sum = 0.f;
    for (int i = 0; i < n; i++) {
        const float e = exp_approx(r[i] - m);
        r[i] = e;
        sum += e;
    }
    return sum;
}

struct Geometry {
    int heads, kv_heads, group, dim, block_size;
    int64_t block_stride, slot_stride, head_stride;
    float scale, softcap;
    const float* sinks;  // [heads] or nullptr
};

constexpr int kMaxHeads = 256;

// Position t's row (all kv heads) in the pool. The next block of a sequence is anywhere in the
// pool, so its rows are asked for a block ahead (measured: 1.30 -> 1.09 ms a layer at batch 32
// with the pool beyond L2).
template <typename T>
inline const T* position_row(const T* cache, const int32_t* blocks, int t, int len, const Geometry& g,
                             int64_t row_bytes) {
    const int slot = t % g.block_size, blk = t / g.block_size;
    if (t + g.block_size < len) {
        const T* next_row = cache + blocks[blk + 1] * g.block_stride + int64_t(slot) * g.slot_stride;
        const char* next = reinterpret_cast<const char*>(next_row);
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + off);
    }
    return cache + blocks[blk] * g.block_stride + int64_t(slot) * g.slot_stride;
}

// One head's row as float32: float rows are used in place, others converted into `buf`.
template <int DIM, typename T>
inline const float* as_float(const T* row, int dim, float* buf) {
    if constexpr (std::is_same<T, float>::value) return row;
    for (int d = 0; d < (DIM > 0 ? DIM : dim); d++) buf[d] = load(row[d]);
    return buf;
}

// One sequence, all heads, context positions [start, len). Position t's K (and V) rows of all
// kv heads are adjacent in a block, so the context is read as it lies in memory, once. DIM > 0
// is a compile-time copy of g.dim (the dot products unroll); 0 reads it from g.
template <typename T, typename C, int DIM>
void attend_sequence(const T* q, const C* k, const C* v, T* out, const int32_t* blocks, int start, int len,
                     const Geometry& g, float* scores, float* acc) {
    const int n = len - start, dim = DIM > 0 ? DIM : g.dim, heads = g.heads;
    alignas(64) float kv_row[DIM > 0 ? DIM : kMaxDim];
    float maxes[kMaxHeads], sums[kMaxHeads];
    float* qf = acc;  // the query (scaled) lives where the output accumulates, until it is used
    for (int i = 0; i < heads * dim; i++) qf[i] = load(q[i]) * g.scale;
    for (int h = 0; h < heads; h++) maxes[h] = -FLT_MAX;
    const int64_t row_bytes = int64_t(g.kv_heads) * g.head_stride * sizeof(C);
    for (int t = start; t < len; t++) {  // scores
        const C* kr = position_row(k, blocks, t, len, g, row_bytes);
        for (int kh = 0; kh < g.kv_heads; kh++) {
            const float* krow = as_float<DIM>(kr + kh * g.head_stride, dim, kv_row);
            for (int h = kh * g.group; h < (kh + 1) * g.group; h++) {
                const float* qh = qf + h * dim;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < dim; d++) s += qh[d] * krow[d];
                if (g.softcap > 0.f) s = g.softcap * std::tanh(s / g.softcap);
                scores[int64_t(h) * n + (t - start)] = s;
                maxes[h] = s > maxes[h] ? s : maxes[h];
            }
        }
    }
    for (int h = 0; h < heads; h++) {  // softmax numerators and their sum
        float* r = scores + int64_t(h) * n;
        const float sink = g.sinks ? g.sinks[h] : -FLT_MAX;
        const float m = maxes[h] > sink ? maxes[h] : sink;
        sums[h] = exp_shifted(r, n, m) + (g.sinks ? exp_approx(sink - m) : 0.f);
    }
    for (int i = 0; i < heads * dim; i++) acc[i] = 0.f;
    for (int t = start; t < len; t++) {  // weighted sum of V
        const C* vr = position_row(v, blocks, t, len, g, row_bytes);
        for (int kh = 0; kh < g.kv_heads; kh++) {
            const float* vrow = as_float<DIM>(vr + kh * g.head_stride, dim, kv_row);
            for (int h = kh * g.group; h < (kh + 1) * g.group; h++) {
                const float p = scores[int64_t(h) * n + (t - start)];
                float* ah = acc + h * dim;
#pragma omp simd
                for (int d = 0; d < dim; d++) ah[d] += p * vrow[d];
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        const float inv = 1.f / sums[h];
        for (int d = 0; d < dim; d++) store(out + h * dim + d, acc[h * dim + d] * inv);
    }
}

template <typename T, typename C>
int decode(const void* q_, const void* k_, const void* v_, void* out_, const int32_t* block_tables,
           const int32_t* seq_lens, int first_seq, int end_seq, int num_heads, int num_kv_heads, int head_dim,
           int block_size, int max_blocks, int num_blocks, int64_t block_stride, int64_t slot_stride,
           int64_t head_stride, float scale, int window, float softcap, const float* sinks) {
    const T* q = static_cast<const T*>(q_);
    const C *k = static_cast<const C*>(k_), *v = static_cast<const C*>(v_);
    T* out = static_cast<T*>(out_);
    const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (group < 1 || num_heads > kMaxHeads || head_dim > kMaxDim || group * num_kv_heads != num_heads) return 1;
    const Geometry g{num_heads, num_kv_heads, group, head_dim, block_size, block_stride, slot_stride, head_stride,
                     scale, softcap, sinks};
    int longest = 1;
    for (int b = first_seq; b < end_seq; b++) {
        if (seq_lens[b] <= 0 || seq_lens[b] > max_blocks * block_size) return 3;
        const int32_t* row = block_tables + int64_t(b) * max_blocks;  // every block read must be in the pool
        for (int i = 0; i < (seq_lens[b] + block_size - 1) / block_size; i++)
            if (row[i] < 0 || row[i] >= num_blocks) return 4;
        longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    }
    std::vector<float> scores(size_t(num_heads) * size_t(longest)), acc(size_t(num_heads) * head_dim);
    auto attend = attend_sequence<T, C, 0>;  // common head sizes get an unrolled copy
    if (head_dim == 32) attend = attend_sequence<T, C, 32>;
    if (head_dim == 64) attend = attend_sequence<T, C, 64>;
    if (head_dim == 128) attend = attend_sequence<T, C, 128>;
    if (head_dim == 256) attend = attend_sequence<T, C, 256>;
    for (int b = first_seq; b < end_seq; b++) {
        const int len = seq_lens[b];
        const int start = (window > 0 && len > window) ? len - window : 0;
        const int64_t qo = int64_t(b) * num_heads * head_dim;
        attend(q + qo, k, v, out + qo, block_tables + int64_t(b) * max_blocks, start, len, g, scores.data(),
               acc.data());
    }
    return 0;
}

}  // namespace

// 0 on success; 1: unsupported head geometry; 3: a sequence length outside its block table;
// 4: a block id outside the pool. Nothing is read before these checks pass. dtype_code: the
// query's (0 float32, 1 bfloat16); cache_code: the cache's (the same, or 2: float8_e4m3fn).
// sinks: float32 [num_heads] sink logits, or null for none.
extern "C" int splitserve_decode_attention(int dtype_code, int cache_code, const void* q, const void* k_cache,
                                           const void* v_cache, void* out, const int32_t* block_tables,
                                           const int32_t* seq_lens, int first_seq, int end_seq, int num_heads,
                                           int num_kv_heads, int head_dim, int block_size, int max_blocks,
                                           int num_blocks, int64_t block_stride, int64_t slot_stride,
                                           int64_t head_stride, float scale, int window, float softcap,
                                           const float* sinks) {
    auto run = dtype_code == 0 ? decode<float, float> : decode<Bf16, Bf16>;
    if (cache_code == 2) run = dtype_code == 0 ? decode<float, Fp8> : decode<Bf16, Fp8>;
    return run(q, k_cache, v_cache, out, block_tables, seq_lens, first_seq, end_seq, num_heads, num_kv_heads,
               head_dim, block_size, max_blocks, num_blocks, block_stride, slot_stride, head_stride, scale, window,
               softcap, sinks);
}
