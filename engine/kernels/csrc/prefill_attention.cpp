// Prefill attention over the KV arena: every prompt token's causal attention to its prompt's
// keys, for a whole prefill batch in one call per layer, each query row's result a function
// of its own query and keys only, the same bits on every x86-64 CPU.
//
// Why not torch's flash kernel: its blocks, vector widths and inner GEMMs follow the shape and
// the instruction set (a query row's bits moved between ATen's AVX2 and AVX-512 builds), and
// batch invariance meant one call per prompt. Here the arithmetic of a query row is fixed:
// - keys in blocks of KB from the prompt's first token; a block holding no key the row may
//   see (after it, or before its sliding window) is skipped; in the others the unseen keys'
//   scores are -inf;
// - a score is one fused multiply-add chain over the head dimension in order, times the
//   scale (a lane holds one key, so the vector width does not enter);
// - the online softmax update of FlashAttention (Dao et al. 2022; Milakov & Gimelshein 2018)
//   per block: m' = max(m, block max), l' = l e^(m - m') + the block's sum of e^(s - m')
//   (the block's 8-lane vectors added in order, then their 8 lanes in a fixed tree),
//   acc' = acc e^(m - m') + sum_j p_j v_j (one chain of fused multiply-adds per output
//   element over the block's keys in order, stopping at the row's last visible key);
// - out = acc / l.
// A lane holds one key (scores) or one output element (p v), so the AVX-512 builds run 16
// lanes where the AVX2 build runs 8 and give the same bits; each (prompt, KV head) has its
// keys transposed and its values widened to float32 once, for all its query rows, the rows'
// softmax steps run up to 4 at a time, and the rows that see a whole block take its p v four
// at a time, each value vector loaded once for them (on the Zen 4, 4 prompts of 1,200
// tokens: 0.64x the time of the 8-lane kernel that widened each value row for each query
// row in bfloat16, 0.76x in float32; docs/performance.md).
// So a row's bits depend only on its position, window and keys: not on the batch, the prompt
// length, the other rows of its tile, the thread count (threads split (prompt, KV head,
// query tile) items, never a row), the ISA, or where the call's rows start: a prefill may
// begin past a prefix whose keys are already in the arena (copied from another prompt's run:
// engine/prefix_cache.py), and its rows are those of the whole prompt's prefill. Keys and
// values are read from the arena the prefill has just written (float32, or bfloat16 widened
// as read), so a prompt attends to what its samples' decode steps will read.
//
// Built and loaded by engine/kernels/native.py, called from engine/kernels/attention.py (prefill_native).
#include "online_softmax.h"
#include "simd.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

namespace attn = batchgen::attn;
using namespace batchgen::vec;  // vf: 8 lanes (AVX2) or 16 (AVX-512); a lane's arithmetic is the same in both

constexpr int KB = attn::KB;  // keys per block: 4 vectors of 8 lanes, or 2 of 16
constexpr int NK = KB / L;   // vectors per block of keys
constexpr int QT = 16;       // query positions per work item
#if defined(__AVX512F__)
constexpr int MR = 8;       // query rows whose scores are formed together (16 of 32 registers)
constexpr int PV_ROWS = 4;  // rows whose p v share each value vector's load (16 accumulators)
#else
constexpr int MR = 2;       // (8 of 16 registers)
constexpr int PV_ROWS = 1;  // (AVX2: a row's 8 column vectors fill the registers)
#endif

inline float widen(float x) { return x; }
inline float widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// One query row's running state.
struct Row {
    const float* q;  // D floats
    float* out;      // D floats
    int64_t t;       // position in the prompt
    int64_t lo;      // first visible key (0, or t - window)
    float m, l;
};

// Scores of R rows against the KB keys of the block at kt (Kt: D rows of `ldk` floats, the
// block's keys in lanes): s[r][j] = (sum_d q_r[d] kt[d][j]) * scale, one chain per lane.
template <int R>
inline void scores(Row* const* rows, const float* kt, int64_t ldk, int64_t D, float scale, float (*s)[KB]) {
    vf acc[R][NK];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NK; c++) acc[r][c] = vzero();
    for (int64_t d = 0; d < D; d++) {
        const float* k = kt + d * ldk;
        vf kv[NK];
        for (int c = 0; c < NK; c++) kv[c] = vload(k + L * c);
        for (int r = 0; r < R; r++) {
            const vf q = vset(rows[r]->q[d]);
            for (int c = 0; c < NK; c++) acc[r][c] = vfma(q, kv[c], acc[r][c]);
        }
    }
    const vf sv = vset(scale);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NK; c++) vstore(s[r] + L * c, vmul(acc[r][c], sv));
}

// The online-softmax steps of R rows with their scores s[r] over the block of keys [a, a +
// KB): keys outside [row.lo, row.t] do not count (their scores become -inf). A row that sees
// a key of the block gets online_softmax.h's step (in order, as decode's own runs; e^(-inf -
// m') is 0): s[r] becomes its weights p, its m and l are updated, corr[r] is the factor
// e^(m - m') for its output so far. Rows are stepped up to 4 at a time (their chains
// interleaved; a row's bits are the same whatever the count); a row that sees none is left
// as it was. first[r] > last[r]: none visible.
inline void softmax_steps(Row* const* rows, int R, float (*s)[KB], int64_t a, int64_t* first, int64_t* last,
                          float* corr) {
    for (int r = 0; r < R; r++) {
        first[r] = std::max<int64_t>(rows[r]->lo - a, 0), last[r] = std::min<int64_t>(rows[r]->t - a, KB - 1);
        if (first[r] <= last[r] && (first[r] > 0 || last[r] < KB - 1))  // the window's start or the diagonal
            for (int64_t j = 0; j < KB; j++)
                if (j < first[r] || j > last[r]) s[r][j] = -INFINITY;
    }
    for (int r = 0; r < R;) {
        if (first[r] > last[r]) {
            r++;
            continue;
        }
        int e = r + 1;  // a run of rows that see keys, at most 4
        while (e < R && e - r < 4 && first[e] <= last[e]) e++;
        float *m[4], *l[4];
        for (int u = r; u < e; u++) m[u - r] = &rows[u]->m, l[u - r] = &rows[u]->l;
        switch (e - r) {
            case 1: attn::softmax_steps<1, true>(s[r], KB, m, l, corr + r); break;
            case 2: attn::softmax_steps<2, true>(s[r], KB, m, l, corr + r); break;
            case 3: attn::softmax_steps<3, true>(s[r], KB, m, l, corr + r); break;
            default: attn::softmax_steps<4, true>(s[r], KB, m, l, corr + r); break;
        }
        r = e;
    }
}

// acc_r = acc_r * corr[r] + sum_j s_r[j] v_j over keys j = first .. last (values vt + j * D,
// float32; D = 8 * ND) for R rows: one chain of fused multiply-adds per output element, in
// key order; each value vector is loaded once for the R rows (a row's bits are the same
// whatever R).
template <int ND, int R>
inline void accumulate(float* const* acc, const float* const* s, const float* corr, const float* vt, int64_t first,
                       int64_t last) {
    constexpr int D = 8 * ND, NV = D / L;  // whole vectors of the head; AVX-512: a half vector past them when D % 16 = 8
    // column vectors per pass: R x CB accumulators (one row: up to 8, AVX2's D = 64 in one pass)
    constexpr int CB = NV < 1 ? 1 : R == 1 ? (NV < 8 ? NV : 8) : NV < 4 ? NV : 4;
    for (int c0 = 0; c0 < NV; c0 += CB) {
        const int nc = std::min(CB, NV - c0);
        vf o[R][CB];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < nc; c++) o[r][c] = vmul(vload(acc[r] + L * (c0 + c)), vset(corr[r]));
        for (int64_t j = first; j <= last; j++) {
            const float* v = vt + j * D + L * c0;
            vf p[R];
            for (int r = 0; r < R; r++) p[r] = vset(s[r][j]);
            for (int c = 0; c < nc; c++) {
                const vf vv = vload(v + L * c);
                for (int r = 0; r < R; r++) o[r][c] = vfma(p[r], vv, o[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < nc; c++) vstore(acc[r] + L * (c0 + c), o[r][c]);
    }
#if defined(__AVX512F__)
    if (D % 16 != 0)
        for (int r = 0; r < R; r++) {
            __m256 oh = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + 16 * NV), _mm256_set1_ps(corr[r]));
            for (int64_t j = first; j <= last; j++)
                oh = _mm256_fmadd_ps(_mm256_set1_ps(s[r][j]), _mm256_loadu_ps(vt + j * D + 16 * NV), oh);
            _mm256_storeu_ps(acc[r] + 16 * NV, oh);
        }
#endif
}

template <int ND, class T>
void prefill(const float* q, int64_t q_tok_ld, int64_t q_batch_ld, const T* kc, const T* vc, const int64_t* starts,
             const int64_t* lengths, const int64_t* cached, int64_t B, int64_t T_, int64_t Hq, int64_t Hkv,
             int64_t window, float scale, float* out, int threads) {
    constexpr int64_t D = 8 * ND;
    const int64_t g = Hq / Hkv, ld = Hkv * D, tiles = (T_ + QT - 1) / QT;
    const int64_t items = B * Hkv * tiles;
#pragma omp parallel num_threads(threads)
    {
        const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
        std::vector<float> kt;                  // the current (prompt, head)'s keys, transposed
        std::vector<float> vt;                  // and its values, as float32 rows of D
        std::vector<float> acc(QT * g * D);     // the tile's rows' unnormalised outputs
        std::vector<Row> rowbuf(QT * g);
        alignas(64) float s[MR][KB];
        int64_t cur = -1;
        for (int64_t it = items * tid / nt; it < items * (tid + 1) / nt; it++) {
            const int64_t b = it / (Hkv * tiles), h = it / tiles % Hkv, tile = it % tiles;
            // query rows i = t0 .. t0 + QT - 1 of this tile are prompt positions c + i
            const int64_t len = lengths[b], c = cached == nullptr ? 0 : cached[b], t0 = tile * QT;
            const int64_t nq = std::min<int64_t>(QT, len - c - t0);
            for (int64_t i = std::max(t0, len - c); i < std::min(t0 + QT, T_); i++)  // padding: zeros
                std::memset(out + ((b * T_ + i) * Hq + h * g) * D, 0, g * D * sizeof(float));
            if (nq <= 0) continue;
            const int64_t ldk = (len + KB - 1) / KB * KB;  // Kt row length: whole blocks, zeros past len
            if (cur != b * Hkv + h) {
                cur = b * Hkv + h;
                kt.assign(D * ldk, 0.f);
                vt.resize(ldk * D);
                const T* K = kc + starts[b] * ld + h * D;
                const T* V = vc + starts[b] * ld + h * D;
                for (int64_t j = 0; j < len; j++)
                    for (int64_t d = 0; d < D; d++) {
                        kt[d * ldk + j] = widen(K[j * ld + d]);
                        vt[j * D + d] = widen(V[j * ld + d]);
                    }
            }
            int64_t n = 0;
            for (int64_t i = t0; i < t0 + nq; i++) {
                const int64_t t = c + i;
                for (int64_t j = 0; j < g; j++) {
                    const int64_t hq = h * g + j;
                    rowbuf[n++] = {q + b * q_batch_ld + i * q_tok_ld + hq * D, out + ((b * T_ + i) * Hq + hq) * D, t,
                                   window < 0 ? 0 : std::max<int64_t>(0, t - window), -INFINITY, 0.f};
                }
            }
            std::fill(acc.begin(), acc.begin() + n * D, 0.f);
            const int64_t tmax = c + t0 + nq - 1;
            const int64_t lo_min = rowbuf[0].lo;
            for (int64_t a = lo_min / KB * KB; a <= tmax; a += KB) {
                for (int64_t r0 = 0; r0 < n; r0 += MR) {
                    Row* rows[MR];
                    const int R = (int)std::min<int64_t>(MR, n - r0);
                    for (int r = 0; r < MR; r++) rows[r] = &rowbuf[r0 + std::min(r, R - 1)];
                    scores<MR>(rows, kt.data() + a, ldk, D, scale, s);
                    // The rows' softmax steps; then p v for the rows that see the whole block
                    // PV_ROWS at a time, the others (the diagonal, a window's start) alone.
                    int64_t first[MR], last[MR];
                    float corr[MR], corr_whole[MR];
                    float* accs[MR];
                    const float* ss[MR];
                    softmax_steps(rows, R, s, a, first, last, corr);
                    int whole = 0;
                    for (int r = 0; r < R; r++) {
                        float* ar = acc.data() + (r0 + r) * D;
                        if (first[r] == 0 && last[r] == KB - 1) {
                            corr_whole[whole] = corr[r], accs[whole] = ar, ss[whole++] = s[r];
                        } else if (first[r] <= last[r]) {
                            const float* sr = s[r];
                            accumulate<ND, 1>(&ar, &sr, corr + r, vt.data() + a * D, first[r], last[r]);
                        }
                    }
                    int w = 0;
                    for (; w + PV_ROWS <= whole; w += PV_ROWS)
                        accumulate<ND, PV_ROWS>(accs + w, ss + w, corr_whole + w, vt.data() + a * D, 0, KB - 1);
                    for (; w < whole; w++)
                        accumulate<ND, 1>(accs + w, ss + w, corr_whole + w, vt.data() + a * D, 0, KB - 1);
                }
            }
            for (int64_t r = 0; r < n; r++) {
                const Row& row = rowbuf[r];
                const float inv = row.l > 0.f ? 1.f / row.l : 0.f;
                for (int64_t d = 0; d < D; d++) row.out[d] = acc[r * D + d] * inv;
            }
        }
    }
}

template <class T>
using Fn = void (*)(const float*, int64_t, int64_t, const T*, const T*, const int64_t*, const int64_t*,
                    const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, int);

// Head sizes: every multiple of 8 up to 128, and 160, 192, 256 (as decode_attention.cpp).
template <class T>
Fn<T> pick(int64_t D) {
    switch (D) {
#define BATCHGEN_D(d) \
    case d: return prefill<(d) / 8, T>;
        BATCHGEN_D(8) BATCHGEN_D(16) BATCHGEN_D(24) BATCHGEN_D(32) BATCHGEN_D(40) BATCHGEN_D(48) BATCHGEN_D(56)
        BATCHGEN_D(64) BATCHGEN_D(72) BATCHGEN_D(80) BATCHGEN_D(88) BATCHGEN_D(96) BATCHGEN_D(104) BATCHGEN_D(112)
        BATCHGEN_D(120) BATCHGEN_D(128) BATCHGEN_D(160) BATCHGEN_D(192) BATCHGEN_D(256)
#undef BATCHGEN_D
        default: return nullptr;
    }
}

}  // namespace

extern "C" {

// Causal prefill attention (see the file comment). Prompt b's keys and values are at arena
// positions starts[b] .. starts[b] + lengths[b] - 1 of kc, vc ((positions, Hkv, D), float32
// or, kv_bf16 = 1, bfloat16); its first cached[b] positions were stored before this call (a
// prefix copied from another prompt's run; cached null: none), and its query rows are
// positions cached[b] + i, i < lengths[b] - cached[b]: row i's query of head hq at q + b *
// q_batch_ld + i * q_tok_ld + hq * D (D contiguous floats). A row's result is the same
// whether or not a prefix was cached. window: a query at position t sees keys t - window .. t
// (-1: all before it). out: (B, T, Hq, D) float32 by row, zeros at rows i >= lengths[b] -
// cached[b] (padding). Returns 0, or -1 for an unsupported head_dim D (`pick`; nothing written).
int batchgen_prefill_attention(const float* q, int64_t q_tok_ld, int64_t q_batch_ld, const void* kc,
                               const void* vc, int kv_bf16, const int64_t* starts, const int64_t* lengths,
                               const int64_t* cached, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                               int64_t window, float scale, float* out, int threads) {
    if (kv_bf16) {
        const Fn<uint16_t> f = pick<uint16_t>(D);
        if (f == nullptr) return -1;
        f(q, q_tok_ld, q_batch_ld, (const uint16_t*)kc, (const uint16_t*)vc, starts, lengths, cached, B, T, Hq, Hkv,
          window, scale, out, threads);
        return 0;
    }
    const Fn<float> f = pick<float>(D);
    if (f == nullptr) return -1;
    f(q, q_tok_ld, q_batch_ld, (const float*)kc, (const float*)vc, starts, lengths, cached, B, T, Hq, Hkv, window,
      scale, out, threads);
    return 0;
}

}  // extern "C"
