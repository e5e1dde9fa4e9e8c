// Paged prefill attention for CPUs: the new tokens of each sequence attend to its cached prefix
// and, causally, to themselves, read in place from the block-paged KV pool (no gather into a
// contiguous copy per sequence and layer, as the torch reference does before calling SDPA).
// Built and loaded by splitserve/kernels/cpu_native.py, called through ctypes (no GIL).
//
// Why not SDPA: torch's CPU flash attention reached ~40 GFLOP/s on one core for 32-dim heads
// (a quarter of the same core's GEMM), and prefill attention was 28% of a demo-model prefill.
// Here a tile of 64 keys is transposed once ([dim][64]) and shared by every query row of its kv
// head (all query heads of the group, 16 tokens), so the scores are rank-1 updates across 64
// lanes and the weighted sum of V runs along head_dim: both vectorise; the softmax is the
// online (flash) one, exact up to float rounding, in float32 whatever the storage type. The
// cache may hold float8_e4m3fn codes (an fp8 KV pool), converted as the tile is loaded.
// Attention sinks (gpt-oss), when given, join each row's softmax once, at the end: with the
// row's final max m and sum l, M = max(m, sink), out = acc e^(m-M) / (l e^(m-M) + e^(sink-M)).
//
// Layout as cpu_decode_attention.cpp: the K/V row of (block b, slot s, kv head h) starts at
// b * block_stride + s * slot_stride + h * head_stride. q and out are contiguous
// [new tokens, num_heads, head_dim]; sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b+1].
// Query i of a sequence with n new tokens and length L sits at position L - n + i.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_scalar.h"
#include "cpu_vec.h"

namespace {

using splitserve::Bf16;
using splitserve::exp_approx;
using splitserve::Fp8;
using splitserve::load;
using splitserve::store;
using splitserve::hmax;
using splitserve::hsum;
using splitserve::IVec;
using splitserve::kLanes;
using splitserve::Vec;
using splitserve::vexp_nonpositive;
using splitserve::vload;
using splitserve::vstore;

// The tile fits the vector registers there are. With AVX-512: 32 registers of 16 floats, and
// a tile of 5 query rows x 64 keys keeps its 20 score vectors and 4 key vectors in them
// (measured against 3, 4, 6 and 7 rows, thread-time A/B on this project's EPYC with GCC 12:
// 5 rows ran 1.3-1.5x faster than 4 at head_dim 64 and 128; 6 and 7 spill).
// Without (AVX2: 16 registers of 8 floats; NEON: 32 of 4), 16-float values are split in two
// and that tile needed 40 registers: every update spilled to memory, and the kernel ran at
// 4 GFLOP/s against SDPA's 66 (measured by compiling for -march=haswell on an AVX-512 host;
// issue 30's 1,500-token SmolLM2 prefill spent 34 of 44.5 s there). So narrower vectors and
// 2 rows x 32 keys: 8 score vectors and 4 key vectors.
#if defined(__AVX512F__)
constexpr int kKeys = 64;    // keys per tile: four registers of scores per query row
constexpr int kRows = 5;     // query rows computed together (their scores stay in registers)
constexpr int kChunk = 64;   // head dims of the V sums held in registers at once: 5 rows x 4 registers
#else
constexpr int kKeys = 32;
constexpr int kRows = 2;
constexpr int kChunk = 32;   // 2 rows x 4 registers of 8 lanes
#endif
constexpr int kTokens = 64;  // new tokens per query tile (times the group's heads: its rows)
constexpr int kMaxDim = 512;
constexpr int kMaxGroup = 64;

struct Geometry {
    int heads, kv_heads, group, dim, block_size, window;
    int64_t block_stride, slot_stride, head_stride;
    float scale, softcap;
    const float* sinks;  // [heads] or nullptr
};

template <typename T>
inline const T* row_at(const T* cache, const int32_t* blocks, int t, int kh, const Geometry& g) {
    return cache + blocks[t / g.block_size] * g.block_stride + int64_t(t % g.block_size) * g.slot_stride +
           int64_t(kh) * g.head_stride;
}

// s[rr][j] = q row rr . key j for kRows rows against the tile's first kParts * kLanes keys
// (kt is [dim][kKeys]); the scores of later keys are 0 (a causal diagonal: no row sees them).
template <int kParts>
__attribute__((target("prefer-vector-width=512")))
inline void tile_scores(const float* q, const float* kt, int dim, float (*s)[kKeys]) {
    Vec sum[kRows][kParts] = {};
    for (int d = 0; d < dim; d++) {
        Vec key[kParts];
#pragma GCC unroll 4
        for (int c = 0; c < kParts; c++) key[c] = vload(kt + d * kKeys + c * kLanes);
#pragma GCC unroll 4
        for (int rr = 0; rr < kRows; rr++) {
            const float qv = q[rr * dim + d];
#pragma GCC unroll 4
            for (int c = 0; c < kParts; c++) sum[rr][c] += qv * key[c];
        }
    }
    for (int rr = 0; rr < kRows; rr++) {
        for (int c = 0; c < kParts; c++) vstore(s[rr] + c * kLanes, sum[rr][c]);
        for (int j = kParts * kLanes; j < kKeys; j++) s[rr][j] = 0.f;
    }
}

// tile_scores over the key vectors a chunk of rows can see: `parts` of them (1 .. kKeys / kLanes)
inline void visible_scores(int parts, const float* q, const float* kt, int dim, float (*s)[kKeys]) {
    static_assert(kKeys / kLanes == 4, "one case per key vector");
    switch (parts) {
        case 1: return tile_scores<1>(q, kt, dim, s);
        case 2: return tile_scores<2>(q, kt, dim, s);
        case 3: return tile_scores<3>(q, kt, dim, s);
        default: return tile_scores<4>(q, kt, dim, s);
    }
}

// acc rows (stride dim) = correction[rr] * acc + sum over the tile's nk keys of s[rr][j] * V
// row j, for head dims d0 .. d0 + kChunk. Keys past nk have s == 0 and may not exist: never read.
__attribute__((target("prefer-vector-width=512")))
inline void weigh_values(const float (*s)[kKeys], const float* const* v_rows, int nk, int d0, float* acc, int dim,
                         const float* correction) {
    constexpr int kParts = kChunk / kLanes;
    Vec sum[kRows][kParts];
#pragma GCC unroll 4
    for (int rr = 0; rr < kRows; rr++)  // what the rows summed so far, rescaled to their new maxima
#pragma GCC unroll 4
        for (int c = 0; c < kParts; c++) sum[rr][c] = vload(acc + rr * dim + c * kLanes) * correction[rr];
    for (int j = 0; j < nk; j++) {
        Vec value[kParts];
#pragma GCC unroll 4
        for (int c = 0; c < kParts; c++) value[c] = vload(v_rows[j] + d0 + c * kLanes);
#pragma GCC unroll 4
        for (int rr = 0; rr < kRows; rr++) {
            const float p = s[rr][j];
#pragma GCC unroll 4
            for (int c = 0; c < kParts; c++) sum[rr][c] += p * value[c];
        }
    }
#pragma GCC unroll 4
    for (int rr = 0; rr < kRows; rr++)
#pragma GCC unroll 4
        for (int c = 0; c < kParts; c++) vstore(acc + rr * dim + c * kLanes, sum[rr][c]);
}

// The online softmax of a chunk's kRows score rows against one key tile (rows r0 ..; row r is
// token r / group at position pos0 + r / group): the keys a row cannot see (causal, window,
// past the tile's nk) get weight 0, each row's running maximum m and sum l are updated, and
// correction[rr] is what its earlier sums are to be multiplied by (weigh_values applies it).
// A padding row or one that sees nothing of the tile gets weights 0 and correction 1. The
// rows' maxima, exps and sums are computed together, not row after row: one row's chain of
// reductions had nothing to overlap with, and the row-by-row form was 28% of the kernel.
__attribute__((target("prefer-vector-width=512")))
inline void softmax_rows(float (*s)[kKeys], int r0, int rows, int group, int pos0, int t0, int nk, const Geometry& g,
                         float* m, float* l, float* correction) {
    constexpr int kParts = kKeys / kLanes;
    int lo[kRows], hi[kRows];
    bool every_key = true;  // no row masks anything: the common case off the diagonal
    for (int rr = 0; rr < kRows; rr++) {
        const int r = r0 + rr, pos = pos0 + r / group;
        hi[rr] = pos - t0 < nk - 1 ? pos - t0 : nk - 1;
        lo[rr] = g.window > 0 && pos - g.window + 1 - t0 > 0 ? pos - g.window + 1 - t0 : 0;
        if (r >= rows) hi[rr] = -1;  // a padding row: sees nothing
        every_key &= lo[rr] == 0 && hi[rr] == kKeys - 1;
        if (g.softcap > 0.f)
            for (int j = lo[rr]; j <= hi[rr]; j++) s[rr][j] = g.softcap * std::tanh(s[rr][j] / g.softcap);
    }
    Vec x[kRows][kParts];
    IVec visible[kRows][kParts];
    IVec lane;
    for (int i = 0; i < kLanes; i++) lane[i] = i;
#pragma GCC unroll 8
    for (int rr = 0; rr < kRows; rr++)
#pragma GCC unroll 4
        for (int c = 0; c < kParts; c++) {
            const IVec key = lane + c * kLanes;
            visible[rr][c] = every_key ? IVec{} - 1 : (key >= lo[rr]) & (key <= hi[rr]);
            x[rr][c] = visible[rr][c] ? vload(s[rr] + c * kLanes) : Vec{} - FLT_MAX;
        }
    float m_new[kRows];
#pragma GCC unroll 8
    for (int rr = 0; rr < kRows; rr++) {
        Vec top = x[rr][0];
#pragma GCC unroll 4
        for (int c = 1; c < kParts; c++) top = x[rr][c] > top ? x[rr][c] : top;
        const float tile_max = hmax(top);
        m_new[rr] = tile_max > m[r0 + rr] ? tile_max : m[r0 + rr];
    }
    Vec sums[kRows];
#pragma GCC unroll 8
    for (int rr = 0; rr < kRows; rr++) {
        sums[rr] = Vec{};
#pragma GCC unroll 4
        for (int c = 0; c < kParts; c++) {
            const Vec e = visible[rr][c] ? vexp_nonpositive(x[rr][c] - m_new[rr]) : Vec{};
            vstore(s[rr] + c * kLanes, e);
            sums[rr] += e;
        }
    }
#pragma GCC unroll 8
    for (int rr = 0; rr < kRows; rr++) {
        const int r = r0 + rr;
        correction[rr] = exp_approx(m[r] - m_new[rr]);
        l[r] = l[r] * correction[rr] + hsum(sums[rr]);
        m[r] = m_new[rr];
    }
}

// All rows of one query tile of one kv head: rows r = i * group + j are token i (position
// pos0 + i) of query head kh * group + j. q_rows [rows][dim] holds the scaled queries; the
// output rows are written to out (the sequence's [n, heads, dim] rows from token tok0).
// One kv head's keys and values of a sequence as the tiles read them: tile t's K transposed
// ([dim][kKeys], keys past the sequence zero) and, from a cache not holding float, its V rows
// as float. Each tile is made once, the first time a query tile reaches it, and then read by
// every later query tile: a causal prefill of n tokens reads ~n^2 / 2 / kKeys^2 tiles, and
// transposing each one again for each query tile cost ~15% of the kernel at 384 tokens.
template <typename C>
struct KeyTiles {
    std::vector<float> kt, vt;
    std::vector<char> ready;
    const float* v_rows[kKeys];

    void reset(int len, int dim) {
        const size_t tiles = (len + kKeys - 1) / kKeys;
        if (kt.size() < tiles * dim * kKeys) kt.resize(tiles * dim * kKeys);
        if (!std::is_same<C, float>::value && vt.size() < tiles * kKeys * dim) vt.resize(tiles * kKeys * dim);
        ready.assign(tiles, 0);
    }

    // The tile starting at key t0 (a multiple of kKeys): its transposed K, and v_rows set to
    // its V rows.
    const float* at(int t0, int len, int kh, const C* k, const C* v, const int32_t* blocks, const Geometry& g,
                    int dim) {
        const int tile = t0 / kKeys, nk = len - t0 < kKeys ? len - t0 : kKeys;
        float* kt_tile = kt.data() + size_t(tile) * dim * kKeys;
        float* vt_tile = std::is_same<C, float>::value ? nullptr : vt.data() + size_t(tile) * kKeys * dim;
        if (!ready[tile]) {
            for (int j = 0; j < kKeys; j++) {
                if (j < nk) {
                    const C* kr = row_at(k, blocks, t0 + j, kh, g);
                    for (int d = 0; d < dim; d++) kt_tile[d * kKeys + j] = load(kr[d]);
                    if constexpr (!std::is_same<C, float>::value) {
                        const C* vr = row_at(v, blocks, t0 + j, kh, g);
                        for (int d = 0; d < dim; d++) vt_tile[j * dim + d] = load(vr[d]);
                    }
                } else {
                    for (int d = 0; d < dim; d++) kt_tile[d * kKeys + j] = 0.f;
                }
            }
            ready[tile] = 1;
        }
        for (int j = 0; j < nk; j++) {
            if constexpr (std::is_same<C, float>::value) {
                v_rows[j] = row_at(v, blocks, t0 + j, kh, g);  // used in place
            } else {
                v_rows[j] = vt_tile + j * dim;
            }
        }
        return kt_tile;
    }
};

template <typename T, typename C, int DIM>
__attribute__((target("prefer-vector-width=512")))
void attend_tile(const float* q_rows, int tokens, int pos0, int len, int kh, const C* k, const C* v,
                 const int32_t* blocks, T* out, const Geometry& g, KeyTiles<C>& tiles, float* acc, float* m,
                 float* l) {
    const int dim = DIM > 0 ? DIM : g.dim, group = g.group, rows = tokens * group;
    const int padded = (rows + kRows - 1) / kRows * kRows;
    for (int r = 0; r < padded; r++) {
        m[r] = -FLT_MAX;
        l[r] = 0.f;
    }
    for (int i = 0; i < padded * dim; i++) acc[i] = 0.f;
    const int last = pos0 + tokens - 1;  // the furthest position any row of the tile sees
    // tiles start at multiples of kKeys, shared by every query tile (a window's first tile
    // masks the keys before it)
    const int first = g.window > 0 ? (pos0 - g.window + 1 > 0 ? pos0 - g.window + 1 : 0) / kKeys * kKeys : 0;
    const float* const* v_rows = tiles.v_rows;
    for (int t0 = first; t0 <= last; t0 += kKeys) {
        const int nk = last + 1 - t0 < kKeys ? last + 1 - t0 : kKeys;
        const float* kt = tiles.at(t0, len, kh, k, v, blocks, g, dim);
        for (int r0 = 0; r0 < padded; r0 += kRows) {
            // the furthest key of this tile any row of the chunk sees (rows are in position
            // order): on a causal diagonal the keys past it are neither scored nor summed
            const int last_row = r0 + kRows - 1 < rows - 1 ? r0 + kRows - 1 : rows - 1;
            const int reach = pos0 + last_row / group - t0 < nk - 1 ? pos0 + last_row / group - t0 : nk - 1;
            if (reach < 0) continue;  // the chunk sees nothing of this tile
            const int nk_chunk = reach + 1;
            alignas(64) float s[kRows][kKeys];
            visible_scores((nk_chunk + kLanes - 1) / kLanes, q_rows + r0 * dim, kt, dim, s);
            float correction[kRows];
            softmax_rows(s, r0, rows, group, pos0, t0, nk, g, m, l, correction);
            // weighted sum of V along head_dim, kChunk dims at a time: the rows' sums stay in
            // registers over the tile's keys
            for (int d0 = 0; d0 < dim; d0 += kChunk) {
                if (dim - d0 >= kChunk) {
                    weigh_values(s, v_rows, nk_chunk, d0, acc + r0 * dim + d0, dim, correction);
                    continue;
                }
                const int width = dim - d0;  // a last part narrower than kChunk (head_dim 80, 96)
                for (int rr = 0; rr < kRows; rr++)
                    for (int d = 0; d < width; d++) acc[(r0 + rr) * dim + d0 + d] *= correction[rr];
                for (int j = 0; j < nk_chunk; j++)
                    for (int rr = 0; rr < kRows; rr++)
                        for (int d = 0; d < width; d++) acc[(r0 + rr) * dim + d0 + d] += s[rr][j] * v_rows[j][d0 + d];
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const int i = r / group, h = kh * group + r % group;
        float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        if (g.sinks) {  // the sink's column, with the max over the scores and it together
            const float sink = g.sinks[h], top = m[r] > sink ? m[r] : sink;
            const float c = exp_approx(m[r] - top);
            inv = c / (l[r] * c + exp_approx(sink - top));
        }
        T* o = out + (int64_t(i) * g.heads + h) * dim;
        for (int d = 0; d < dim; d++) store(o + d, acc[r * dim + d] * inv);
    }
}

template <typename T, typename C, int DIM>
void attend_items(const T* q, const C* k, const C* v, T* out, const int32_t* block_tables, const int32_t* cu_q,
                  const int32_t* seq_lens, int max_blocks, int first_item, int end_item, const Geometry& g) {
    const int dim = DIM > 0 ? DIM : g.dim, rows = kTokens * g.group;
    const int padded = (rows + kRows - 1) / kRows * kRows;
    std::vector<float> q_rows(size_t(padded) * dim), acc(size_t(padded) * dim), m(padded), l(padded);
    KeyTiles<C> tiles;
    for (int item = first_item; item < end_item; item++) {  // item = sequence * kv_heads + kv head
        const int b = item / g.kv_heads, kh = item % g.kv_heads;
        const int start = cu_q[b], n = cu_q[b + 1] - cu_q[b], len = seq_lens[b];
        const int32_t* blocks = block_tables + int64_t(b) * max_blocks;
        tiles.reset(len, dim);
        for (int i0 = 0; i0 < n; i0 += kTokens) {
            const int tokens = n - i0 < kTokens ? n - i0 : kTokens;
            for (int i = 0; i < kTokens; i++) {
                for (int j = 0; j < g.group; j++) {
                    float* dst = q_rows.data() + (i * g.group + j) * dim;
                    const T* src = q + (int64_t(start + i0 + i) * g.heads + kh * g.group + j) * dim;
                    for (int d = 0; d < dim; d++) dst[d] = i < tokens ? load(src[d]) * g.scale : 0.f;
                }
            }
            attend_tile<T, C, DIM>(q_rows.data(), tokens, len - n + i0, len, kh, k, v, blocks,
                                   out + int64_t(start + i0) * g.heads * dim, g, tiles, acc.data(), m.data(),
                                   l.data());
        }
    }
}

template <typename T, typename C>
int prefill(const void* q_, const void* k_, const void* v_, void* out_, const int32_t* block_tables,
            const int32_t* cu_q, const int32_t* seq_lens, int num_seqs, int first_item, int end_item, int num_heads,
            int num_kv_heads, int head_dim, int block_size, int max_blocks, int num_blocks, int64_t block_stride,
            int64_t slot_stride, int64_t head_stride, float scale, int window, float softcap, const float* sinks) {
    const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (group < 1 || group > kMaxGroup || head_dim > kMaxDim || group * num_kv_heads != num_heads) return 1;
    for (int b = 0; b < num_seqs; b++) {  // every row read must lie in the pool
        const int n = cu_q[b + 1] - cu_q[b], len = seq_lens[b];
        if (n < 0 || len < n || len > max_blocks * block_size) return 3;
        const int32_t* row = block_tables + int64_t(b) * max_blocks;
        for (int i = 0; i < (len + block_size - 1) / block_size; i++)
            if (row[i] < 0 || row[i] >= num_blocks) return 4;
    }
    const Geometry g{num_heads, num_kv_heads, group, head_dim, block_size, window, block_stride, slot_stride,
                     head_stride, scale, softcap, sinks};
    const T* q = static_cast<const T*>(q_);
    const C *k = static_cast<const C*>(k_), *v = static_cast<const C*>(v_);
    T* out = static_cast<T*>(out_);
    auto run = attend_items<T, C, 0>;  // common head sizes get an unrolled copy
    if (head_dim == 32) run = attend_items<T, C, 32>;
    if (head_dim == 64) run = attend_items<T, C, 64>;
    if (head_dim == 128) run = attend_items<T, C, 128>;
    if (head_dim == 256) run = attend_items<T, C, 256>;
    run(q, k, v, out, block_tables, cu_q, seq_lens, max_blocks, first_item, end_item, g);
    return 0;
}

}  // namespace

// 0 on success; 1: unsupported head geometry; 3: a sequence's length outside its block table
// (or fewer cached tokens than new ones); 4: a block id outside the pool. Items are
// sequence * num_kv_heads + kv head; [first_item, end_item) is this call's share. dtype_code
// and cache_code as in splitserve_decode_attention; sinks: float32 [num_heads] or null.
extern "C" int splitserve_prefill_attention(int dtype_code, int cache_code, const void* q, const void* k_cache,
                                            const void* v_cache, void* out, const int32_t* block_tables,
                                            const int32_t* cu_seqlens_q, const int32_t* seq_lens, int num_seqs,
                                            int first_item, int end_item, int num_heads, int num_kv_heads,
                                            int head_dim, int block_size, int max_blocks, int num_blocks,
                                            int64_t block_stride, int64_t slot_stride, int64_t head_stride,
                                            float scale, int window, float softcap, const float* sinks) {
    auto run = dtype_code == 0 ? prefill<float, float> : prefill<Bf16, Bf16>;
    if (cache_code == 2) run = dtype_code == 0 ? prefill<float, Fp8> : prefill<Bf16, Fp8>;
    return run(q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, num_seqs, first_item, end_item,
               num_heads, num_kv_heads, head_dim, block_size, max_blocks, num_blocks, block_stride, slot_stride,
               head_stride, scale, window, softcap, sinks);
}
