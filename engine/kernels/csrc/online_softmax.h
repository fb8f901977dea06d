// The online-softmax step of decode attention (decode_attention.cpp's own runs,
// attention_bf16.h, attention_f32.h, attention_tiles.h) and of prefill attention (a row at a
// time, in order like an own run: prefill_attention.cpp): one function, so a query's softmax
// bits are the same whatever arithmetic produced its scores and whatever build runs it.
// Online softmax: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
// FlashAttention's block update (Dao et al. 2022).
#pragma once

#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace batchgen::attn {

constexpr int KB = 32;  // keys per block: decode_attention.cpp's

// The online-softmax step of NQ queries over a block's n <= KB scores (s + qi * KB, 64-byte
// aligned; whatever lanes past n hold is ignored): m' = max(m, the block's scores), s becomes
// p = exp(s - m') (+0 past n), corr = exp(m - m') (0 before the first key, when l and the
// output are 0), and l' = l corr + hsum8 of the block's p summed as 8-lane vectors, in a
// tree, (p[0:8] + p[8:16]) + (p[16:24] + p[24:32]) (a prompt run's blocks), or with Chain
// in order, ((p[0:8] + p[8:16]) + p[16:24]) + p[24:32] (a row's own run). The queries' steps
// are interleaved (each a chain of dependent operations) and their factors computed in one
// exp8; each query's arithmetic is the same whatever NQ.
//
// AVX-512 builds run it on 16-lane vectors: each lane's exponential is exp8's (exp16), the
// maximum is exact in any order (a zero's sign aside, which no exp(x - m') or exp(m - m')
// sees), and the sums take the same 8-lane halves in the same order, so every build gives
// the same bits. Half the instructions of the 8-lane version: on a CPU whose AVX-512 is
// full width (an AMX Xeon) the exponentials, which the tiles leave as much of a prompt
// block's cost as the products, take half the time; on the Zen 4 (two 256-bit halves) a
// prompt block's attention took 9% less time (bench/bench_attention.py's RL shape).
// The two parts of the step every build shares. The block's weights p, as four 8-lane
// vectors, summed in a tree or (Chain) in order:
template <bool Chain>
inline float block_sum(__m256 p0, __m256 p1, __m256 p2, __m256 p3) {
    return hsum8(Chain ? _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(p0, p1), p2), p3)
                       : _mm256_add_ps(_mm256_add_ps(p0, p1), _mm256_add_ps(p2, p3)));
}

// And each query's state past the block, its factors exp(m - m') computed in one exp8 (-inf
// - m' clamped like any score, and replaced by 0: no output yet to rescale):
template <int NQ>
inline void advance(const float* mold, const float* mnew, const float* sum, float* const* m, float* const* l,
                    float* corr) {
    alignas(32) float c[8];
    _mm256_store_ps(c, exp8(_mm256_sub_ps(_mm256_loadu_ps(mold), _mm256_loadu_ps(mnew))));
    for (int qi = 0; qi < NQ; qi++) {
        corr[qi] = mold[qi] == -INFINITY ? 0.f : c[qi];
        *l[qi] = *l[qi] * corr[qi] + sum[qi];
        *m[qi] = mnew[qi];
    }
}

#if defined(__AVX512F__)
template <int NQ, bool Chain = false>
inline void softmax_steps(float* s, int n, float* const* m, float* const* l, float* corr) {
    const __mmask16 valid0 = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __mmask16 valid1 = n >= 32 ? (__mmask16)0xffff : n <= 16 ? (__mmask16)0 : (__mmask16)((1u << (n - 16)) - 1);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    alignas(32) float mold[8] = {}, mnew[8] = {};
    __m512 x[NQ][2];
    for (int qi = 0; qi < NQ; qi++) {
        x[qi][0] = _mm512_mask_blend_ps(valid0, ninf, _mm512_load_ps(s + qi * KB));
        x[qi][1] = _mm512_mask_blend_ps(valid1, ninf, _mm512_load_ps(s + qi * KB + 16));
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(x[qi][0], x[qi][1]));
        mold[qi] = *m[qi];
        mnew[qi] = std::max(mold[qi], mx);
    }
    float sum[NQ];
    for (int qi = 0; qi < NQ; qi++) {
        const __m512 mv = _mm512_set1_ps(mnew[qi]);
        const __m512 p0 = _mm512_maskz_mov_ps(valid0, exp16(_mm512_sub_ps(x[qi][0], mv)));
        const __m512 p1 = _mm512_maskz_mov_ps(valid1, exp16(_mm512_sub_ps(x[qi][1], mv)));
        _mm512_store_ps(s + qi * KB, p0);
        _mm512_store_ps(s + qi * KB + 16, p1);
        sum[qi] = block_sum<Chain>(lo8(p0), hi8(p0), lo8(p1), hi8(p1));
    }
    advance<NQ>(mold, mnew, sum, m, l, corr);
}
#else
template <int NQ, bool Chain = false>
inline void softmax_steps(float* s, int n, float* const* m, float* const* l, float* corr) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 valid[4];
    for (int j = 0; j < 4; j++)
        valid[j] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * j), lanes));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    alignas(32) float mold[8] = {}, mnew[8] = {};
    __m256 x[NQ][4];
    for (int qi = 0; qi < NQ; qi++) {
        for (int j = 0; j < 4; j++) x[qi][j] = _mm256_blendv_ps(ninf, _mm256_load_ps(s + qi * KB + 8 * j), valid[j]);
        const float mx = hmax8(_mm256_max_ps(_mm256_max_ps(x[qi][0], x[qi][1]), _mm256_max_ps(x[qi][2], x[qi][3])));
        mold[qi] = *m[qi];
        mnew[qi] = std::max(mold[qi], mx);
    }
    float sum[NQ];
    for (int qi = 0; qi < NQ; qi++) {
        const __m256 mv = _mm256_set1_ps(mnew[qi]);
        __m256 p[4];
        for (int j = 0; j < 4; j++) {
            p[j] = _mm256_and_ps(exp8(_mm256_sub_ps(x[qi][j], mv)), valid[j]);
            _mm256_store_ps(s + qi * KB + 8 * j, p[j]);
        }
        sum[qi] = block_sum<Chain>(p[0], p[1], p[2], p[3]);
    }
    advance<NQ>(mold, mnew, sum, m, l, corr);
}
#endif

}  // namespace batchgen::attn
