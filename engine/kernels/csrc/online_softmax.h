// The online-softmax step of decode attention's prompt blocks (attention_bf16.h,
// attention_f32.h, attention_tiles.h): one function, so a query's softmax bits are the same
// whatever arithmetic produced its scores' inputs and whatever build runs it. Online
// softmax: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
// FlashAttention's block update (Dao et al. 2022).
#pragma once

#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace batchgen::attn {

constexpr int KB = 32;  // keys per block: decode_attention.cpp's

// The online-softmax step of NQ queries over a block's n <= KB scores (s + qi * KB, 64-byte
// aligned), in 8-lane float32 vectors in every build: m' = max(m, the block's scores), s
// becomes p = exp(s - m') (+0 past n), corr = exp(m - m') (0 before the first key, when l
// and the output are 0), l' = l corr + hsum8((p[0:8] + p[8:16]) + (p[16:24] + p[24:32])).
// The queries' steps are interleaved (each a chain of dependent operations) and their
// factors computed in one exp8; each query's arithmetic is the same whatever NQ.
template <int NQ>
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
    // exp(m - m') per query, -inf - m' clamped like any score (and replaced by 0 below)
    alignas(32) float c[8];
    _mm256_store_ps(c, exp8(_mm256_sub_ps(_mm256_load_ps(mold), _mm256_load_ps(mnew))));
    for (int qi = 0; qi < NQ; qi++) {
        const __m256 mv = _mm256_set1_ps(mnew[qi]);
        __m256 p[4];
        for (int j = 0; j < 4; j++) {
            p[j] = _mm256_and_ps(exp8(_mm256_sub_ps(x[qi][j], mv)), valid[j]);
            _mm256_store_ps(s + qi * KB + 8 * j, p[j]);
        }
        const float sum = hsum8(_mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3])));
        corr[qi] = mold[qi] == -INFINITY ? 0.f : c[qi];
        *l[qi] = *l[qi] * corr[qi] + sum;
        *m[qi] = mnew[qi];
    }
}

}  // namespace batchgen::attn
