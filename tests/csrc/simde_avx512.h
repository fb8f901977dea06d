// AVX-512 intrinsics in software, for tests on CPUs without AVX-512 (tests/test_gemm.py):
// included first (-include) into a kernel source compiled for AVX2, it maps the _mm512_*
// names the source uses to SIMDe's portable versions (https://github.com/simd-everywhere/simde,
// Debian's libsimde-dev) and then defines the __AVX512*__ macros, so the source takes its
// AVX-512 paths. The intrinsics SIMDe 0.7.4 lacks are written out below, element by element,
// with the instruction's meaning (masked loads read only their lanes), and so are the ones it
// computes otherwise than the hardware: fused multiply-adds (a * b + c rounded twice there)
// and roundscale (its immediate misread), through the real 256-bit instructions. A kernel
// test that fails only on this build points here first: a missing or wrong intrinsic fails
// to compile (GCC's own refuses to inline without -mavx512f) or gives other bits.
#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>

static inline simde__mmask16 bg_cmpgt_epu32_mask(simde__m512i a, simde__m512i b) {
    uint32_t x[16], y[16];
    simde_mm512_storeu_si512(x, a);
    simde_mm512_storeu_si512(y, b);
    simde__mmask16 m = 0;
    for (int i = 0; i < 16; i++)
        if (x[i] > y[i]) m = (simde__mmask16)(m | (1u << i));
    return m;
}
static inline simde__m256i bg_cvtepi32_epi16(simde__m512i a) {  // truncation, vpmovdw
    int32_t x[16];
    int16_t y[16];
    simde_mm512_storeu_si512(x, a);
    for (int i = 0; i < 16; i++) y[i] = (int16_t)x[i];
    return simde_mm256_loadu_si256(y);
}
static inline simde__m512 bg_maskz_loadu_ps(simde__mmask16 k, const void* p) {
    float x[16];
    for (int i = 0; i < 16; i++) x[i] = (k >> i) & 1 ? ((const float*)p)[i] : 0.0f;
    return simde_mm512_loadu_ps(x);
}
static inline void bg_mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 v) {
    float x[16];
    simde_mm512_storeu_ps(x, v);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((float*)p)[i] = x[i];
}
static inline void bg_mask_storeu_epi16_256(void* p, simde__mmask16 k, simde__m256i v) {
    uint16_t x[16];
    simde_mm256_storeu_si256(x, v);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((uint16_t*)p)[i] = x[i];
}
static inline simde__m512i bg_maskz_loadu_epi16(simde__mmask32 k, const void* p) {
    uint16_t x[32];
    for (int i = 0; i < 32; i++) x[i] = (k >> i) & 1 ? ((const uint16_t*)p)[i] : 0;
    return simde_mm512_loadu_si512(x);
}
static inline simde__m512i bg_cvtepu16_epi32(simde__m256i a) {  // zero extension, vpmovzxwd
    uint16_t x[16];
    uint32_t y[16];
    simde_mm256_storeu_si256(x, a);
    for (int i = 0; i < 16; i++) y[i] = x[i];
    return simde_mm512_loadu_si512(y);
}
static inline simde__m512i bg_cvttps_epi32(simde__m512 a) {  // truncation; NaN and out of range: INT32_MIN
    float x[16];
    int32_t y[16];
    simde_mm512_storeu_ps(x, a);
    for (int i = 0; i < 16; i++)
        y[i] = (x[i] == x[i] && x[i] > -2147483904.0f && x[i] < 2147483648.0f) ? (int32_t)x[i] : INT32_MIN;
    return simde_mm512_loadu_si512(y);
}
static inline simde__m512 bg_zextps256_ps512(simde__m256 a) {  // upper half +0
    return simde_mm512_insertf32x8(simde_mm512_setzero_ps(), a, 0);
}
static inline float bg_reduce_max_ps(simde__m512 a) {  // GCC's tree (avx512fintrin.h), in AVX instructions
    float x[16];
    simde_mm512_storeu_ps(x, a);
    const __m256 t3 = _mm256_max_ps(_mm256_loadu_ps(x + 8), _mm256_loadu_ps(x));
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_extractf128_ps(t3, 0));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}
static inline simde__m256i bg_maskz_loadu_epi16_256(simde__mmask16 k, const void* p) {
    uint16_t x[16];
    for (int i = 0; i < 16; i++) x[i] = (k >> i) & 1 ? ((const uint16_t*)p)[i] : 0;
    return simde_mm256_loadu_si256(x);
}
// SIMDe 0.7.4 computes these as a * b + c, rounded twice: the kernels' sums are fused
// multiply-adds (one rounding), so each 256-bit half goes through the real vfmadd (-mfma)
// f on each 256-bit half of a, b and c
template <class F>
static inline simde__m512 bg_by_halves(simde__m512 a, simde__m512 b, simde__m512 c, F f) {
    float x[16], y[16], z[16];
    simde_mm512_storeu_ps(x, a);
    simde_mm512_storeu_ps(y, b);
    simde_mm512_storeu_ps(z, c);
    for (int h = 0; h < 16; h += 8)
        _mm256_storeu_ps(z + h, f(_mm256_loadu_ps(x + h), _mm256_loadu_ps(y + h), _mm256_loadu_ps(z + h)));
    return simde_mm512_loadu_ps(z);
}
static inline simde__m512 bg_fmadd_ps(simde__m512 a, simde__m512 b, simde__m512 c) {
    return bg_by_halves(a, b, c, [](__m256 x, __m256 y, __m256 z) { return _mm256_fmadd_ps(x, y, z); });
}
static inline simde__m512 bg_fnmadd_ps(simde__m512 a, simde__m512 b, simde__m512 c) {  // -(a b) + c
    return bg_by_halves(a, b, c, [](__m256 x, __m256 y, __m256 z) { return _mm256_fnmadd_ps(x, y, z); });
}
// SIMDe 0.7.4 misreads the immediate (_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC floored to
// halves): rounding to an integer (scale 0, the only one the kernels use) by the real vroundps
static inline simde__m512 bg_roundscale_ps(simde__m512 a, int imm) {
    if ((imm >> 4) != 0) __builtin_trap();  // a scale the kernels never use
    float x[16];
    simde_mm512_storeu_ps(x, a);
    for (int h = 0; h < 16; h += 8) {
        const __m256 v = _mm256_loadu_ps(x + h);
        __m256 r;
        switch (imm & 3) {
            case 0: r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); break;
            case 1: r = _mm256_round_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); break;
            case 2: r = _mm256_round_ps(v, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC); break;
            default: r = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC); break;
        }
        _mm256_storeu_ps(x + h, r);
    }
    return simde_mm512_loadu_ps(x);
}
#define _mm512_cmpgt_epu32_mask bg_cmpgt_epu32_mask
#define _mm512_cvtepi32_epi16 bg_cvtepi32_epi16
#define _mm512_maskz_loadu_ps bg_maskz_loadu_ps
#define _mm512_mask_storeu_ps bg_mask_storeu_ps
#define _mm256_mask_storeu_epi16 bg_mask_storeu_epi16_256
#define _mm512_maskz_loadu_epi16 bg_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 bg_maskz_loadu_epi16_256
#define _mm512_cvtepu16_epi32 bg_cvtepu16_epi32
#define _mm512_cvttps_epi32 bg_cvttps_epi32
#define _mm512_zextps256_ps512 bg_zextps256_ps512
#define _mm512_reduce_max_ps bg_reduce_max_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps bg_fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps bg_fnmadd_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps bg_roundscale_ps

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512DQ__ 1
#define __AVX512VL__ 1
