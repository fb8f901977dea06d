// SIMD helpers the compiled kernels share (AVX2 + FMA): an expf for 8 lanes, horizontal sums,
// and the lane mask of a row's last, partial vector.
//
// Why the kernels are batch-invariant: each element (or row) goes through the same
// instructions wherever it sits in the tensor. A row's partial last vector is loaded with
// `load_part` (the missing lanes read as 0) and stored with `store_part`, never computed by
// a scalar loop, so an element in a tail gets the bits it would get in a full vector.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace batchgen {

// float32 to bfloat16, rounding to nearest even, NaN to 0x7fc0: c10::BFloat16's conversion,
// so a stored bfloat16 equals torch's `.to(torch.bfloat16)` of the same float.
inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// bfloat16 to float32: exact (its 16 bits become the top half).
inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

constexpr uint16_t BF16_NEG_ZERO = 0x8000;  // -0: its products leave a sum unchanged (x + -0 = x)
constexpr unsigned MXCSR_FTZ_DAZ = 0x8040u;  // flush-to-zero (bit 15), denormals-are-zero (bit 6)

// The bfloat16 sequence's blocks of 32 elements as vdpbf16ps takes them (gemm.cpp, decode
// attention): the element, from the block's first, of half `half` of pair s (0..15). Pair i < 8
// holds (4i + 2, 4i), pair 8 + i holds (4i + 3, 4i + 1); vdpbf16ps adds element 1's product
// first, so pair i adds a[4i] b[4i], then a[4i+2] b[4i+2], to the even partial sum, in order,
// and pair 8 + i does the same for the odd one.
constexpr int pair_k(int s, int half) { return 4 * (s % 8) + s / 8 + (half == 0 ? 2 : 0); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 float32 to bfloat16 in one vector, bit for bit as f32_to_bf16 rounds (nearest even;
// NaN to 0x7fc0).
inline __m256i round16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
}

// 32 float32 (two vectors) rounded as round16, in order: lo's 16, then hi's.
inline __m512i round32(__m512 lo, __m512 hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(round16(lo)), round16(hi), 1);
}

// A block of 32 bfloat16 into the order of `pair_k` in one vpermw: lane 2s of the result
// takes element pair_k(s, 0), lane 2s + 1 element pair_k(s, 1).
struct ArrangeTable {
    alignas(64) uint16_t idx[32];
    constexpr ArrangeTable() : idx() {
        for (int s = 0; s < 16; s++) {
            idx[2 * s] = (uint16_t)pair_k(s, 0);
            idx[2 * s + 1] = (uint16_t)pair_k(s, 1);
        }
    }
};
inline constexpr ArrangeTable kArrange{};
inline __m512i arrange_index() { return _mm512_load_si512(kArrange.idx); }

// 32 float32 rounded (round32), then arranged by `pair_k`.
inline __m512i round_arranged(__m512 lo, __m512 hi, __m512i idx) {
    return _mm512_permutexvar_epi16(idx, round32(lo, hi));
}

// The lanes [0, n) of a block of 32 (n may be <= 0 or past 32): masked loads read nothing
// outside them (and never fault there), so a row's tail needs no copy.
inline __mmask32 first_lanes32(int64_t n) {
    return n >= 32 ? (__mmask32)0xffffffffu : n <= 0 ? (__mmask32)0 : (__mmask32)((1u << n) - 1);
}
#endif

// exp(x) for 8 floats: Cephes' expf (range reduction by ln 2 split in two constants, a
// degree-6 polynomial; about 1 ulp on the inputs softmax gives it, x <= 0).
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// exp8's arithmetic on 16 lanes: the same operations in the same order, so each lane gets
// exp8's bits (the AVX-512 builds' elementwise kernels must equal the AVX2 build's).
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// A 16-lane vector's lanes 0-7 and 8-15 (AVX-512F only: no DQ extract).
inline __m256 lo8(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 hi8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// In place: r[i] lane j becomes r[j] lane i (a 16 x 16 matrix of 32-bit elements).
inline void transpose16(__m512i (&r)[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);      // per 128-bit lane L: r_i[4L], r_i+1[4L], r_i[4L+1], ...
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  // r_i[4L+2], r_i+1[4L+2], r_i[4L+3], r_i+1[4L+3]
    }
    for (int g = 0; g < 4; g++) {  // b[4g + k], lane L: rows 4g .. 4g+3 of column 4L + k
        b[4 * g + 0] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
        b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i clo = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x44), chi = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xee);
        const __m512i dlo = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x44);
        const __m512i dhi = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xee);
        r[k] = _mm512_shuffle_i32x4(clo, dlo, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(clo, dlo, 0xdd);
        r[8 + k] = _mm512_shuffle_i32x4(chi, dhi, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(chi, dhi, 0xdd);
    }
}

// The first n (< 16) floats at p, zeros after them; and the first n lanes of v stored at p.
inline __m512 load_part16(const float* p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline void store_part16(float* p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
#endif

// In place: r[i] lane j becomes r[j] lane i (an 8 x 8 matrix of floats).
inline void transpose8(__m256 (&r)[8]) {
    __m256 a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // per 128-bit half H: r_i[4H], r_i+1[4H], r_i[4H+1], r_i+1[4H+1]
        a[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // r_i[4H+2], r_i+1[4H+2], r_i[4H+3], r_i+1[4H+3]
    }
    for (int g = 0; g < 2; g++) {  // b[4g + k], half H: rows 4g .. 4g+3 of column 4H + k
        b[4 * g + 0] = _mm256_shuffle_ps(a[4 * g], a[4 * g + 2], 0x44);
        b[4 * g + 1] = _mm256_shuffle_ps(a[4 * g], a[4 * g + 2], 0xee);
        b[4 * g + 2] = _mm256_shuffle_ps(a[4 * g + 1], a[4 * g + 3], 0x44);
        b[4 * g + 3] = _mm256_shuffle_ps(a[4 * g + 1], a[4 * g + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(b[k], b[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(b[k], b[4 + k], 0x31);
    }
}

// The largest of 8 floats (a max tree in registers; max is exact, so any order gives the
// same value for ordered inputs).
inline float hmax8(__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4e));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xb1));
    return _mm256_cvtss_f32(v);
}

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Sum of each of 8 vectors, as one vector: lane i is the sum of v[i]'s 8 lanes.
inline __m256 hsum8x8(const __m256* v) {
    const __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a01, a23), b1 = _mm256_hadd_ps(a45, a67);
    // b0 = [v0lo v1lo v2lo v3lo | v0hi v1hi v2hi v3hi] (partial sums), b1 likewise for v4..v7
    const __m256 lo = _mm256_permute2f128_ps(b0, b1, 0x20), hi = _mm256_permute2f128_ps(b0, b1, 0x31);
    return _mm256_add_ps(lo, hi);
}

// A row's partial last vector: the first n (< 8) floats at p with zeros after them, and
// the first n lanes of v stored at p. Through a stack buffer: AMD's masked moves
// (vmaskmovps) are microcoded and cost more than the arithmetic they feed.
inline __m256 load_part(const float* p, int64_t n) {
    alignas(32) float b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < n; i++) b[i] = p[i];
    return _mm256_load_ps(b);
}

inline void store_part(float* p, __m256 v, int64_t n) {
    alignas(32) float b[8];
    _mm256_store_ps(b, v);
    for (int64_t i = 0; i < n; i++) p[i] = b[i];
}

// One ISA's float vector for kernels written once for both widths (gemm.cpp, attention_bf16.h,
// attention_f32.h):
// 16 lanes with AVX-512, 8 with AVX2; loads and stores unaligned.
namespace vec {
#if defined(__AVX512F__)
using vf = __m512;
using vi = __m512i;
constexpr int L = 16;  // float lanes
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vi viload(const void* p) { return _mm512_loadu_si512(p); }
inline vf vlo16(vi p) { return _mm512_castsi512_ps(_mm512_slli_epi32(p, 16)); }  // bf16 in the low half
inline vf vhi16(vi p) { return _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32((int)0xffff0000u))); }
#else
using vf = __m256;
using vi = __m256i;
constexpr int L = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vi viload(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline vf vlo16(vi p) { return _mm256_castsi256_ps(_mm256_slli_epi32(p, 16)); }
inline vf vhi16(vi p) { return _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32((int)0xffff0000u))); }
#endif
}  // namespace vec

}  // namespace batchgen
