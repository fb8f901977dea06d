// bfloat16 GEMMs on AMX tiles (Sapphire Rapids and later): y = x W^T (+ bias) with the chain
// that gemm.cpp defines for a bfloat16 weight, compiled only into the `amx` build (the
// others see an empty file). float32 weights, and bfloat16 ones packed in gemm.cpp's panel
// layout, stay on gemm.cpp's AVX-512 kernels in that build.
//
// The sequence (gemm.cpp's header): per block of 16 pairs of K, an even and an odd partial
// sum from +0, each an FMA chain in k order, then acc = acc + (even + odd), DAZ and FTZ
// throughout; then the bias in float32. That is TDPBF16PS on one tile row of A (16 pairs) as
// the Intel SDM's pseudo-code writes it, and as the hardware computes it: measured on an
// Intel Xeon (Emerald Rapids, family 6 model 207) with the probe's 500 cases, bit for bit,
// denormals, infinities, NaN, cancellations and flushed products included
// (tests/data/amx_tdpbf16ps.pt). The intrinsics guide's reading (each pair's products added
// to the output in turn) is not what the hardware does. Within a pair the two products go to
// different partial sums, so both pair packings (`swap` 1 and 0) give the same bits; both are
// kept, and nothing here is trusted: engine/kernels/native.py runs both against the
// avx512_bf16 build in a subprocess before a process uses this path, and uses it only with a
// packing that gives the same bits on every case.
//
// Layout. The weight (N, K) is packed once into B tiles: columns in blocks of 16, K in
// blocks of 16 pairs (32 elements); a tile is 16 pair-rows x 16 columns x 2 bfloat16 (64
// bytes a row, TDPBF16PS's "VNNI" operand), the tiles of a column block in K order, column
// blocks in pairs (a panel of 32 columns, zeros past N). K is padded to a multiple of 32
// with -0 in the weight and +0 in the activations: each padded product is -0, and
// acc + (-0) = acc for every acc (+0 + (-0) = +0, -0 + (-0) = -0), so the padding leaves
// the chain's bits alone (a +0 * +0 padding would turn a flushed -0 output into +0).
// The activations are rounded to bfloat16 (as gemm.cpp rounds them) into a per-call buffer
// in A-tile order (16 rows x 32 elements, 1 KiB contiguous, the tiles of a row tile in K
// order), rows padded to a multiple of 16, pairs swapped like the weight's, K padded with
// +0. Tile order, not rows: a tile load reads one contiguous KiB, which the prefetchers
// follow, where 16 rows Kp elements apart (4 KiB apart for K = 2048) fight over a few L1 sets.
// A unit of work is (a block of up to 256 rows, a panel of 32 columns); threads (OpenMP)
// take contiguous ranges of units, as gemm.cpp's do. In a unit, K goes in chunks of at most
// KC blocks (384 elements; the blocks shared evenly between the chunks, so K = 576 makes two
// of 9, not 8 + 8 + 2), and each chunk visits the unit's rows 32 at a time (16 for the last
// tile of rows) through four C tiles (2 x 2: tmm0-3), with A tiles tmm4-5 and B tiles
// tmm6-7: the panel's chunk of B (at most 24 KiB) stays in L1 for all the rows instead of
// coming from L2 again for every 32. Between chunks a row pair's C tiles wait in a per-thread
// buffer (stored and loaded bit for bit), so each lane is still one chain over all of K in
// order. While a chunk runs, the next chunk's B (the next unit's first after the last) is
// prefetched into L2, a few lines per K block spread over the chunk's row pairs: a decode
// step reads each weight once, from memory, and the hardware prefetchers, which stop at page
// boundaries and start again only after misses, leave the first row pair of every chunk
// waiting on it. The epilogue adds the bias and stores the rows and columns that exist
// (float32, or bfloat16 rounded as torch rounds), as gemm.cpp's store_tile does. A row's bits
// depend only on the row: a lane of a C tile is one (row, column) chain, whatever the tile's
// other rows hold; the chunking and the prefetches change no bit. Measured on Emerald Rapids
// Xeons (docs/performance.md): chunks of 8 blocks (2026-11-27, fourth session) took SmolLM2's
// decode GEMMs at 128 rows to 0.93x the row-order, whole-K kernel's time on 2 threads,
// 0.64-0.83x on one; the even chunks of at most 12 and the prefetch (sixth session) to 0.84x
// the chunks of 8 on two threads and 0.82x on one, with 30 layers' weights read from memory
// as in a step (bench/bench_gemm.py --layers 30 --base: 51.0 against 60.5 ms a step, 69.0
// against 84.2), the same bits on every shape.
//
// Linux hands out the tile state only on request: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA) once per process (the permission covers every thread, present and
// future); without it the first tile instruction kills the process with SIGILL. Each
// thread loads the 64-byte tile configuration (palette 1) at the start of its share of a
// call and releases the tiles at its end.
//
// BATCHGEN_AMX_EMULATE (a test build only, on any AVX-512 BF16 CPU): the same kernel with
// the tile instructions computed by scalar code after the pseudo-code named by the
// environment variable BATCHGEN_AMX_EMULATE_MODE: "sdm" (default; the SDM's partial sums,
// what the hardware does), "guide" (the intrinsics guide: element 0 then element 1, chained)
// or "odd" (element 1 first). It checks everything but the instructions themselves: the packing, the padding,
// the tails, the threads, the epilogue, and native.py's verification's verdicts.
#if (defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(BATCHGEN_AMX_EMULATE)

#include "amx_tiles.h"
#include "simd.h"

#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace {

using namespace batchgen::amx;
using batchgen::BF16_NEG_ZERO;

constexpr int64_t TP = 16;        // pairs per tile row (64 bytes)
constexpr int64_t TN = 16;        // columns per tile
constexpr int64_t TM = 16;        // rows per tile
constexpr int64_t NP = 2 * TN;    // columns per panel (two C tiles across)
constexpr int64_t MC = 256;       // rows per block of work
constexpr int64_t KC = 12;        // K blocks (of 32 elements) per chunk, at most
constexpr int64_t A_TILE = TM * 2 * TP;  // bfloat16 per A tile (1 KiB)
constexpr int64_t TILE_ELEMS = TP * TN * 2;  // bfloat16 per B tile (1 KiB)

enum Dtype : int { F32 = 0, BF16 = 1 };

// ---------------------------------------------------------------- permission
constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;  // <asm/prctl.h>
constexpr int kXtiledata = 18;                                          // XFEATURE_XTILEDATA

int request_tiles() {
    static std::once_flag once;
    static int result = 0;
    std::call_once(once, [] {
        if (kEmulated) return;
        if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtiledata) != 0) {
            result = errno != 0 ? errno : EPERM;
            return;
        }
        unsigned long granted = 0;
        if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0) {
            result = errno != 0 ? errno : EPERM;
            return;
        }
        if (!(granted & (1ul << kXtiledata))) result = EPERM;
    });
    return result;
}

// ---------------------------------------------------------------- kernel
// The C tiles of R (1 or 2) tiles of rows after K blocks [k0, k0 + kn): a holds the row
// tiles' A tiles (the second row tile's a_next elements on, each row tile's in K order, 1 KiB
// apart), b0 and b1 the B tiles of two column blocks (in K order); c[2 r + j] (16 x 16
// float32) holds the C tiles so far (read unless k0 == 0, when they start at +0) and
// receives them after the chunk.
// Lines [l0, l1) of the next chunk's B, `per` of them at each K block of a chunk: lines
// before n0 from r0 (the first column block's tiles), the rest from r1 (the second's). A
// prefetch never faults, so one past the weight's end (the last unit's) is harmless.
struct Prefetch {
    const char* r0 = nullptr;
    const char* r1 = nullptr;
    int64_t n0 = 0, l0 = 0, l1 = 0, per = 0;

    inline void at(int64_t i) const {
        const int64_t lo = l0 + i * per, hi = std::min(l1, lo + per);
        for (int64_t l = lo; l < hi; l++)
            _mm_prefetch(l < n0 ? r0 + l * 64 : r1 + (l - n0) * 64, _MM_HINT_T1);
    }
};

template <int R>
void tile_chunk(const uint16_t* a, int64_t a_next, const uint16_t* b0, const uint16_t* b1, int64_t k0, int64_t kn,
                float (*c)[TM][TN], const Prefetch& pf) {
    if (k0 == 0) {
        BG_TILE_ZERO(0);
        BG_TILE_ZERO(1);
        if (R == 2) {
            BG_TILE_ZERO(2);
            BG_TILE_ZERO(3);
        }
    } else {
        BG_TILE_LOAD(0, c[0], TN * 4);
        BG_TILE_LOAD(1, c[1], TN * 4);
        if (R == 2) {
            BG_TILE_LOAD(2, c[2], TN * 4);
            BG_TILE_LOAD(3, c[3], TN * 4);
        }
    }
    BG_BARRIER();
    for (int64_t kb = k0; kb < k0 + kn; kb++) {
        pf.at(kb - k0);
        BG_TILE_LOAD(6, b0 + kb * TILE_ELEMS, 64);
        BG_TILE_LOAD(7, b1 + kb * TILE_ELEMS, 64);
        BG_TILE_LOAD(4, a + kb * A_TILE, 64);
        BG_TILE_DP(0, 4, 6);
        BG_TILE_DP(1, 4, 7);
        if (R == 2) {
            BG_TILE_LOAD(5, a + a_next + kb * A_TILE, 64);
            BG_TILE_DP(2, 5, 6);
            BG_TILE_DP(3, 5, 7);
        }
    }
    BG_TILE_STORE(0, c[0], TN * 4);
    BG_TILE_STORE(1, c[1], TN * 4);
    if (R == 2) {
        BG_TILE_STORE(2, c[2], TN * 4);
        BG_TILE_STORE(3, c[3], TN * 4);
    }
    BG_BARRIER();
}

// The epilogue of one C tile: rows [0, rows), columns [0, cols) plus the bias (float32 adds,
// as gemm.cpp's store_tile), stored as float32 or bfloat16.
void store_c(const float (*c)[TN], int rows, int cols, const float* bias, void* y, int64_t ldy, int out_dtype) {
    const __mmask16 mask = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m512 v = _mm512_loadu_ps(c[r]);  // c may be thread-local storage: no alignment assumed
        if (bias != nullptr) v = _mm512_add_ps(v, bv);
        if (out_dtype == F32) {
            _mm512_mask_storeu_ps((float*)y + r * ldy, mask, v);
        } else {
            _mm256_mask_storeu_epi16((uint16_t*)y + r * ldy, mask, batchgen::round16(v));
        }
    }
}

// Rows [r0, r1) of the activation buffer, in A-tile order (row m's block kb at
// ((m / 16) KB + kb) A_TILE + (m % 16) 32): row m < M from x (bfloat16, or float32 rounded),
// pairs swapped when `swap`, +0 from K to Kp; rows past M all +0. A block of 32 at a time
// (round32: f32_to_bf16's bits; a pair swapped by rotating its 32 bits), the tail past K
// loaded as +0.
void fill_rows(const void* x, int x_dtype, int64_t ldx, int64_t M, int64_t K, int64_t KB, int swap, int64_t r0,
               int64_t r1, uint16_t* a) {
    for (int64_t m = r0; m < r1; m++) {
        uint16_t* row = a + (m / TM) * KB * A_TILE + (m % TM) * 2 * TP;
        const float* xf = (const float*)x + m * ldx;
        const uint16_t* xb = (const uint16_t*)x + m * ldx;
        for (int64_t kb = 0; kb < KB; kb++) {
            const int64_t k0 = kb * 2 * TP;
            __m512i v = _mm512_setzero_si512();
            if (m < M) {
                const __mmask32 in = batchgen::first_lanes32(K - k0);
                v = x_dtype == F32 ? batchgen::round32(_mm512_maskz_loadu_ps((__mmask16)in, xf + k0),
                                                       _mm512_maskz_loadu_ps((__mmask16)(in >> 16), xf + k0 + 16))
                                   : _mm512_maskz_loadu_epi16(in, xb + k0);
                if (swap) v = _mm512_rol_epi32(v, 16);
            }
            _mm512_storeu_si512(row + kb * A_TILE, v);
        }
    }
}

thread_local std::vector<uint16_t> abuf;  // the activations of a call, in A-tile order
// a unit's C tiles between K chunks: 4 per pair of row tiles (32 KiB), one buffer per thread
alignas(64) thread_local float cbuf[MC / (2 * TM)][4][TM][TN];

inline int64_t k_blocks(int64_t K) { return (K / 2 + TP - 1) / TP; }
inline int64_t panels(int64_t N) { return (N + NP - 1) / NP; }

}  // namespace

extern "C" {

// 1 when this build computes AMX tiles in software (the BATCHGEN_AMX_EMULATE test build).
int batchgen_amx_emulated(void) { return kEmulated ? 1 : 0; }

// Asks Linux for the AMX tile state (once per process; the answer is kept): 0 when granted,
// else the errno of arch_prctl (EINVAL or EOPNOTSUPP where the CPU or kernel has no AMX).
// Executes no AMX instruction.
int batchgen_amx_request(void) { return request_tiles(); }

// Bytes of the AMX-packed form of a bfloat16 weight (N, K), K even.
int64_t batchgen_gemm_amx_packed_bytes(int64_t N, int64_t K) {
    return panels(N) * 2 * k_blocks(K) * TILE_ELEMS * 2;
}

// Pack the bfloat16 weight w (N, K), rows ldw elements apart, K even, into B tiles (out:
// batchgen_gemm_amx_packed_bytes bytes): pair j of column n as (w[n, 2j+1], w[n, 2j]) when
// swap, else (w[n, 2j], w[n, 2j+1]); -0 past K, +0 past N. Executes no AMX instruction.
void batchgen_gemm_amx_pack(const void* w, int64_t ldw, int64_t N, int64_t K, int swap, void* out) {
    const uint16_t* src = (const uint16_t*)w;
    uint16_t* dst = (uint16_t*)out;
    const int64_t KB = k_blocks(K), K2 = K / 2, blocks = panels(N) * 2;
    const int s = swap ? 1 : 0;
    for (int64_t p = 0; p < blocks; p++)
        for (int64_t kb = 0; kb < KB; kb++)
            for (int64_t j = 0; j < TP; j++)
                for (int64_t c = 0; c < TN; c++) {
                    const int64_t n = p * TN + c, J = kb * TP + j;
                    uint16_t* d = dst + (p * KB + kb) * TILE_ELEMS + (j * TN + c) * 2;
                    if (J >= K2) {
                        d[0] = d[1] = BF16_NEG_ZERO;
                    } else if (n >= N) {
                        d[0] = d[1] = 0;
                    } else {
                        d[0] = src[n * ldw + 2 * J + s];
                        d[1] = src[n * ldw + 2 * J + 1 - s];
                    }
                }
}

// y (M, N), rows ldy apart, = x (M, K), rows ldx apart, bfloat16 (x_dtype 1) or float32
// (0: rounded to bfloat16 first, as torch rounds), times the AMX-packed weight (packed with
// the same `swap`), plus bias (N,) float32 when not null; out_dtype 0 float32, 1 bfloat16.
// Returns 0, or the errno of the tile-state request (then nothing is computed).
int batchgen_gemm_amx(const void* x, int x_dtype, int64_t ldx, int64_t M, int64_t K, const void* packed, int64_t N,
                      const float* bias, void* y, int64_t ldy, int out_dtype, int threads, int swap) {
    const int rc = request_tiles();
    if (rc != 0) return rc;
    if (M <= 0 || N <= 0) return 0;
    const int64_t KB = k_blocks(K), Kp = KB * 2 * TP, Mp = (M + TM - 1) / TM * TM;
    const int64_t P = panels(N), blocks = (M + MC - 1) / MC, units = blocks * P;
    const int64_t osize = out_dtype == F32 ? 4 : 2;
    if (KB == 0) {  // K = 0: every sum is empty, y = the bias (or +0), as gemm.cpp gives
        alignas(64) static const float zero[TM][TN] = {};
        for (int64_t m = 0; m < M; m += TM)
            for (int64_t n = 0; n < N; n += TN)
                store_c(zero, (int)std::min<int64_t>(TM, M - m), (int)std::min<int64_t>(TN, N - n),
                        bias == nullptr ? nullptr : bias + n, (char*)y + (m * ldy + n) * osize, ldy, out_dtype);
        return 0;
    }
    const int64_t kc = (KB + (KB + KC - 1) / KC - 1) / ((KB + KC - 1) / KC);  // even chunks of at most KC
    const double flops = 2.0 * (double)M * (double)N * (double)K;
    const int team = flops < 4e6 ? 1 : (int)std::min<int64_t>(threads, std::max<int64_t>(units, 1));
    abuf.resize(Mp * Kp);
    uint16_t* a = abuf.data();
    const uint16_t* b = (const uint16_t*)packed;
#pragma omp parallel num_threads(team)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        fill_rows(x, x_dtype, ldx, M, K, KB, swap, Mp / TM * t / nt * TM, Mp / TM * (t + 1) / nt * TM, a);
#pragma omp barrier
        const int64_t lo = units * t / nt, hi = units * (t + 1) / nt;
        if (lo < hi) {
            const TileConfig cfg = tile_config();
            BG_BARRIER();
            BG_TILE_CONFIG(&cfg);
            for (int64_t u = lo; u < hi; u++) {
                const int64_t blk = u / P, p = u % P;
                const int64_t m0 = blk * MC, m1 = std::min(M, m0 + MC), n0 = p * NP;
                const uint16_t* b0 = b + 2 * p * KB * TILE_ELEMS;
                const uint16_t* b1 = b0 + KB * TILE_ELEMS;
                const int64_t pairs = (m1 - m0 + 2 * TM - 1) / (2 * TM);  // row pairs of tiles
                for (int64_t k0 = 0; k0 < KB; k0 += kc) {
                    const int64_t kn = std::min(kc, KB - k0);
                    // the next chunk: this panel's, or the next unit's first (panels are
                    // contiguous: b1's KB tiles end where the next panel's b0 starts)
                    const bool last = k0 + kc >= KB;
                    const uint16_t* nb0 = last ? b1 + KB * TILE_ELEMS : b0 + (k0 + kc) * TILE_ELEMS;
                    Prefetch pf;
                    pf.r0 = (const char*)nb0;
                    pf.r1 = (const char*)(nb0 + KB * TILE_ELEMS);
                    pf.n0 = (last ? std::min(kc, KB) : std::min(kc, KB - k0 - kc)) * (TILE_ELEMS * 2 / 64);
                    for (int64_t m = m0; m < m1; m += 2 * TM) {
                        const int64_t i = (m - m0) / (2 * TM);
                        pf.l0 = i * 2 * pf.n0 / pairs;
                        pf.l1 = (i + 1) * 2 * pf.n0 / pairs;
                        pf.per = (pf.l1 - pf.l0 + kn - 1) / kn;
                        const uint16_t* am = a + m / TM * KB * A_TILE;
                        if (m1 - m > TM)
                            tile_chunk<2>(am, KB * A_TILE, b0, b1, k0, kn, cbuf[i], pf);
                        else
                            tile_chunk<1>(am, KB * A_TILE, b0, b1, k0, kn, cbuf[i], pf);
                    }
                }
                for (int64_t m = m0; m < m1; m += 2 * TM) {
                    const int R = m1 - m > TM ? 2 : 1;
                    float (*c)[TM][TN] = cbuf[(m - m0) / (2 * TM)];
                    for (int r = 0; r < R; r++)
                        for (int j = 0; j < 2; j++) {
                            const int rows = (int)std::min<int64_t>(TM, m1 - m - r * TM);
                            const int64_t nc = n0 + j * TN;
                            const int cols = (int)std::min<int64_t>(TN, N - nc);
                            if (rows <= 0 || cols <= 0) continue;
                            store_c(c[2 * r + j], rows, cols, bias == nullptr ? nullptr : bias + nc,
                                    (char*)y + ((m + r * TM) * ldy + nc) * osize, ldy, out_dtype);
                        }
                }
            }
            BG_TILE_RELEASE();
        }
    }
    return 0;
}

}  // extern "C"

#endif
