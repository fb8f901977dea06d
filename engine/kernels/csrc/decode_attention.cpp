// Decode attention over the KV arena for x86-64 CPUs with AVX2 and FMA: one call per layer
// for the whole step, each row's result a function of its own query and keys only.
//
// Built and loaded by engine/kernels/native.py (g++ -O3 -mavx2 -mfma -fopenmp, no torch headers),
// called through ctypes by engine/kernels/attention.py. Layout (engine/kernels/kv_layout.py): kc and vc are
// one layer's (positions, Hkv, D) arena of float32 or bfloat16 (a bfloat16 model's KV cache);
// out is (B, Hq, D) float32 and q the same with rows q_ld floats apart (the q part of a fused
// qkv projection, read in place), query head h * g + j reading KV head h (g = Hq / Hkv). The
// call first stores the step's new keys and values at their positions (one per row), then
// attends. Row b attends to two runs of arena positions, seg[b] = (start0, len0, start1,
// len1): its prompt (the shared run, or its own copy) and its generated tokens. Rows that
// share a prompt run form a group (`order[group_ptr[i] .. group_ptr[i + 1])`, equal (start0,
// len0)); a group's prompt keys are read once for all its rows (cascade attention: Hydragen,
// arXiv 2402.05099), then each row reads its own run.
//
// Online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
// FlashAttention's block update): per (row, query head), blocks of KB keys from each run's
// start update (m, l, acc). Batch invariance by construction: a row's sequence of block
// updates (which blocks, in which order) depends only on its own two runs, and an update
// computes each key's score, exponential and contribution with the same instructions
// wherever the key sits in its block; threads split the groups, never a row. So a row's
// bits do not depend on the batch, its group, the thread count, or whether its prompt is
// shared or its own copy. Nor on the ISA. A float32 arena's arithmetic is float32. Over a
// row's own run (`update`), a score's partial sums run in a 16-lane order that AVX-512 holds
// in one register and AVX2 in two (`partials8`), and each output element is one fused
// multiply-add chain over the keys (`accumulate`), whatever the vector width. Over a prompt
// run, read by every row of its group, each block is transposed once to a lane per key and
// a score is one fused multiply-add chain per lane (attention_f32.h). A bfloat16 arena's products take bfloat16
// operands in the order of an AMX tile multiply, a lane per key or output element
// (attention_bf16.h: vdpbf16ps where the CPU has it, fused multiply-adds elsewhere; on AMX
// tiles where verified, attention_tiles.h).
#include "attention_bf16.h"
#include "attention_f32.h"
#include "attention_tiles.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using batchgen::f32_to_bf16;
using batchgen::hsum8x8;
namespace attn = batchgen::attn;
namespace bf16attn = batchgen::bf16attn;
namespace f32attn = batchgen::f32attn;

constexpr int KB = 32;  // keys per block
static_assert(KB == bf16attn::KB, "attention_bf16.h's blocks are decode's");

// 8 consecutive keys' or values' elements as float32: a float32 arena as it is, a bfloat16
// one widened (its 16 bits become the top half of a float32: exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// A step's new key or value row (n float32) into the arena: copied, or rounded to bfloat16
// as torch rounds (`.to(torch.bfloat16)`), so the cache holds what a prefill writes.
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(uint16_t* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

// Score partials in a 16-lane order: lane l of a key's partial sums q[d] k[d] over d = l,
// l + 16, l + 32, ... in order (the first a product, the rest fused multiply-adds), and the
// score is hsum8(lanes 0-7 + lanes 8-15) times the scale. AVX-512 holds the 16 lanes in one
// register, AVX2 in two; either way every lane is the same chain, so the builds agree bit
// for bit and a key's score never depends on where it sits.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// 8 elements at p in lanes 0-7 of a 16-lane register, zeros above (a head's last half chunk).
inline __m512 load8z(const float* p) { return _mm512_zextps256_ps512(_mm256_loadu_ps(p)); }
inline __m512 load8z(const uint16_t* p) { return _mm512_zextps256_ps512(load8(p)); }

#endif

// The score partials of 8 keys k[u] for NQ query heads (query qi at q + qi * D; D = 16 NC
// + 8 HALF: NC chunks of 16, then a half chunk whose lanes 8-15 add 0 x 0), folded to 8
// lanes each: r[qi][u]. Each key's elements are loaded (and widened) once for all NQ
// queries; how many keys and queries share the registers changes only which partial is
// computed when, never its chain of instructions.
#if defined(__AVX512F__)
template <int NC, bool HALF, int NQ, class T>
inline void partials8(const float* q, int64_t D, const T* const* k, __m256 (*r)[8]) {
    constexpr int KG = NQ <= 2 ? 8 : 4;  // keys at a time: NQ x KG accumulators of 32 registers
    for (int h = 0; h < 8; h += KG) {
        __m512 a[NQ][KG];
        for (int u = 0; u < KG; u++) {
            const __m512 kv = NC > 0 ? load16(k[h + u]) : load8z(k[h + u]);
            for (int qi = 0; qi < NQ; qi++)
                a[qi][u] = _mm512_mul_ps(NC > 0 ? _mm512_loadu_ps(q + qi * D) : load8z(q + qi * D), kv);
        }
        for (int c = 1; c < NC; c++)
            for (int u = 0; u < KG; u++) {
                const __m512 kv = load16(k[h + u] + 16 * c);
                for (int qi = 0; qi < NQ; qi++)
                    a[qi][u] = _mm512_fmadd_ps(_mm512_loadu_ps(q + qi * D + 16 * c), kv, a[qi][u]);
            }
        if (HALF && NC > 0)
            for (int u = 0; u < KG; u++) {
                const __m512 kv = load8z(k[h + u] + 16 * NC);
                for (int qi = 0; qi < NQ; qi++)
                    a[qi][u] = _mm512_fmadd_ps(load8z(q + qi * D + 16 * NC), kv, a[qi][u]);
            }
        for (int qi = 0; qi < NQ; qi++)
            for (int u = 0; u < KG; u++) {
                const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[qi][u]), 1));
                r[qi][h + u] = _mm256_add_ps(_mm512_castps512_ps256(a[qi][u]), hi);
            }
    }
}
#else
template <int NC, bool HALF, int NQ, class T>
inline void partials8(const float* q, int64_t D, const T* const* k, __m256 (*r)[8]) {
    constexpr int KG = NQ == 1 ? 4 : NQ == 2 ? 2 : 1;  // 2 x NQ x KG accumulators of 16 registers
    const __m256 zero = _mm256_setzero_ps();
    for (int h = 0; h < 8; h += KG) {
        __m256 lo[NQ][KG], hi[NQ][KG];
        for (int u = 0; u < KG; u++) {
            const __m256 k0 = load8(k[h + u]), k1 = NC > 0 ? load8(k[h + u] + 8) : zero;
            for (int qi = 0; qi < NQ; qi++) {
                lo[qi][u] = _mm256_mul_ps(_mm256_loadu_ps(q + qi * D), k0);
                hi[qi][u] = NC > 0 ? _mm256_mul_ps(_mm256_loadu_ps(q + qi * D + 8), k1) : zero;
            }
        }
        for (int c = 1; c < NC; c++)
            for (int u = 0; u < KG; u++) {
                const __m256 ka = load8(k[h + u] + 16 * c), kb = load8(k[h + u] + 16 * c + 8);
                for (int qi = 0; qi < NQ; qi++) {
                    lo[qi][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + qi * D + 16 * c), ka, lo[qi][u]);
                    hi[qi][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + qi * D + 16 * c + 8), kb, hi[qi][u]);
                }
            }
        if (HALF && NC > 0)
            for (int u = 0; u < KG; u++) {
                const __m256 ka = load8(k[h + u] + 16 * NC);
                for (int qi = 0; qi < NQ; qi++) {
                    lo[qi][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + qi * D + 16 * NC), ka, lo[qi][u]);
                    hi[qi][u] = _mm256_add_ps(hi[qi][u], zero);
                }
            }
        for (int qi = 0; qi < NQ; qi++)
            for (int u = 0; u < KG; u++) r[qi][h + u] = _mm256_add_ps(lo[qi][u], hi[qi][u]);
    }
}
#endif

// acc[0, D) = acc * corr + sum_i s[i] v_i for the n values V + i * ld, for NQ query heads
// (query qi's acc at acc + qi * D, its weights at s + qi * KB, its factor corr[qi]): one
// fused multiply-add chain per element in order of i, so neither the vector width nor the
// column blocks (which keep several queries' accumulators in registers, each value vector
// loaded and widened once for all of them) enter.
template <int NC, bool HALF, int NQ, class T>
inline void accumulate(float* __restrict acc, int64_t D, const float* corr, const float* s,
                          const T* __restrict V, int64_t ld, int n) {
#if defined(__AVX512F__)
    constexpr int CB = NQ == 1 ? (NC > 0 ? NC : 1) : 4;  // 16-float column vectors per pass: NQ x CB accumulators
    for (int c0 = 0; c0 < NC; c0 += CB) {
        const int nc = std::min(CB, NC - c0);
        __m512 a[NQ][CB];
        for (int qi = 0; qi < NQ; qi++)
            for (int c = 0; c < nc; c++)
                a[qi][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + qi * D + 16 * (c0 + c)), _mm512_set1_ps(corr[qi]));
        for (int i = 0; i < n; i++) {
            const T* v = V + i * ld + 16 * c0;
            for (int c = 0; c < nc; c++) {
                const __m512 vv = load16(v + 16 * c);
                for (int qi = 0; qi < NQ; qi++) a[qi][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[qi * KB + i]), vv, a[qi][c]);
            }
        }
        for (int qi = 0; qi < NQ; qi++)
            for (int c = 0; c < nc; c++) _mm512_storeu_ps(acc + qi * D + 16 * (c0 + c), a[qi][c]);
    }
    if (HALF) {
        __m256 h[NQ];
        for (int qi = 0; qi < NQ; qi++)
            h[qi] = _mm256_mul_ps(_mm256_loadu_ps(acc + qi * D + 16 * NC), _mm256_set1_ps(corr[qi]));
        for (int i = 0; i < n; i++) {
            const __m256 vv = load8(V + i * ld + 16 * NC);
            for (int qi = 0; qi < NQ; qi++) h[qi] = _mm256_fmadd_ps(_mm256_set1_ps(s[qi * KB + i]), vv, h[qi]);
        }
        for (int qi = 0; qi < NQ; qi++) _mm256_storeu_ps(acc + qi * D + 16 * NC, h[qi]);
    }
#else
    constexpr int N8 = 2 * NC + (HALF ? 1 : 0);
    constexpr int CB = NQ == 1 ? N8 : NQ <= 3 ? 4 : 3;  // 8-float column vectors per pass: NQ x CB accumulators
    for (int c0 = 0; c0 < N8; c0 += CB) {
        const int nc = std::min(CB, N8 - c0);
        __m256 a[NQ][CB];
        for (int qi = 0; qi < NQ; qi++)
            for (int c = 0; c < nc; c++)
                a[qi][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + qi * D + 8 * (c0 + c)), _mm256_set1_ps(corr[qi]));
        for (int i = 0; i < n; i++) {
            const T* v = V + i * ld + 8 * c0;
            for (int c = 0; c < nc; c++) {
                const __m256 vv = load8(v + 8 * c);
                for (int qi = 0; qi < NQ; qi++) a[qi][c] = _mm256_fmadd_ps(_mm256_set1_ps(s[qi * KB + i]), vv, a[qi][c]);
            }
        }
        for (int qi = 0; qi < NQ; qi++)
            for (int c = 0; c < nc; c++) _mm256_storeu_ps(acc + qi * D + 8 * (c0 + c), a[qi][c]);
    }
#endif
}

// NQ query heads of one row that read the same KV head (query qi at q + qi * D, D = 16 NC +
// 8 HALF floats) against n <= KB keys K[i * ld], values V[i * ld]: the online-softmax update
// of each query's running max m[qi], sum l[qi] and unnormalised output acc + qi * D. The
// keys and values are read once for all NQ queries, and each query's arithmetic is the
// same whatever NQ, so its bits are too. Keys go through the same instructions eight at a
// time (a short block repeats its last key and drops the extra scores), so a key's score
// never depends on where it sits.
template <int NC, bool HALF, int NQ, class T>
__attribute__((noinline)) void update(const float* __restrict q, int64_t D, const T* __restrict K,
                                         const T* __restrict V, int64_t ld, int n, float scale, float* __restrict m,
                                         float* __restrict l, float* __restrict acc) {
    alignas(64) float s[NQ * KB];
    const __m256 sv = _mm256_set1_ps(scale);
    for (int i = 0; i < n; i += 8) {
        const T* k[8];
        for (int u = 0; u < 8; u++) k[u] = K + std::min(i + u, n - 1) * ld;
        __m256 r[NQ][8];
        partials8<NC, HALF, NQ>(q, D, k, r);
        for (int qi = 0; qi < NQ; qi++) _mm256_store_ps(s + qi * KB + i, _mm256_mul_ps(hsum8x8(r[qi]), sv));
    }
    float corr[NQ], *ms[NQ], *ls[NQ];
    for (int qi = 0; qi < NQ; qi++) ms[qi] = m + qi, ls[qi] = l + qi;
    attn::softmax_steps<NQ, /*Chain=*/true>(s, n, ms, ls, corr);
    accumulate<NC, HALF, NQ>(acc, D, corr, s, V, ld, n);
}

template <class T>
using UpdateFn = void (*)(const float*, int64_t, const T*, const T*, int64_t, int, float, float*, float*, float*);

// The update for head size D and nq (1 to 4) query heads at a time, or nullptr. Head
// sizes: every multiple of 8 up to 128, and 160, 192, 256.
template <class T>
UpdateFn<T> pick(int64_t D, int nq) {
    switch (D * 8 + nq) {
#define BATCHGEN_DQ(d, n) \
    case (d) * 8 + (n): return update<(d) / 16, (d) % 16 != 0, n, T>;
#define BATCHGEN_D(d) BATCHGEN_DQ(d, 1) BATCHGEN_DQ(d, 2) BATCHGEN_DQ(d, 3) BATCHGEN_DQ(d, 4)
        BATCHGEN_D(8) BATCHGEN_D(16) BATCHGEN_D(24) BATCHGEN_D(32) BATCHGEN_D(40) BATCHGEN_D(48) BATCHGEN_D(56)
        BATCHGEN_D(64) BATCHGEN_D(72) BATCHGEN_D(80) BATCHGEN_D(88) BATCHGEN_D(96) BATCHGEN_D(104) BATCHGEN_D(112)
        BATCHGEN_D(120) BATCHGEN_D(128) BATCHGEN_D(160) BATCHGEN_D(192) BATCHGEN_D(256)
#undef BATCHGEN_D
#undef BATCHGEN_DQ
        default: return nullptr;
    }
}

// Read one float of every cache line of n arena positions of keys and values, all heads:
// a plain sequential stream, which the hardware prefetcher follows and which keeps many
// loads in flight, so the block is in cache before `update` reads it head by head (each
// head's 256 bytes of a position's 768, interleaved with arithmetic, kept few misses in
// flight). Measured on 2 EPYC cores, SmolLM2's shapes at 32 prompts x 4 samples: 20-26%
// less time per layer (1.55 -> 1.26 ms at 64 generated tokens). Prefetch instructions for
// the next block instead, or reading one head at a time, gained nothing.
template <class T>
inline void stream_in(const T* kc, const T* vc, int64_t p, int n, int64_t ld) {
    const T* k = kc + p * ld;
    const T* v = vc + p * ld;
    int32_t sink = 0;
    for (int64_t i = 0; i < n * ld; i += 64 / (int64_t)sizeof(T)) {
        int32_t a, b;
        std::memcpy(&a, k + i, 4);
        std::memcpy(&b, v + i, 4);
        sink |= a | b;
    }
    asm volatile("" : : "r"(sink));  // the loads are the point: keep them
}

// The query heads of KV head h of rows `rows[0 .. nr)` (state index first + r) against `n`
// keys from arena position p: a row's own run.
template <class T>
inline void block(const UpdateFn<T>* up, int64_t MQ, const float* q, const T* kc, const T* vc, int64_t p, int n,
                  int64_t h, int64_t q_ld, int64_t Hq, int64_t g, int64_t D, int64_t ld, float scale,
                  const int64_t* rows, int64_t nr, int64_t first, float* m, float* l, float* acc) {
    const T* K = kc + p * ld + h * D;
    const T* V = vc + p * ld + h * D;
    for (int64_t r = 0; r < nr; r++) {
        const float* qr = q + rows[r] * q_ld + h * g * D;
        for (int64_t j = 0; j < g;) {
            const int64_t x = (first + r) * Hq + h * g + j;
            const int nq = (int)std::min<int64_t>(g - j, MQ);
            up[nq](qr + j * D, D, K, V, ld, n, scale, m + x, l + x, acc + x * D);
            j += nq;
        }
    }
}

// A bfloat16 arena: all the (row, query head) pairs of KV head h against `n` keys from arena
// position p, with bfloat16 products (attention_bf16.h): the block arranged once, then its
// queries NQ at a time (the keys' and values' loads shared by them; a query's bits are the
// same whatever NQ). qprep: every row's query heads prepared (`prepare_query`), Dp apart.
template <int NQ>
inline void queries_bf16(const bf16attn::Block& blk, const uint16_t* const* qs, float* const* accs, int n,
                         int64_t Dp, int64_t D, float scale, float* const* ms, float* const* ls) {
    alignas(64) float s[NQ * KB];
    alignas(64) uint16_t pw[NQ][KB];
    const uint16_t* ps[NQ];
    float corr[NQ];
    bf16attn::scores<NQ>(qs, Dp, blk, scale, s);
    attn::softmax_steps<NQ>(s, n, ms, ls, corr);
    for (int u = 0; u < NQ; u++) {
        bf16attn::prepare_weights(s + u * KB, pw[u]);
        ps[u] = pw[u];
    }
    bf16attn::accumulate<NQ>(accs, corr, ps, blk, D);
}

inline void block_bf16(bf16attn::Block& blk, const uint16_t* kc, const uint16_t* vc, int64_t p, int n, int64_t h,
                       const uint16_t* qprep, int64_t Hq, int64_t g, int64_t D, int64_t ld, float scale,
                       const int64_t* rows, int64_t nr, float* m, float* l, float* acc) {
    blk.prepare(kc + p * ld + h * D, vc + p * ld + h * D, ld, n, D);
    const int64_t Dp = bf16attn::padded(D);
    constexpr int NQ = bf16attn::L == 16 ? 4 : 1;
    const int64_t total = nr * g;
    for (int64_t t0 = 0; t0 < total; t0 += NQ) {
        const int nq = (int)std::min<int64_t>(NQ, total - t0);
        const uint16_t* qs[NQ];
        float *accs[NQ], *ms[NQ], *ls[NQ];
        for (int u = 0; u < nq; u++) {
            const int64_t r = (t0 + u) / g, j = (t0 + u) % g, x = r * Hq + h * g + j;
            qs[u] = qprep + (rows[r] * Hq + h * g + j) * Dp;
            accs[u] = acc + x * D;
            ms[u] = m + x;
            ls[u] = l + x;
        }
        switch (nq) {
            case 1: queries_bf16<1>(blk, qs, accs, n, Dp, D, scale, ms, ls); break;
            case 2: queries_bf16<2>(blk, qs, accs, n, Dp, D, scale, ms, ls); break;
            case 3: queries_bf16<3>(blk, qs, accs, n, Dp, D, scale, ms, ls); break;
            default: queries_bf16<4>(blk, qs, accs, n, Dp, D, scale, ms, ls); break;
        }
    }
}

// A float32 arena: all the (row, query head) pairs of KV head h against `n` keys from arena
// position p (attention_f32.h): the block's keys arranged once, then its queries NQ at a
// time (the loads of the keys and values shared by them; a query's bits are the same
// whatever NQ).
inline void block_f32(f32attn::Block& blk, const float* q, const float* kc, const float* vc, int64_t p, int n,
                      int64_t h, int64_t q_ld, int64_t Hq, int64_t g, int64_t D, int64_t ld, float scale,
                      const int64_t* rows, int64_t nr, float* m, float* l, float* acc) {
    blk.prepare(kc + p * ld + h * D, ld, n, D);
    const float* V = vc + p * ld + h * D;
    constexpr int NQ = f32attn::NQ;
    const int64_t total = nr * g;
    for (int64_t t0 = 0; t0 < total; t0 += NQ) {
        const int nq = (int)std::min<int64_t>(NQ, total - t0);
        const float* qs[NQ];
        float *accs[NQ], *ms[NQ], *ls[NQ];
        for (int u = 0; u < nq; u++) {
            const int64_t r = (t0 + u) / g, j = (t0 + u) % g, x = r * Hq + h * g + j;
            qs[u] = q + rows[r] * q_ld + (h * g + j) * D;
            accs[u] = acc + x * D;
            ms[u] = m + x;
            ls[u] = l + x;
        }
        switch (nq) {
            case 1: f32attn::queries<1>(blk, qs, V, ld, n, D, scale, ms, ls, accs); break;
            case 2: f32attn::queries<2>(blk, qs, V, ld, n, D, scale, ms, ls, accs); break;
            case 3: f32attn::queries<3>(blk, qs, V, ld, n, D, scale, ms, ls, accs); break;
            default: f32attn::queries<NQ>(blk, qs, V, ld, n, D, scale, ms, ls, accs); break;
        }
    }
}

#if defined(BATCHGEN_HAVE_TILES)
// block_bf16 on AMX tiles: the group's query heads of KV head h (prepared once per group as
// `qt`, state index order) 16 at a time, the same bits.
inline void block_tiles(bf16attn::tiles::BlockTiles& bt, const bf16attn::tiles::QueryTiles& qt, const uint16_t* kc,
                        const uint16_t* vc, int64_t p, int n, int64_t h, int64_t Hq, int64_t g, int64_t D, int64_t ld,
                        float scale, int64_t nr, float* m, float* l, float* acc) {
    namespace tl = bf16attn::tiles;
    bt.prepare(kc + p * ld + h * D, vc + p * ld + h * D, ld, n, D);
    const int64_t total = nr * g;
    for (int64_t t = 0; t < qt.nt; t++) {
        const int nq = (int)std::min<int64_t>(tl::TQ, total - t * tl::TQ);
        alignas(64) float s[tl::TQ * KB];
        float *accs[tl::TQ], *ms[tl::TQ], *ls[tl::TQ], corr[tl::TQ];
        for (int u = 0; u < nq; u++) {
            const int64_t r = (t * tl::TQ + u) / g, j = (t * tl::TQ + u) % g, x = r * Hq + h * g + j;
            accs[u] = acc + x * D;
            ms[u] = m + x;
            ls[u] = l + x;
        }
        tl::scores(qt, t, nq, bt, scale, s);
        for (int u = 0; u < nq; u += 4) {
            float* su = s + u * KB;
            switch (std::min(4, nq - u)) {
                case 1: attn::softmax_steps<1>(su, n, ms + u, ls + u, corr + u); break;
                case 2: attn::softmax_steps<2>(su, n, ms + u, ls + u, corr + u); break;
                case 3: attn::softmax_steps<3>(su, n, ms + u, ls + u, corr + u); break;
                default: attn::softmax_steps<4>(su, n, ms + u, ls + u, corr + u); break;
            }
        }
        tl::accumulate(accs, corr, s, nq, bt, D);
    }
}
#endif

template <class T>
int attend(const float* q, int64_t q_ld, T* kc, T* vc, float* out, const int64_t* seg, const int64_t* group_ptr,
           const int64_t* order, int64_t n_groups, int64_t Hq, int64_t Hkv, int64_t D, float scale, int threads,
           const float* knew, const float* vnew, int64_t kv_ld, const int64_t* write, int64_t B, int tiles) {
    // A row's own run is read by its query heads only: a bfloat16 arena's are updated up to 4
    // at a time (each key and value widened once for all of them: 1.3-1.45x less time on the
    // RL shape, bench/bench_attention.py, when this update served the prompt runs too); a
    // float32 arena has nothing to widen, and there the extra query loads cost more than the
    // shared key loads save: one at a time. (Transposing an own block as attention_f32.h does
    // a prompt block costs more than it saves for 3 queries: SmolLM2's shape, own runs of 64
    // tokens, one layer, one thread, 0.77-0.80 ms against 0.53.)
    constexpr int64_t MQ = sizeof(T) == 2 ? 4 : 1;
    UpdateFn<T> up[MQ + 1] = {};  // up[nq]: nq query heads at a time
    for (int nq = 1; nq <= MQ; nq++) up[nq] = pick<T>(D, nq);
    if (up[1] == nullptr) return -1;
    const int64_t g = Hq / Hkv, ld = Hkv * D;
    if (knew != nullptr) {
        for (int64_t b = 0; b < B; b++) {
            store_row(kc + write[b] * ld, knew + b * kv_ld, ld);
            store_row(vc + write[b] * ld, vnew + b * kv_ld, ld);
        }
    }
    // A float32 arena's prompt runs, read by every row of a group, are transposed once per
    // block for all its queries (attention_f32.h). A bfloat16 arena's take bfloat16 products
    // (attention_bf16.h), with bfloat16 queries: every row's, rounded once for all the blocks
    // that read them. (Arranging a block costs about what 3 queries' products save, so a
    // row's own run keeps float32 products of the widened keys and values: a row's own run
    // and its prompt run are each read the same way whatever the group.)
    constexpr bool bf16 = sizeof(T) == 2;
    const int64_t Dp = bf16attn::padded(D);
#if defined(BATCHGEN_HAVE_TILES)
    const bool use_tiles = bf16 && tiles != 0;  // AMX tiles for the prompt blocks
#else
    constexpr bool use_tiles = false;
    (void)tiles;
#endif
    std::vector<uint16_t> qprep(bf16 && !use_tiles ? B * Hq * Dp : 0);
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = _mm_getcsr();
        std::unique_ptr<bf16attn::Block> blk;
        std::unique_ptr<f32attn::Block> blk32;
        if constexpr (!bf16) blk32 = std::make_unique<f32attn::Block>();
        if constexpr (bf16) {
            _mm_setcsr(csr | batchgen::MXCSR_FTZ_DAZ);  // per thread: the whole bf16 sequence flushes
            if (!use_tiles) {
                blk = std::make_unique<bf16attn::Block>();
#pragma omp for schedule(static)
                for (int64_t b = 0; b < B; b++)
                    for (int64_t j = 0; j < Hq; j++)
                        bf16attn::prepare_query(q + b * q_ld + j * D, D, qprep.data() + (b * Hq + j) * Dp);
            }
        }
#if defined(BATCHGEN_HAVE_TILES)
        // Per thread: the tile configuration (released at the end), a block's tiles and each
        // KV head's query tiles.
        std::unique_ptr<bf16attn::tiles::BlockTiles> bt;
        std::vector<bf16attn::tiles::QueryTiles> qts;
        if (use_tiles) {
            const batchgen::amx::TileConfig cfg = batchgen::amx::tile_config();
            BG_TILE_CONFIG(&cfg);
            bt = std::make_unique<bf16attn::tiles::BlockTiles>();
            qts.resize(Hkv);
        }
#endif
        std::vector<float> buf;
        std::vector<const float*> qh;
#pragma omp for schedule(dynamic, 1)
        for (int64_t gi = 0; gi < n_groups; gi++) {
            const int64_t* rows = order + group_ptr[gi];
            const int64_t nr = group_ptr[gi + 1] - group_ptr[gi];
            const int64_t nq = nr * Hq;  // (row, query head) states
            buf.assign(nq * (D + 2), 0.f);
            float *m = buf.data(), *l = m + nq, *acc = l + nq;
            std::fill(m, m + nq, -INFINITY);
            const int64_t* s0 = seg + rows[0] * 4;  // the group's shared prompt run
#if defined(BATCHGEN_HAVE_TILES)
            if (use_tiles && s0[1] > 0)
                for (int64_t h = 0; h < Hkv; h++) {  // KV head h's queries in state order
                    qh.clear();
                    for (int64_t r = 0; r < nr; r++)
                        for (int64_t j = 0; j < g; j++) qh.push_back(q + rows[r] * q_ld + (h * g + j) * D);
                    qts[h].prepare(qh.data(), (int64_t)qh.size(), D);
                }
#endif
            for (int64_t a = 0; a < s0[1]; a += KB) {
                const int n = (int)std::min<int64_t>(KB, s0[1] - a);
                stream_in(kc, vc, s0[0] + a, n, ld);
                for (int64_t h = 0; h < Hkv; h++) {
#if defined(BATCHGEN_HAVE_TILES)
                    if (use_tiles) {
                        block_tiles(*bt, qts[h], (const uint16_t*)kc, (const uint16_t*)vc, s0[0] + a, n, h, Hq, g, D,
                                    ld, scale, nr, m, l, acc);
                        continue;
                    }
#endif
                    if constexpr (bf16)
                        block_bf16(*blk, kc, vc, s0[0] + a, n, h, qprep.data(), Hq, g, D, ld, scale, rows, nr, m, l,
                                   acc);
                    else
                        block_f32(*blk32, q, kc, vc, s0[0] + a, n, h, q_ld, Hq, g, D, ld, scale, rows, nr, m, l,
                                  acc);
                }
            }
            for (int64_t r = 0; r < nr; r++) {  // each row's own run, then its output
                const int64_t* s = seg + rows[r] * 4;
                for (int64_t a = 0; a < s[3]; a += KB) {
                    const int n = (int)std::min<int64_t>(KB, s[3] - a);
                    stream_in(kc, vc, s[2] + a, n, ld);
                    for (int64_t h = 0; h < Hkv; h++)
                        block<T>(up, MQ, q, kc, vc, s[2] + a, n, h, q_ld, Hq, g, D, ld, scale, rows + r, 1, r, m,
                                 l, acc);
                }
                for (int64_t j = 0; j < Hq; j++) {
                    const int64_t x = r * Hq + j;
                    float* o = out + (rows[r] * Hq + j) * D;
                    const float inv = l[x] > 0.f ? 1.f / l[x] : 0.f;
                    for (int64_t d = 0; d < D; d++) o[d] = acc[x * D + d] * inv;
                }
            }
        }
#if defined(BATCHGEN_HAVE_TILES)
        if (use_tiles) BG_TILE_RELEASE();
#endif
        _mm_setcsr(csr);
    }
    return 0;
}

}  // namespace

extern "C" {

// 1 when head_dim D is supported, else 0.
int batchgen_decode_attention_supports(int64_t D) { return pick<float>(D, 1) != nullptr; }

// See the file comment. q: row b's query heads at q + b * q_ld (Hq x D contiguous). kv_bf16:
// 0 when kc, vc are float32, 1 when bfloat16. When knew is not null, first stores this
// step's keys and values (float32): row b's knew + b * kv_ld and vnew + b * kv_ld (Hkv x D
// each) at arena position write[b] (b < B), which the caller puts inside the row's own run.
// tiles: 1 to run a bfloat16 arena's prompt blocks on AMX tiles (the caller verified them and
// Linux granted the tile state; ignored by builds without AMX). Returns 0, or -1 for an
// unsupported D (nothing written).
int batchgen_decode_attention(const float* q, int64_t q_ld, void* kc, void* vc, int kv_bf16, float* out,
                              const int64_t* seg, const int64_t* group_ptr, const int64_t* order, int64_t n_groups,
                              int64_t Hq, int64_t Hkv, int64_t D, float scale, int threads, const float* knew,
                              const float* vnew, int64_t kv_ld, const int64_t* write, int64_t B, int tiles) {
    if (kv_bf16)
        return attend<uint16_t>(q, q_ld, (uint16_t*)kc, (uint16_t*)vc, out, seg, group_ptr, order, n_groups, Hq, Hkv,
                                D, scale, threads, knew, vnew, kv_ld, write, B, tiles);
    return attend<float>(q, q_ld, (float*)kc, (float*)vc, out, seg, group_ptr, order, n_groups, Hq, Hkv, D, scale,
                         threads, knew, vnew, kv_ld, write, B, tiles);
}

}  // extern "C"
