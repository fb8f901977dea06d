// Decode attention's bfloat16 products over a prompt block (attention_bf16.h's sequence) on
// AMX tiles: the `amx` build, once engine/kernels/native.py verified TDPBF16PS, and the
// BATCHGEN_AMX_EMULATE test build (amx_tiles.h). TDPBF16PS sums a tile row's 16 pairs as
// even and odd partial sums added to C: attention_bf16.h's sequence, with a pair per two
// consecutive elements (so the arena's key rows load as they are). Scores: C (16 keys x 16 queries) += A (16 keys x 32 elements, the
// arena's rows as they are) x B (the queries' pairs, a row per pair: `QueryTiles`), from a
// zero C, block after block of the head. p v: C (16 queries x 16 output elements, loaded
// as acc * corr) += A (16 queries x 32 weights) x B (the values' pairs of keys 2j, 2j + 1,
// a row per pair: `BlockTiles`). The softmax step between them is `softmax_steps`, so a
// query's bits are those of the vector kernels.
#pragma once

#include "amx_tiles.h"
#include "attention_bf16.h"

#if defined(BATCHGEN_HAVE_TILES)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace batchgen::bf16attn {

namespace tiles {

using namespace batchgen::amx;

constexpr int TQ = 16;  // queries per tile

// The group's queries of one KV head as B tiles: tile t, block c: row j holds query
// (16 t + u)'s elements (32 c + 2j, 32 c + 2j + 1) in column u; +0 past D and past the
// last query.
struct QueryTiles {
    std::vector<uint32_t> b;  // [tile][block][16 rows][16 columns]
    int64_t nt = 0, nc = 0;

    // q[u] (u < nq): float32 query heads, D elements each.
    void prepare(const float* const* q, int64_t nq, int64_t D) {
        nt = (nq + TQ - 1) / TQ;
        nc = padded(D) / 32;
        b.assign(nt * nc * 256, 0u);
        for (int64_t u = 0; u < nq; u++)
            for (int64_t d = 0; d < D; d++) {
                const int64_t c = d / 32, j = (d % 32) / 2;
                b[((u / TQ * nc + c) * 16 + j) * 16 + u % TQ] |= (uint32_t)f32_to_bf16(q[u][d]) << (16 * (d % 2));
            }
    }
    const uint32_t* tile(int64_t t, int64_t c) const { return b.data() + (t * nc + c) * 256; }
};

// One KV head's block of n <= KB keys and values as tiles: keys as A rows (the arena's
// rows when the block is whole and D a multiple of 32, else a copy: 0 past n, -0 past D),
// values as B tiles of 16 output elements (pairs of keys 2j, 2j + 1; -0 past n, 0 past D).
struct BlockTiles {
    alignas(64) uint16_t k[KB][DMAX];
    alignas(64) uint32_t v[DMAX / 16][16][16];
    const uint16_t* keys = nullptr;
    int64_t kstride = 0;  // bytes between key rows

    void prepare(const uint16_t* K, const uint16_t* V, int64_t ld, int n, int64_t D) {
        const int64_t Dp = padded(D);
        if (n == KB && D == Dp) {
            keys = K;
            kstride = ld * 2;
        } else {
            for (int i = 0; i < KB; i++)
                for (int64_t d = 0; d < Dp; d++) k[i][d] = i >= n ? 0 : d < D ? K[i * ld + d] : BF16_NEG_ZERO;
            keys = &k[0][0];
            kstride = DMAX * 2;
        }
        for (int64_t t = 0; t < value_cols(D) / 16; t++) {
            const __mmask16 in = (__mmask16)((1u << std::min<int64_t>(16, D - 16 * t)) - 1);
            for (int j = 0; j < 16; j++) {
                const __m512i lo = 2 * j >= n ? _mm512_set1_epi32(BF16_NEG_ZERO)
                                              : _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, V + 2 * j * ld + 16 * t));
                const __m512i hi = 2 * j + 1 >= n
                                       ? _mm512_set1_epi32(BF16_NEG_ZERO)
                                       : _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, V + (2 * j + 1) * ld + 16 * t));
                _mm512_store_si512(v[t][j], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
    }
};

// Scores of query tile t against the block: s[u * KB + i] = S * scale for its nq queries.
inline void scores(const QueryTiles& qt, int64_t t, int nq, const BlockTiles& b, float scale, float* s) {
    alignas(64) float c[KB][TQ];
    BG_TILE_ZERO(0);
    BG_TILE_ZERO(1);
    BG_BARRIER();
    for (int64_t blk = 0; blk < qt.nc; blk++) {
        BG_TILE_LOAD(6, qt.tile(t, blk), 64);
        BG_TILE_LOAD(4, b.keys + blk * 32, b.kstride);
        BG_TILE_LOAD(5, (const char*)(b.keys + blk * 32) + 16 * b.kstride, b.kstride);
        BG_TILE_DP(0, 4, 6);
        BG_TILE_DP(1, 5, 6);
    }
    BG_TILE_STORE(0, c[0], TQ * 4);
    BG_TILE_STORE(1, c[16], TQ * 4);
    BG_BARRIER();
    const __m512 sv = _mm512_set1_ps(scale);
    for (int h = 0; h < 2; h++) {  // keys 16 h .. 16 h + 15: a lane per key for each query
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(c[16 * h + i]);
        transpose16(r);
        for (int u = 0; u < nq; u++) _mm512_store_ps(s + u * KB + 16 * h, _mm512_mul_ps(_mm512_castsi512_ps(r[u]), sv));
    }
}

// acc[u][0, D) = acc[u] * corr[u] + the block's p v for the tile's nq queries, whose weights
// are s[u * KB, u * KB + KB) (after the softmax step).
inline void accumulate(float* const* acc, const float* corr, const float* s, int nq, const BlockTiles& b, int64_t D) {
    const int64_t Dv = value_cols(D);
    alignas(64) uint16_t p[TQ][KB];
    alignas(64) float c[TQ][DMAX];
    for (int u = 0; u < TQ; u++) {  // rows past nq: zeros
        const bool in = u < nq;
        const __m512 cu = _mm512_set1_ps(in ? corr[u] : 0.f);
        _mm256_store_si256((__m256i*)p[u], in ? round16(_mm512_load_ps(s + u * KB)) : _mm256_setzero_si256());
        _mm256_store_si256((__m256i*)(p[u] + 16), in ? round16(_mm512_load_ps(s + u * KB + 16)) : _mm256_setzero_si256());
        for (int64_t d = 0; d < Dv; d += 16) {
            const int64_t cols = std::min<int64_t>(16, D - d);
            const __m512 a = in ? _mm512_maskz_loadu_ps((__mmask16)((1u << cols) - 1), acc[u] + d) : _mm512_setzero_ps();
            _mm512_store_ps(&c[u][d], _mm512_mul_ps(a, cu));
        }
    }
    BG_TILE_LOAD(4, p, KB * 2);
    for (int64_t t = 0; t < Dv / 16; t++) {
        BG_BARRIER();
        BG_TILE_LOAD(0, &c[0][16 * t], DMAX * 4);
        BG_TILE_LOAD(6, b.v[t], 64);
        BG_TILE_DP(0, 4, 6);
        BG_TILE_STORE(0, &c[0][16 * t], DMAX * 4);
        BG_BARRIER();
    }
    for (int u = 0; u < nq; u++)
        for (int64_t d = 0; d < D; d += 16)
            _mm512_mask_storeu_ps(acc[u] + d, (__mmask16)((1u << std::min<int64_t>(16, D - d)) - 1), _mm512_load_ps(&c[u][d]));
}

}  // namespace tiles

}  // namespace batchgen::bf16attn

#endif
