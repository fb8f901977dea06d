// The pointwise and per-row operations of a Llama-family layer, fused, for x86-64 CPUs with
// AVX2 and FMA: RMSNorm (with the residual add before it), rotary embeddings (with Qwen3's
// per-head q/k RMSNorm before them) and SwiGLU's silu(gate) * up. AVX-512 builds run the
// elementwise parts 16 lanes wide with the same operations per element (the same bits); a
// row's sum of squares keeps its 8-lane order in every build.
//
// Built and loaded by engine/kernels/native.py with decode_attention.cpp, called through ctypes from
// engine/models/layers.py. In a decode step each is a single pass over a few hundred
// kilobytes that torch runs as 3-10 separate kernels (and as many temporaries): for SmolLM2
// at 128 rows these operations and the KV writes took 31 ms of a step as torch ops, 11 ms fused
// (bench/profile_step.py --model smollm2).
//
// Numerics follow transformers' float32 code (models/llama/modeling_llama.py): the same
// operations in the same order, except that the sum of squares of RMSNorm is accumulated in
// this file's own fixed order (`sum_squares`) and silu's exp is `exp8`: results agree with
// torch's to about 1e-7 relative. Batch invariance by construction: every element goes
// through the same instructions wherever it sits (a partial last vector too, see simd.h) and
// a row's reduction order depends only on its width; threads split rows, never a row. So a
// row's bits do not depend on how many rows the call has or on the thread count.
//
// Built with -ffp-contract=off: a * c - b * s stays two products and a difference, as torch
// computes it, rather than a fused multiply-add.
#include "simd.h"

#include <cmath>
#include <cstdint>

namespace {

using batchgen::exp8;
using batchgen::hsum8;
using batchgen::load_part;
using batchgen::store_part;

// out[0, n) = f(a[0, n), b[0, n)), a vector at a time, the partial last vector too: every
// element through the same instructions. out may be a or b. f is an elementwise functor
// with an 8-lane and (AVX-512 builds) a 16-lane form doing the same operations, so each
// element gets the same bits in every build.
template <class F>
inline void map2(const float* a, const float* b, float* out, int64_t n, F f) {
    int64_t i = 0;
#if defined(__AVX512F__)
    using batchgen::load_part16;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, f(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    if (i < n) batchgen::store_part16(out + i, f(load_part16(a + i, n - i), load_part16(b + i, n - i)), n - i);
#else
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, f(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    if (i < n) store_part(out + i, f(load_part(a + i, n - i), load_part(b + i, n - i)), n - i);
#endif
}

struct Add {
    __m256 operator()(__m256 a, __m256 b) const { return _mm256_add_ps(a, b); }
#if defined(__AVX512F__)
    __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
#endif
};

struct Scale {  // w * (x * r)
    float r;
    __m256 operator()(__m256 w, __m256 x) const { return _mm256_mul_ps(w, _mm256_mul_ps(x, _mm256_set1_ps(r))); }
#if defined(__AVX512F__)
    __m512 operator()(__m512 w, __m512 x) const { return _mm512_mul_ps(w, _mm512_mul_ps(x, _mm512_set1_ps(r))); }
#endif
};

// silu(g) * u = g * (1 / (1 + exp(-g))) * u. exp8 saturates at exp(88.38); below -88.38 the
// true sigmoid is under 4e-39: take 0 there, as torch does once exp(-g) overflows, rather
// than g / exp(88.38).
struct SiluMul {
    __m256 operator()(__m256 g, __m256 u) const {
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        __m256 sig = _mm256_div_ps(one, _mm256_add_ps(exp8(_mm256_sub_ps(zero, g)), one));
        sig = _mm256_blendv_ps(sig, zero, _mm256_cmp_ps(g, _mm256_set1_ps(-88.3762626647949f), _CMP_LT_OQ));
        return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
    }
#if defined(__AVX512F__)
    __m512 operator()(__m512 g, __m512 u) const {
        const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        __m512 sig = _mm512_div_ps(one, _mm512_add_ps(batchgen::exp16(_mm512_sub_ps(zero, g)), one));
        sig = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_set1_ps(-88.3762626647949f), _CMP_LT_OQ), sig, zero);
        return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
    }
#endif
};

// Sum of squares of x[0, n): four 8-lane accumulators (one would wait on each fused
// multiply-add's latency), combined and summed by hsum8 in a fixed order. The order depends
// only on n, so every row of width n is summed the same way.
inline float sum_squares(const float* x, int64_t n) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int u = 0; u < 4; u++) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * u);
            acc[u] = _mm256_fmadd_ps(v, v, acc[u]);
        }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
    }
    if (i < n) {
        const __m256 v = load_part(x + i, n - i);
        acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// out[0, n) = w * (x * 1/sqrt(mean(x^2) + eps)): transformers' `weight * (hidden * rsqrt(variance + eps))`.
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
    map2(w, x, out, n, Scale{1.0f / std::sqrt(sum_squares(x, n) / (float)n + eps)});
}

// Elements below which a call stays on one thread (waking the others costs more than they save).
constexpr int64_t kMinParallelElems = 1 << 16;

inline int team(int threads, int64_t elems) { return elems >= kMinParallelElems ? threads : 1; }

}  // namespace

extern "C" {

// RMSNorm of each row (Zhang & Sennrich 2019), after an optional residual add:
// xo = x + y (when y is not null; xo may be x), out = w * (xo * 1/sqrt(mean(xo^2) + eps)).
// x, y, xo, out: (rows, C) contiguous float32; w: (C,).
void batchgen_add_rms_norm(const float* x, const float* y, float* xo, const float* w, float* out, int64_t rows,
                           int64_t C, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(team(threads, rows * C))
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * C;
        if (y != nullptr) {
            map2(xr, y + r * C, xo + r * C, C, Add{});
            xr = xo + r * C;
        }
        rms_norm_row(xr, w, out + r * C, C, eps);
    }
}

// Rotary embedding, in place, of the first `heads` heads (D floats each) of every row of x:
// transformers' half-split convention, x[i], x[i + D/2] -> (a c - b s, b c + a s) with c, s
// the tables' row pos[r] (cos and sin of position * inv_freq, (positions, D/2), already
// scaled). When norm_w (heads, D) is not null, each head is first RMS-normed with its row
// of norm_w (Qwen3's q_norm / k_norm). x: rows of `ld` floats; pos: (rows,) int64, each
// within the tables (the caller checks).
void batchgen_rotary(float* x, int64_t rows, int64_t ld, int64_t heads, int64_t D, const float* cos,
                     const float* sin, const int64_t* pos, const float* norm_w, float eps, int threads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(team(threads, rows * heads * D))
    for (int64_t r = 0; r < rows; r++) {
        const float* c = cos + pos[r] * half;
        const float* s = sin + pos[r] * half;
        for (int64_t h = 0; h < heads; h++) {
            float* a = x + r * ld + h * D;
            if (norm_w != nullptr) rms_norm_row(a, norm_w + h * D, a, D, eps);
            float* b = a + half;
#if defined(__AVX512F__)
            for (int64_t i = 0; i < half; i += 16) {  // 16 lanes: the same operations per element
                const int64_t n = half - i < 16 ? half - i : 16;
                const __mmask16 mk = (__mmask16)((1u << n) - 1);
                const __m512 av = _mm512_maskz_loadu_ps(mk, a + i), bv = _mm512_maskz_loadu_ps(mk, b + i);
                const __m512 cv = _mm512_maskz_loadu_ps(mk, c + i), sv = _mm512_maskz_loadu_ps(mk, s + i);
                _mm512_mask_storeu_ps(a + i, mk, _mm512_sub_ps(_mm512_mul_ps(av, cv), _mm512_mul_ps(bv, sv)));
                _mm512_mask_storeu_ps(b + i, mk, _mm512_add_ps(_mm512_mul_ps(bv, cv), _mm512_mul_ps(av, sv)));
            }
#else
            for (int64_t i = 0; i < half; i += 8) {
                const int64_t n = half - i < 8 ? half - i : 8;
                const bool full = n == 8;
                const __m256 av = full ? _mm256_loadu_ps(a + i) : load_part(a + i, n);
                const __m256 bv = full ? _mm256_loadu_ps(b + i) : load_part(b + i, n);
                const __m256 cv = full ? _mm256_loadu_ps(c + i) : load_part(c + i, n);
                const __m256 sv = full ? _mm256_loadu_ps(s + i) : load_part(s + i, n);
                const __m256 ra = _mm256_sub_ps(_mm256_mul_ps(av, cv), _mm256_mul_ps(bv, sv));
                const __m256 rb = _mm256_add_ps(_mm256_mul_ps(bv, cv), _mm256_mul_ps(av, sv));
                if (full) {
                    _mm256_storeu_ps(a + i, ra);
                    _mm256_storeu_ps(b + i, rb);
                } else {
                    store_part(a + i, ra, n);
                    store_part(b + i, rb, n);
                }
            }
#endif
        }
    }
}

// SwiGLU's gating (Shazeer 2020): out[r, i] = silu(g) * u = g * (1 / (1 + exp(-g))) * u with
// g = gu[r, i], u = gu[r, I + i]. gu: (rows, 2I) contiguous (gate and up projections side by
// side), out: (rows, I) contiguous float32.
void batchgen_silu_mul(const float* gu, float* out, int64_t rows, int64_t I, int threads) {
#pragma omp parallel for schedule(static) num_threads(team(threads, rows * I))
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gu + r * 2 * I;
        map2(g, g + I, out + r * I, I, SiluMul{});
    }
}

}  // extern "C"
