// Decode attention's arithmetic over a bfloat16 KV arena's prompt runs (decode_attention.cpp):
// bfloat16 products summed in float32, in the order an AMX tile multiply sums them.
//
// Why: with bfloat16 GEMMs 1.5x (vdpbf16ps, Zen 4) to 4x (AMX) faster than float32 ones, a
// decode attention that widened bfloat16 keys and values to float32 arithmetic became half
// of a bfloat16 step on the RL shape (1,200-token prompts read by 16 samples each). Here
// the two products of attention over a prompt's keys, scores = q k^T and out = p v, take
// bfloat16 operands as the GEMMs do (gemm.cpp), so vdpbf16ps does two products per lane where
// an FMA does one, and the sequence is the one AMX tiles compute (attention_tiles.h).
// A block is arranged once for every query that reads it, which pays where a group's rows
// share the prompt (48 queries per KV head on the RL shape) and not for a row's own run (3):
// those keep decode_attention.cpp's float32 update of the widened keys and values. Each run
// kind has one arithmetic, so a row's bits do not depend on its group.
//
// The sequence, for one query of one KV head and a block of n <= KB keys (FlashAttention's
// block update, Dao et al. 2022; bfloat16 operands as its CPU and GPU kernels round them):
//   q is rounded to bfloat16 (as torch rounds), once per call;
//   score[i] = S * scale, where S = +0 and for each block of 32 elements of the head (d = 32 c
//     .. 32 c + 31; a head that is not a multiple of 32 padded with q = +0, k = -0):
//       e = o = +0; e = fma(q[2j], k[i, 2j], e), o = fma(q[2j+1], k[i, 2j+1], o) over the
//       block's pairs j in order; S = S + (e + o)
//   the online-softmax step (`softmax_steps`, float32): the running max m' = max(m, scores),
//     the weights p[i] = exp(score[i] - m'), the factor corr = exp(m - m'), the sum
//     l' = l corr + the block's p summed in a fixed tree;
//   p is rounded to bfloat16; then for each output element d:
//     e = o = +0; e = fma(p[2j], v[2j, d], e), o = fma(p[2j+1], v[2j+1, d], o) over the
//     block's key pairs in order (a short block's missing keys: p = +0, v = -0);
//     acc[d] = acc[d] * corr + (e + o)
// all with denormals read and written as zero (DAZ, FTZ: the thread's MXCSR is set for the
// whole call, in every build). That is gemm.cpp's bfloat16 sequence per 32-element block:
// TDPBF16PS's (Intel SDM; measured on an Emerald Rapids Xeon, tests/data/amx_tdpbf16ps.pt).
// Builds with AVX-512 BF16 feed vdpbf16ps two products of one partial sum per lane (gemm.cpp's
// `pair_k` arrangement of the query, keys, weights and values); the others compute the same
// bits with fused multiply-adds of the widened values (a bfloat16 product is exact in
// float32). A lane holds one key (scores) or one output element (p v), so the vector width
// never enters: every build gives the same bits, for any batch, group or thread count.
//
// The block's keys and values are arranged once per (group, KV head, block) for all the
// queries that read them (`Block::prepare`): transposed to a lane per key for the scores,
// and (with vdpbf16ps) paired by key for p v.
#pragma once

#include "online_softmax.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace batchgen::bf16attn {

using batchgen::exp8;
using batchgen::hsum8;
using batchgen::attn::softmax_steps;

constexpr int KB = attn::KB;  // keys per block: decode_attention.cpp's
constexpr int DMAX = 256;    // largest head size

using namespace batchgen::vec;

#if defined(__AVX512BF16__)
constexpr bool kNative = true;
#else
constexpr bool kNative = false;
#endif

constexpr int NK = KB / L;  // vectors per block of keys

inline int64_t padded(int64_t D) { return (D + 31) / 32 * 32; }   // a head's elements in whole blocks of 32
inline int64_t value_cols(int64_t D) { return (D + 15) / 16 * 16; }  // a block's value columns (whole vectors)

// 32 bfloat16 values in the order of `pair_k` (a plain copy without vdpbf16ps).
inline void arrange32(const uint16_t* in, uint16_t* out) {
    if (!kNative) {
        std::memcpy(out, in, 64);
        return;
    }
    for (int s = 0; s < 16; s++) {
        out[2 * s] = in[pair_k(s, 0)];
        out[2 * s + 1] = in[pair_k(s, 1)];
    }
}

// One query's D float32 elements as the products read them: rounded to bfloat16, padded with
// +0 to whole blocks of 32, each block arranged for vdpbf16ps (`arrange32`).
inline void prepare_query(const float* q, int64_t D, uint16_t* out) {
#if defined(__AVX512BF16__)
    if (D % 32 == 0) {
        const __m512i idx = arrange_index();
        for (int64_t c = 0; c < D; c += 32)
            _mm512_storeu_si512(out + c, round_arranged(_mm512_loadu_ps(q + c), _mm512_loadu_ps(q + c + 16), idx));
        return;
    }
#endif
    alignas(64) uint16_t b[32];
    for (int64_t c = 0; c < padded(D); c += 32) {
        for (int j = 0; j < 32; j++) b[j] = c + j < D ? f32_to_bf16(q[c + j]) : 0;
        arrange32(b, out + c);
    }
}

// One KV head's block of n <= KB keys and values as the products read them.
struct Block {
    // Scores: one lane per key. With vdpbf16ps: kp[16 c + s][i] is key i's pair s of
    // block c (`pair_k`); else kt[d][i] its element d widened. Keys past n are 0 (their
    // scores are dropped), elements past D -0 (their products leave a sum unchanged).
    // p v: one lane per output element. With vdpbf16ps: vp[s][d] pairs the values of keys
    // pair_k(s, 0) and pair_k(s, 1); else vt[i][d] is key i's value widened. Keys past n
    // are -0 (their weight p is +0).
    alignas(64) uint32_t kp[kNative ? DMAX / 2 : 1][KB];
    alignas(64) float kt[kNative ? 1 : DMAX][KB];
    alignas(64) uint32_t vp[kNative ? 16 : 1][DMAX];
    alignas(64) float vt[kNative ? 1 : KB][DMAX];

    // K[i * ld + d], V[i * ld + d]: the block's keys and values of one head, D elements.
    void prepare(const uint16_t* K, const uint16_t* V, int64_t ld, int n, int64_t D) {
        const int64_t Dp = padded(D), Dv = value_cols(D);
#if defined(__AVX512BF16__)
        // Keys: each key's block of 32 elements arranged in one vpermw (padded with -0 past
        // D), 16 keys' pairs transposed to a lane per key.
        const __m512i idx = arrange_index(), nz = _mm512_set1_epi16((short)BF16_NEG_ZERO);
        for (int64_t c = 0; c < Dp; c += 32) {
            const __mmask32 in = D - c >= 32 ? ~0u : (1u << (D - c)) - 1;
            for (int h = 0; h < NK; h++) {
                __m512i r[16];
                for (int u = 0; u < 16; u++) {
                    const int i = L * h + u;
                    r[u] = i >= n ? _mm512_setzero_si512()
                                  : _mm512_permutexvar_epi16(
                                        idx, _mm512_mask_blend_epi16(in, nz, _mm512_maskz_loadu_epi16(in, K + i * ld + c)));
                }
                transpose16(r);
                for (int s = 0; s < 16; s++) _mm512_store_si512(&kp[c / 2 + s][L * h], r[s]);
            }
        }
        // Values: pair s holds keys pair_k(s, 0) (low half) and pair_k(s, 1) (high), -0 past n.
        for (int s = 0; s < 16; s++) {
            const int i0 = pair_k(s, 0), i1 = pair_k(s, 1);
            for (int64_t d = 0; d < Dv; d += 16) {
                const __mmask16 in = D - d >= 16 ? 0xffff : (__mmask16)((1u << (D - d)) - 1);
                const __m512i lo = i0 >= n ? _mm512_set1_epi32(BF16_NEG_ZERO)
                                           : _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, V + i0 * ld + d));
                const __m512i hi = i1 >= n ? _mm512_set1_epi32(BF16_NEG_ZERO)
                                           : _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, V + i1 * ld + d));
                _mm512_store_si512(&vp[s][d], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
#else
        for (int64_t d = 0; d < Dp; d++)
            for (int i = 0; i < KB; i++) kt[d][i] = i >= n ? 0.f : d < D ? bf16_to_f32(K[i * ld + d]) : -0.f;
        for (int i = 0; i < KB; i++)
            for (int64_t d = 0; d < Dv; d++) vt[i][d] = i >= n ? -0.f : d < D ? bf16_to_f32(V[i * ld + d]) : 0.f;
#endif
    }
};

#if defined(__AVX512BF16__)
inline vf dp(vf acc, uint32_t pair, const uint32_t* b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)pair), (__m512bh)_mm512_load_si512(b));
}
#endif

// The scores of NQ queries (prepared, Dp elements each) against the block: s[qi * KB + i] =
// S * scale (all KB lanes; those past n are dropped by the softmax step).
template <int NQ>
inline void scores(const uint16_t* const* q, int64_t Dp, const Block& b, float scale, float* s) {
    vf S[NQ][NK];
    for (int qi = 0; qi < NQ; qi++)
        for (int h = 0; h < NK; h++) S[qi][h] = vzero();
    for (int64_t c = 0; c < Dp; c += 32) {
        vf e[NQ][NK], o[NQ][NK];
        for (int qi = 0; qi < NQ; qi++)
            for (int h = 0; h < NK; h++) e[qi][h] = o[qi][h] = vzero();
#if defined(__AVX512BF16__)
        for (int t = 0; t < 8; t++)
            for (int qi = 0; qi < NQ; qi++) {
                uint32_t pe, po;
                std::memcpy(&pe, q[qi] + c + 2 * t, 4);
                std::memcpy(&po, q[qi] + c + 16 + 2 * t, 4);
                for (int h = 0; h < NK; h++) {
                    e[qi][h] = dp(e[qi][h], pe, &b.kp[c / 2 + t][L * h]);
                    o[qi][h] = dp(o[qi][h], po, &b.kp[c / 2 + 8 + t][L * h]);
                }
            }
#else
        for (int j = 0; j < 16; j++) {
            const int64_t d = c + 2 * j;
            for (int qi = 0; qi < NQ; qi++) {
                const vf ae = vset(bf16_to_f32(q[qi][d])), ao = vset(bf16_to_f32(q[qi][d + 1]));
                for (int h = 0; h < NK; h++) {
                    e[qi][h] = vfma(ae, vload(&b.kt[d][L * h]), e[qi][h]);
                    o[qi][h] = vfma(ao, vload(&b.kt[d + 1][L * h]), o[qi][h]);
                }
            }
        }
#endif
        for (int qi = 0; qi < NQ; qi++)
            for (int h = 0; h < NK; h++) S[qi][h] = vadd(S[qi][h], vadd(e[qi][h], o[qi][h]));
    }
    const vf sv = vset(scale);
    for (int qi = 0; qi < NQ; qi++)
        for (int h = 0; h < NK; h++) vstore(s + qi * KB + L * h, vmul(S[qi][h], sv));
}

// The block's weights of one query (KB floats from the softmax step, +0 past n) as the p v
// products read them: rounded to bfloat16 and arranged (`arrange32`).
inline void prepare_weights(const float* s, uint16_t* out) {
#if defined(__AVX512BF16__)
    _mm512_store_si512(out, round_arranged(_mm512_load_ps(s), _mm512_load_ps(s + 16), arrange_index()));
#else
    alignas(64) uint16_t b[KB];
    for (int i = 0; i < KB; i++) b[i] = f32_to_bf16(s[i]);
    arrange32(b, out);
#endif
}

// acc[qi][d] = acc[qi][d] * corr[qi] + the block's p v, d < D, for NQ queries whose weights
// p[qi] were prepared (the block's columns past D, up to value_cols, are computed and dropped).
template <int NQ>
inline void accumulate(float* const* acc, const float* corr, const uint16_t* const* p, const Block& b, int64_t D) {
    const int64_t Dv = value_cols(D);
    constexpr int CB = L == 16 ? (NQ == 1 ? 4 : 2) : (NQ == 1 ? 2 : 1);  // column vectors per pass
    for (int64_t d0 = 0; d0 < Dv; d0 += CB * L) {
        const int nc = (int)std::min<int64_t>(CB, (Dv - d0) / L);
        vf e[NQ][CB], o[NQ][CB];
        for (int qi = 0; qi < NQ; qi++)
            for (int c = 0; c < CB; c++) e[qi][c] = o[qi][c] = vzero();
#if defined(__AVX512BF16__)
        for (int t = 0; t < 8; t++)
            for (int qi = 0; qi < NQ; qi++) {
                uint32_t pe, po;
                std::memcpy(&pe, p[qi] + 2 * t, 4);
                std::memcpy(&po, p[qi] + 16 + 2 * t, 4);
                for (int c = 0; c < nc; c++) {
                    e[qi][c] = dp(e[qi][c], pe, &b.vp[t][d0 + L * c]);
                    o[qi][c] = dp(o[qi][c], po, &b.vp[8 + t][d0 + L * c]);
                }
            }
#else
        for (int j = 0; j < KB / 2; j++)
            for (int qi = 0; qi < NQ; qi++) {
                const vf ae = vset(bf16_to_f32(p[qi][2 * j])), ao = vset(bf16_to_f32(p[qi][2 * j + 1]));
                for (int c = 0; c < nc; c++) {
                    e[qi][c] = vfma(ae, vload(&b.vt[2 * j][d0 + L * c]), e[qi][c]);
                    o[qi][c] = vfma(ao, vload(&b.vt[2 * j + 1][d0 + L * c]), o[qi][c]);
                }
            }
#endif
        for (int qi = 0; qi < NQ; qi++)
            for (int c = 0; c < nc; c++) {
                float* a = acc[qi] + d0 + L * c;
                const int64_t cols = D - (d0 + L * c);  // < L only for AVX-512's half vector
                if (cols >= L) {
                    vstore(a, vadd(vmul(vload(a), vset(corr[qi])), vadd(e[qi][c], o[qi][c])));
                } else {
#if defined(__AVX512F__)
                    const __mmask16 k = (__mmask16)((1u << cols) - 1);
                    const vf old = _mm512_maskz_loadu_ps(k, a);
                    _mm512_mask_storeu_ps(a, k, vadd(vmul(old, vset(corr[qi])), vadd(e[qi][c], o[qi][c])));
#endif
                }
            }
    }
}



}  // namespace batchgen::bf16attn
