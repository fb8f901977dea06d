// The engine's CPU matrix multiply: y = x W^T (+ bias) for every projection and the output
// head, with the reduction order defined here rather than by a library.
//
// Why own it: a sample's logits must not depend on how many rows share its step, on the
// thread count, or on the CPU. oneDNN and MKL choose kernels, blockings and K splits by
// shape and instruction set (measured: rows move with the row count on AVX-512 Xeons and at
// M = 1 on EPYC), so their rows are reproducible only where they happen to be. Here every
// output element is one fixed sequence of rounded operations over K in order, started from
// +0, then the bias added:
//     float32:  acc = fma(x[m, k], w[n, k], acc)                            for k = 0, 1, ...
//     bfloat16: for each block of 16 pairs (k = 32 b .. 32 b + 31, the last block shorter):
//                   e = o = +0
//                   e = fma(x[m, 2j], w[n, 2j], e); o = fma(x[m, 2j+1], w[n, 2j+1], o)  for the block's j
//                   acc = acc + (e + o)
//               with denormals read and written as zero (DAZ, FTZ) throughout
// The bfloat16 sequence is what an AMX tile multiply (TDPBF16PS, 16 pairs a tile row) does:
// the Intel SDM's pseudo-code (even and odd partial sums, added, then added to the output),
// measured bit for bit on an Intel Xeon (Emerald Rapids): the 500 cases of the AMX probe
// (engine/kernels/amx_probe.py; random, special values, wide exponents, cancellations,
// products that flush) gave the same bits as this sequence in both pair orders, and are kept
// as tests/data/amx_tdpbf16ps.pt for every build to reproduce. vdpbf16ps (AVX-512 BF16) adds
// a pair's two products to one sum (odd first), so the avx512_bf16 kernel feeds it two pairs
// of one partial sum instead: its packed weight holds, per block, the even sum's elements
// as pairs (k = 4i+2, 4i) and the odd sum's as (4i+3, 4i+1), and the activations of a call
// are arranged the same way once per call. CPUs without it compute the same bits with fused
// multiply-adds under DAZ and FTZ. A lane holds one output column, so the vector width (8
// lanes on AVX2, 16 on AVX-512), the register tile, the thread split and the row count change
// which element is computed when, never how: a row's bits are the same on every x86-64 CPU
// with FMA, for any batch, on any number of threads. The `amx` build adds gemm_amx.cpp: the
// bfloat16 sequence on AMX tiles, with its own packed layout, used only where
// engine/kernels/native.py verified it bit for bit against this file's vdpbf16ps kernel at
// first use.
//
// Layout (BLIS's, Van Zee & van de Geijn 2015): the weight is packed once into panels of NR
// output columns, panel p holding columns [p NR, p NR + NR) (zero past N) as K rows of NR
// floats (bfloat16 without vdpbf16ps: K/2 rows of NR pairs (w[n, 2j], w[n, 2j+1]); with it,
// the partial sums' pairs above, K padded to a multiple of 32 with -0, whose products leave a sum
// alone). A micro-kernel keeps an MR x NR tile of y in registers over the whole of K,
// broadcasting x[m, k] from the row-major activations and loading NR weights per k; the
// panel stays in L2 while the kernel walks down the rows of a block of MC rows. Threads
// take contiguous ranges of (row block, panel) pairs.
#include "simd.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using batchgen::f32_to_bf16;
using batchgen::bf16_to_f32;
using batchgen::BF16_NEG_ZERO;
using batchgen::MXCSR_FTZ_DAZ;
using batchgen::pair_k;
#if defined(__AVX512F__) && defined(__AVX512BW__)
using batchgen::arrange_index;
using batchgen::first_lanes32;
using batchgen::round32;
#endif

// ---------------------------------------------------------------- vectors of one ISA
using namespace batchgen::vec;
#if defined(__AVX512F__)
constexpr int MR_F32 = 8, NV_F32 = 3;      // 8 x 48 tile: 24 accumulators of 32 registers
constexpr int MR_BF16 = 3, NV_BF16 = 3;    // bf16: the running sum and two partial sums: 27 registers
constexpr int MR_EMU = 4, NV_EMU = 2;      // emulated bf16: 8 sums, 16 partial sums, 4 weight vectors
#else
constexpr int MR_F32 = 4, NV_F32 = 3;      // 4 x 24 tile: 12 accumulators of 16 registers
constexpr int MR_BF16 = 4, NV_BF16 = 2;    // (bf16 on AVX2 is always emulated)
constexpr int MR_EMU = 2, NV_EMU = 2;      // 8 partial sums, 4 weight vectors, 2 broadcasts
#endif

#if defined(__AVX512BF16__)
constexpr bool kNativeBf16 = true;
#else
constexpr bool kNativeBf16 = false;
#endif

constexpr int NR_F32 = NV_F32 * L;
constexpr int NR_BF16 = kNativeBf16 ? NV_BF16 * L : NV_EMU * L;  // columns per bf16 panel
constexpr int64_t MC = 256;  // rows per block: a block of activations stays in L2 across panels
constexpr int64_t KB = 32;              // k per block of the bfloat16 sequence (16 pairs: an AMX tile row)

// With vdpbf16ps, K is padded to whole blocks (packed weights and arranged activations).
inline int64_t k_padded(int64_t K) { return kNativeBf16 ? (K + KB - 1) / KB * KB : K; }

enum Dtype : int { F32 = 0, BF16 = 1 };


// The output tile's epilogue, shared by every kernel: bias, then the store (float32, or
// bfloat16 rounded as torch rounds), `cols` of the tile's NV * L columns (a panel past N
// holds zeros and is not stored).
template <int MR, int NV>
inline void store_tile(vf (&acc)[MR][NV], const float* bias, void* y, int64_t ldy, int out_dtype, int cols) {
    if (bias != nullptr) {
        alignas(64) float b[NV * L] = {};
        std::memcpy(b, bias, cols * sizeof(float));
        for (int v = 0; v < NV; v++) {
            const vf bv = vload(b + v * L);
            for (int r = 0; r < MR; r++) acc[r][v] = vadd(acc[r][v], bv);
        }
    }
    alignas(64) float t[NV * L];
    for (int r = 0; r < MR; r++) {
        if (out_dtype == F32 && cols == NV * L) {
            float* yr = (float*)y + r * ldy;
            for (int v = 0; v < NV; v++) vstore(yr + v * L, acc[r][v]);
            continue;
        }
        for (int v = 0; v < NV; v++) vstore(t + v * L, acc[r][v]);
        if (out_dtype == F32) {
            std::memcpy((float*)y + r * ldy, t, cols * sizeof(float));
        } else {
            uint16_t* yr = (uint16_t*)y + r * ldy;
            for (int c = 0; c < cols; c++) yr[c] = f32_to_bf16(t[c]);
        }
    }
}

// ---------------------------------------------------------------- micro-kernels
// Each computes an R x NV*L tile of y: rows [0, R) of x (row m at x + m * ldx) against one
// packed panel over all of K. R < MR serves a row block's last, short tile.

template <int MR, int NV>
void kernel_f32(const float* x, int64_t ldx, int64_t K, const float* panel, const float* bias, void* y, int64_t ldy,
                int out_dtype, int cols) {
    const float* xr[MR];
    for (int r = 0; r < MR; r++) xr[r] = x + r * ldx;
    vf acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = vzero();
    for (int64_t k = 0; k < K; k++) {
        const float* w = panel + k * NV * L;
        vf b[NV];
        for (int v = 0; v < NV; v++) b[v] = vload(w + v * L);
        for (int r = 0; r < MR; r++) {
            const vf a = vset(xr[r][k]);
            for (int v = 0; v < NV; v++) acc[r][v] = vfma(a, b[v], acc[r][v]);
        }
    }
    store_tile<MR, NV>(acc, bias, y, ldy, out_dtype, cols);
}

#if defined(__AVX512BF16__)
// vdpbf16ps: per lane, s = (s + a_1 b_1) + a_0 b_0, each add rounded, DAZ and FTZ. x: the
// call's activations arranged as the panel is (`prepare_rows`: per block, the even sum's
// 8 pairs, then the odd sum's), K a multiple of 32.
template <int MR, int NV>
inline void chain_step(const uint16_t* const (&xr)[MR], int64_t k, const uint16_t* w, vf (&part)[MR][NV]) {
    __m512bh b[NV];
    for (int v = 0; v < NV; v++) b[v] = (__m512bh)_mm512_loadu_si512(w + v * L * 2);
    for (int r = 0; r < MR; r++) {
        int32_t pair;
        std::memcpy(&pair, xr[r] + k, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < NV; v++) part[r][v] = _mm512_dpbf16_ps(part[r][v], a, b[v]);
    }
}

template <int MR, int NV>
void kernel_bf16(const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* panel, const float* bias, void* y,
                 int64_t ldy, int out_dtype, int cols) {
    const uint16_t* xr[MR];
    for (int r = 0; r < MR; r++) xr[r] = x + r * ldx;
    vf acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = vzero();
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | MXCSR_FTZ_DAZ);  // the partial sums' adds flush as vdpbf16ps does
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        vf even[MR][NV], odd[MR][NV];
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NV; v++) even[r][v] = odd[r][v] = vzero();
        const uint16_t* wb = panel + k0 * NV * L;
        for (int s = 0; s < 8; s++) {
            chain_step<MR, NV>(xr, k0 + 2 * s, wb + s * NV * L * 2, even);
            chain_step<MR, NV>(xr, k0 + 16 + 2 * s, wb + (s + 8) * NV * L * 2, odd);
        }
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NV; v++) acc[r][v] = vadd(acc[r][v], vadd(even[r][v], odd[r][v]));
    }
    _mm_setcsr(csr);
    store_tile<MR, NV>(acc, bias, y, ldy, out_dtype, cols);
}
#endif

// The same sequence without vdpbf16ps: fused multiply-adds into the two partial sums, with
// the thread's MXCSR set to DAZ | FTZ for them (vdpbf16ps and TDPBF16PS ignore MXCSR and
// always flush) and restored for the bias and the store.
template <int MR, int NV>
void kernel_bf16_emulated(const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* panel, const float* bias,
                          void* y, int64_t ldy, int out_dtype, int cols) {
    const uint16_t* xr[MR];
    for (int r = 0; r < MR; r++) xr[r] = x + r * ldx;
    vf acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = vzero();
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | MXCSR_FTZ_DAZ);
    for (int64_t j0 = 0; j0 < K / 2; j0 += KB / 2) {
        vf even[MR][NV], odd[MR][NV];
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NV; v++) even[r][v] = odd[r][v] = vzero();
        const int64_t j1 = std::min<int64_t>(K / 2, j0 + KB / 2);
        for (int64_t j = j0; j < j1; j++) {
            const uint16_t* w = panel + j * NV * L * 2;
            vf be[NV], bo[NV];
            for (int v = 0; v < NV; v++) {
                const vi p = viload(w + v * L * 2);
                be[v] = vlo16(p);
                bo[v] = vhi16(p);
            }
            for (int r = 0; r < MR; r++) {
                const vf ae = vset(bf16_to_f32(xr[r][2 * j])), ao = vset(bf16_to_f32(xr[r][2 * j + 1]));
                for (int v = 0; v < NV; v++) {
                    even[r][v] = vfma(ae, be[v], even[r][v]);
                    odd[r][v] = vfma(ao, bo[v], odd[r][v]);
                }
            }
        }
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NV; v++) acc[r][v] = vadd(acc[r][v], vadd(even[r][v], odd[r][v]));
    }
    _mm_setcsr(csr);
    store_tile<MR, NV>(acc, bias, y, ldy, out_dtype, cols);
}

// ---------------------------------------------------------------- driver
template <class T>
using Kernel = void (*)(const T*, int64_t, int64_t, const T*, const float*, void*, int64_t, int, int);

// The kernels for tiles of 1 .. MR rows.
template <class T, int NV, template <int, int> class Pick, int... R>
constexpr auto tiles(std::integer_sequence<int, R...>) {
    return std::array<Kernel<T>, sizeof...(R)>{Pick<R + 1, NV>::fn...};
}
template <int R, int NV> struct F32K { static constexpr Kernel<float> fn = kernel_f32<R, NV>; };
template <int R, int NV> struct EmuK { static constexpr Kernel<uint16_t> fn = kernel_bf16_emulated<R, NV>; };
#if defined(__AVX512BF16__)
template <int R, int NV> struct Bf16K { static constexpr Kernel<uint16_t> fn = kernel_bf16<R, NV>; };
#endif

// A call's bfloat16 activations as its kernel reads them, rows [m0, m1) into out (rows Kp
// apart): float32 rows rounded to bfloat16 as torch rounds them; with vdpbf16ps, arranged per
// block as the packed weight's pairs (`pair_k`), K padded with +0 to Kp.
enum Prep : int { AS_IS = 0, FROM_BF16 = 1, FROM_F32 = 2 };
inline void prepare_rows(const void* x, int prep, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int64_t Kp,
                         uint16_t* out) {
#if defined(__AVX512BF16__)
    // vdpbf16ps: a block of 32 at a time, rounded (round32: f32_to_bf16's bits) and arranged
    // (one vpermw), its tail past K loaded as +0 (which rounds to +0).
    const __m512i idx = arrange_index();
    for (int64_t m = m0; m < m1; m++) {
        const float* xf = (const float*)x + m * ldx;
        const uint16_t* xb = (const uint16_t*)x + m * ldx;
        uint16_t* o = out + m * Kp;
        for (int64_t k0 = 0; k0 < Kp; k0 += KB) {
            const __mmask32 in = first_lanes32(K - k0);
            const __m512i v = prep == FROM_F32
                                  ? round32(_mm512_maskz_loadu_ps((__mmask16)in, xf + k0),
                                            _mm512_maskz_loadu_ps((__mmask16)(in >> 16), xf + k0 + 16))
                                  : _mm512_maskz_loadu_epi16(in, xb + k0);
            _mm512_storeu_si512(o + k0, _mm512_permutexvar_epi16(idx, v));
        }
    }
#else
    // the fused multiply-add emulation reads the rows as they are: rounded, not arranged
    for (int64_t m = m0; m < m1; m++) {
        const float* xf = (const float*)x + m * ldx;
        const uint16_t* xb = (const uint16_t*)x + m * ldx;
        uint16_t* o = out + m * Kp;
        for (int64_t k = 0; k < K; k++) o[k] = prep == FROM_F32 ? f32_to_bf16(xf[k]) : xb[k];
    }
#endif
}

// The prepared activations of a call, once per call: every thread reads them all.
thread_local std::vector<uint16_t> prepared;

template <class T, int MR, int NV, template <int, int> class Pick>
void run(const T* x, int64_t ldx, int64_t M, int64_t K, const T* packed, int64_t N, int64_t panel_elems,
         const float* bias, void* y, int64_t ldy, int out_dtype, int threads, int prep = AS_IS) {
    static constexpr auto kern = tiles<T, NV, Pick>(std::make_integer_sequence<int, MR>{});
    constexpr int NR = NV * L;
    const int64_t P = (N + NR - 1) / NR, blocks = (M + MC - 1) / MC, units = blocks * P;
    const int64_t osize = out_dtype == F32 ? 4 : 2;
    // A small product is not worth waking a second thread (the result does not depend on it).
    const double flops = 2.0 * (double)M * (double)N * (double)K;
    const int team = flops < 4e6 ? 1 : (int)std::min<int64_t>(threads, units);
    const T* src = x;
    const int64_t ldsrc = ldx, Kp = prep == AS_IS ? K : k_padded(K);
    if (prep != AS_IS) {
        prepared.resize(M * Kp);
        x = (const T*)prepared.data();
        ldx = Kp;
    }
    uint16_t* buf = prepared.data();
#pragma omp parallel num_threads(team)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (prep != AS_IS) {
            prepare_rows(src, prep, ldsrc, M * t / nt, M * (t + 1) / nt, K, Kp, buf);
#pragma omp barrier
        }
        const int64_t lo = units * t / nt, hi = units * (t + 1) / nt;
        for (int64_t u = lo; u < hi; u++) {
            const int64_t blk = u / P, p = u % P;
            const int64_t m0 = blk * MC, m1 = std::min(M, m0 + MC), n0 = p * NR;
            const int cols = (int)std::min<int64_t>(NR, N - n0);
            const T* panel = packed + p * panel_elems;
            const float* bp = bias == nullptr ? nullptr : bias + n0;
            for (int64_t m = m0; m < m1; m += MR) {
                const int64_t rows = std::min<int64_t>(MR, m1 - m);
                kern[rows - 1](x + m * ldx, ldx, Kp, panel, bp, (char*)y + (m * ldy + n0) * osize, ldy, out_dtype,
                               cols);
            }
        }
    }
}

}  // namespace

extern "C" {

// Lanes of the float vectors this build uses (8: AVX2, 16: AVX-512) and 1 when bfloat16
// products use vdpbf16ps (AVX-512 BF16), else 0.
int batchgen_gemm_lanes(void) { return L; }
int batchgen_gemm_native_bf16(void) { return kNativeBf16 ? 1 : 0; }

// Bytes of the packed form of an (N, K) weight of `dtype` (0 float32, 1 bfloat16; K even).
int64_t batchgen_gemm_packed_bytes(int64_t N, int64_t K, int dtype) {
    if (dtype == F32) return (N + NR_F32 - 1) / NR_F32 * NR_F32 * K * 4;
    return (N + NR_BF16 - 1) / NR_BF16 * NR_BF16 * k_padded(K) * 2;
}

// Pack w (N, K), rows ldw elements apart, into out (batchgen_gemm_packed_bytes bytes).
void batchgen_gemm_pack(const void* w, int64_t ldw, int64_t N, int64_t K, int dtype, void* out) {
    if (dtype == F32) {
        const float* src = (const float*)w;
        float* dst = (float*)out;
        const int64_t P = (N + NR_F32 - 1) / NR_F32;
        for (int64_t p = 0; p < P; p++)
            for (int64_t k = 0; k < K; k++)
                for (int c = 0; c < NR_F32; c++) {
                    const int64_t n = p * NR_F32 + c;
                    dst[(p * K + k) * NR_F32 + c] = n < N ? src[n * ldw + k] : 0.f;
                }
        return;
    }
    const uint16_t* src = (const uint16_t*)w;
    uint16_t* dst = (uint16_t*)out;
    const int64_t P = (N + NR_BF16 - 1) / NR_BF16;
    if (kNativeBf16) {  // per block of 32 k, the 16 pairs of `pair_k`; -0 past K
        const int64_t Kp = k_padded(K);
        for (int64_t p = 0; p < P; p++)
            for (int64_t k0 = 0; k0 < Kp; k0 += KB)
                for (int s = 0; s < 16; s++)
                    for (int c = 0; c < NR_BF16; c++) {
                        const int64_t n = p * NR_BF16 + c;
                        uint16_t* d = dst + p * Kp * NR_BF16 + k0 * NR_BF16 + (s * NR_BF16 + c) * 2;
                        for (int h = 0; h < 2; h++) {
                            const int64_t k = k0 + pair_k(s, h);
                            d[h] = n >= N ? 0 : k >= K ? BF16_NEG_ZERO : src[n * ldw + k];
                        }
                    }
        return;
    }
    const int64_t K2 = K / 2;
    for (int64_t p = 0; p < P; p++)
        for (int64_t j = 0; j < K2; j++)
            for (int c = 0; c < NR_BF16; c++) {
                const int64_t n = p * NR_BF16 + c;
                uint16_t* d = dst + ((p * K2 + j) * NR_BF16 + c) * 2;
                d[0] = n < N ? src[n * ldw + 2 * j] : 0;
                d[1] = n < N ? src[n * ldw + 2 * j + 1] : 0;
            }
}

// y (M, N), rows ldy elements apart, = x (M, K), rows ldx apart, times the packed weight,
// plus bias (N,) float32 when not null. dtype: the weight's (0 float32, 1 bfloat16, K even);
// x_dtype: x's, the weight's or float32 (a bfloat16 weight's float32 activations are
// rounded to bfloat16 first, as torch rounds); out_dtype: y's (float32, or bfloat16 for a
// bfloat16 weight).
void batchgen_gemm(const void* x, int x_dtype, int64_t ldx, int64_t M, int64_t K, const void* packed, int64_t N,
                   const float* bias, void* y, int64_t ldy, int dtype, int out_dtype, int threads) {
    if (M <= 0 || N <= 0) return;
    if (dtype == F32) {
        run<float, MR_F32, NV_F32, F32K>((const float*)x, ldx, M, K, (const float*)packed, N, K * NR_F32, bias, y,
                                         ldy, out_dtype, threads);
        return;
    }
    const int prep = x_dtype == F32 ? FROM_F32 : kNativeBf16 ? FROM_BF16 : AS_IS;
#if defined(__AVX512BF16__)
    run<uint16_t, MR_BF16, NV_BF16, Bf16K>((const uint16_t*)x, ldx, M, K, (const uint16_t*)packed, N,
                                           k_padded(K) * NR_BF16, bias, y, ldy, out_dtype, threads, prep);
#else
    run<uint16_t, MR_EMU, NV_EMU, EmuK>((const uint16_t*)x, ldx, M, K, (const uint16_t*)packed, N, K * NR_BF16,
                                        bias, y, ldy, out_dtype, threads, prep);
#endif
}

}  // extern "C"
