// Decode attention's arithmetic over a float32 KV arena's prompt runs (decode_attention.cpp):
// a block of keys arranged once for every query of the group that reads it.
//
// Why: on the RL shape (1,200-token prompts read by 16 samples, 3 query heads per KV head) a
// group's prompt keys are read by 48 queries. decode_attention.cpp's `update`, which a
// row's own run keeps, computes a score as 16-lane partial sums of one key and one query
// and folds them horizontally: each product loads a key element and a query element, and
// the folds cost as much again. Here a block's keys are transposed once (a lane per key),
// so a score is one fused multiply-add chain per lane with the query element broadcast,
// and several queries share each load of the keys and of the values (the same layout as
// attention_bf16.h's, in float32 products). Each run kind has one arithmetic, so a row's
// bits do not depend on its group or on whether its prompt is shared.
//
// The sequence, for one query of one KV head and a block of n <= KB keys (FlashAttention's
// block update, Dao et al. 2022):
//   score[i] = S * scale, where S = fma(q[d], k[i, d], S) over d = 0 .. D-1 in order, from
//     S = +0;
//   the online-softmax step (online_softmax.h's `softmax_steps`);
//   for each output element d: a = acc[d] * corr, then a = fma(p[i], v[i, d], a) over the
//     block's keys i < n in order; acc[d] = a (decode_attention.cpp's float32 `accumulate`).
// A lane holds one key (scores) or one output element (p v), so the vector width never
// enters: every build gives the same bits, for any batch, group or thread count.
#pragma once

#include "online_softmax.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace batchgen::f32attn {

using namespace batchgen::vec;

constexpr int KB = attn::KB;  // keys per block: decode_attention.cpp's
constexpr int DMAX = 256;     // largest head size
constexpr int NK = KB / L;    // vectors per block of keys
// Queries per pass: NQ x NK score accumulators (8 registers of 32 with AVX-512, 12 of 16
// with AVX2); a query's bits are the same whatever NQ. Measured on a Zen 4, one layer of
// the RL shape (bench/bench_attention.py's rl, one thread): AVX-512, the prompt blocks
// alone, 4 queries 5.4 ms, 6 or 8 8.0 ms (their p v accumulators take 2 column passes);
// AVX2, the whole layer, 3 queries 7.4 ms, 2 8.4 ms.
constexpr int NQ = L == 16 ? 4 : 3;

// One KV head's block of n <= KB keys, a lane per key: kt[d][i] is key i's element d, 0 for
// keys past n (their scores are dropped by the softmax step).
struct Block {
    alignas(64) float kt[DMAX][KB];

    // K[i * ld + d]: the block's keys of one head, D elements (a multiple of 8).
    void prepare(const float* K, int64_t ld, int n, int64_t D) {
#if defined(__AVX512F__)
        for (int h = 0; h < NK; h++)
            for (int64_t c = 0; c < D; c += 16) {
                const int64_t w = std::min<int64_t>(16, D - c);  // 16, or 8 in a head's last half chunk
                const __mmask16 in = (__mmask16)((1u << w) - 1);
                __m512i r[16];
                for (int u = 0; u < 16; u++) {
                    const int i = 16 * h + u;
                    r[u] = i >= n ? _mm512_setzero_si512()
                                  : _mm512_castps_si512(_mm512_maskz_loadu_ps(in, K + i * ld + c));
                }
                transpose16(r);
                for (int s = 0; s < w; s++) _mm512_store_si512(&kt[c + s][16 * h], r[s]);
            }
#else
        for (int h = 0; h < NK; h++)
            for (int64_t c = 0; c < D; c += 8) {
                __m256 r[8];
                for (int u = 0; u < 8; u++) {
                    const int i = 8 * h + u;
                    r[u] = i >= n ? _mm256_setzero_ps() : _mm256_loadu_ps(K + i * ld + c);
                }
                transpose8(r);
                for (int s = 0; s < 8; s++) _mm256_store_ps(&kt[c + s][8 * h], r[s]);
            }
#endif
    }
};

// The scores of nq <= NQ queries (q[qi], D float32 elements each) against the block:
// s[qi * KB + i] = S * scale (all KB lanes; those past n are dropped by the softmax step).
template <int Q>
inline void scores(const float* const* q, int64_t D, const Block& b, float scale, float* s) {
    vf S[Q][NK];
    for (int qi = 0; qi < Q; qi++)
        for (int h = 0; h < NK; h++) S[qi][h] = vzero();
    for (int64_t d = 0; d < D; d++)
        for (int qi = 0; qi < Q; qi++) {
            const vf a = vset(q[qi][d]);
            for (int h = 0; h < NK; h++) S[qi][h] = vfma(a, vload(&b.kt[d][L * h]), S[qi][h]);
        }
    const vf sv = vset(scale);
    for (int qi = 0; qi < Q; qi++)
        for (int h = 0; h < NK; h++) vstore(s + qi * KB + L * h, vmul(S[qi][h], sv));
}

// One pass of `accumulate` over NC column vectors from column d0, the last one w <= L
// columns wide (masked where w < L; AVX-512 only, since D is a multiple of 8): NC and Q
// constant, so the Q x NC accumulators stay in registers.
template <int Q, int NC>
inline void accumulate_pass(float* const* acc, const float* corr, const float* p, const float* V, int64_t ld, int n,
                            int64_t d0, int64_t w) {
#if defined(__AVX512F__)
    const __mmask16 last = (__mmask16)((1u << w) - 1);
    auto load = [last](const float* x, int c) {
        return c == NC - 1 ? _mm512_maskz_loadu_ps(last, x) : _mm512_loadu_ps(x);
    };
#else
    (void)w;
    auto load = [](const float* x, int) { return vload(x); };
#endif
    vf a[Q][NC];
    for (int qi = 0; qi < Q; qi++)
        for (int c = 0; c < NC; c++) a[qi][c] = vmul(load(acc[qi] + d0 + L * c, c), vset(corr[qi]));
    for (int i = 0; i < n; i++) {
        const float* v = V + i * ld + d0;
        for (int c = 0; c < NC; c++) {
            const vf vv = load(v + L * c, c);
            for (int qi = 0; qi < Q; qi++) a[qi][c] = vfma(vset(p[qi * KB + i]), vv, a[qi][c]);
        }
    }
    for (int qi = 0; qi < Q; qi++)
        for (int c = 0; c < NC; c++) {
#if defined(__AVX512F__)
            if (c == NC - 1) {
                _mm512_mask_storeu_ps(acc[qi] + d0 + L * c, last, a[qi][c]);
                continue;
            }
#endif
            vstore(acc[qi] + d0 + L * c, a[qi][c]);
        }
}

// acc[qi][d] = acc[qi][d] * corr[qi] + sum_i p[qi][i] v_i[d] for the n values V + i * ld
// (d < D), as decode_attention.cpp's float32 `accumulate` computes it: each value vector is
// loaded once for the Q queries, CB column vectors per pass.
template <int Q>
inline void accumulate(float* const* acc, const float* corr, const float* p, const float* V, int64_t ld, int n,
                       int64_t D) {
    constexpr int CB = 4;  // Q x CB accumulators: 16 of 32 registers (AVX-512), 12 of 16 (AVX2)
    for (int64_t d0 = 0; d0 < D; d0 += CB * L) {
        const int nc = (int)std::min<int64_t>(CB, (D - d0 + L - 1) / L);
        const int64_t w = std::min<int64_t>(L, D - (d0 + L * (nc - 1)));  // the pass's last vector's columns
        switch (nc) {
            case 1: accumulate_pass<Q, 1>(acc, corr, p, V, ld, n, d0, w); break;
            case 2: accumulate_pass<Q, 2>(acc, corr, p, V, ld, n, d0, w); break;
            case 3: accumulate_pass<Q, 3>(acc, corr, p, V, ld, n, d0, w); break;
            default: accumulate_pass<Q, CB>(acc, corr, p, V, ld, n, d0, w); break;
        }
    }
}

// Q queries (q[qi], their running max m[qi], sum l[qi], unnormalised output acc[qi]) against
// the prepared block of n keys and the values V + i * ld.
template <int Q>
inline void queries(const Block& b, const float* const* q, const float* V, int64_t ld, int n, int64_t D, float scale,
                    float* const* m, float* const* l, float* const* acc) {
    alignas(64) float s[Q * KB];
    float corr[Q];
    scores<Q>(q, D, b, scale, s);
    attn::softmax_steps<Q>(s, n, m, l, corr);
    accumulate<Q>(acc, corr, s, V, ld, n, D);
}

}  // namespace batchgen::f32attn
