// The passes over the vocabulary a CPU decode step makes per row after the LM head: the
// top-k candidates of the logits (top_k sampling), their logsumexp (raw logprobs), and the
// integer part of the race's noise for rows sampled from the whole vocabulary.
// Called by engine/sampling.py through engine/kernels/native.py. For 128 rows x 49,152 on 2 cores
// torch.topk (k = 50) and log_softmax take 5.7 and 4.6 ms, these 1.7-1.9 ms each (a SmolLM2
// step is ~290 ms). Each reads a row from memory once; its second pass finds it in L2.
//
// Batch invariance: threads split rows, never a row, and a row's result depends only on its
// own values. The top-k is exact and its order is fixed: larger value first, equal values
// by smaller token id (torch.topk leaves the order of ties unspecified); NaN counts as larger
// than every number, as in torch.topk.
//
// The AVX-512 builds scan 16 ids per instruction. Every build gives the same results: the
// top-k is exact (a vector compare only filters which ids a scalar test looks at), and
// logsumexp's 16-lane accumulators are the AVX2 build's pairs of 8-lane ones, added in the
// same order.
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using batchgen::exp8;
#if defined(__AVX512F__)
using batchgen::exp16;
#endif
using batchgen::hsum8;

struct Cand {
    float v;
    int64_t i;
};

// a ranks before b: NaN first, then larger values, then smaller ids.
inline bool before(const Cand& a, const Cand& b) {
    const bool an = std::isnan(a.v), bn = std::isnan(b.v);
    if (an || bn) return an && (!bn || a.i < b.i);
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

// The k best of row x (V floats) into vals / idx, best first, with a heap of the k best
// seen so far (heap: k slots). A vector compare against the heap's worst value skips 8 ids
// at a time, but early on most ids beat it: this is the fallback for rows holding NaN and
// for k close to V.
void topk_heap(const float* x, int64_t V, int k, float* vals, int64_t* idx, Cand* heap) {
    int n = 0;
    int64_t j = 0;
    for (; j < V && n < k; j++) {
        heap[n++] = {x[j], j};
        std::push_heap(heap, heap + n, before);
    }
    auto offer = [&](int64_t id) {
        const Cand c{x[id], id};
        if (before(c, heap[0])) {  // later ids lose ties, so an equal value never enters
            std::pop_heap(heap, heap + k, before);
            heap[k - 1] = c;
            std::push_heap(heap, heap + k, before);
        }
    };
    // x > worst, or x unordered (NaN in x or in the worst): then the scalar test decides
#if defined(__AVX512F__)
    for (; j + 16 <= V; j += 16) {
        unsigned mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), _mm512_set1_ps(heap[0].v), _CMP_NLE_UQ);
        for (; mask; mask &= mask - 1) offer(j + __builtin_ctz(mask));
    }
#endif
    __m256 worst = _mm256_set1_ps(heap[0].v);
    for (; j + 8 <= V; j += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), worst, _CMP_NLE_UQ));
        if (mask == 0) continue;
        for (; mask; mask &= mask - 1) offer(j + __builtin_ctz(mask));
        worst = _mm256_set1_ps(heap[0].v);
    }
    for (; j < V; j++) offer(j);
    std::sort_heap(heap, heap + n, before);  // ascending by `before`: best first
    for (int i = 0; i < n; i++) {
        vals[i] = heap[i].v;
        idx[i] = heap[i].i;
    }
}

// The k best of row x, as topk_heap, in two passes. Pass 1 takes the max of each block of
// `bs` ids; the k-th largest block max, t, is a lower bound of the k-th largest value (the
// k blocks it ranks among each hold a value >= t). Pass 2 (the row is in L2 by then)
// collects the ids whose value is >= t, typically a little over k, and sorts only those.
// cand: V slots of scratch; bmax: V / 8 floats. Returns false (nothing written) for a row
// holding NaN, which the caller gives to topk_heap.
bool topk_bounded(const float* x, int64_t V, int k, int64_t bs, float* vals, int64_t* idx, Cand* cand,
                  float* bmax) {
    const int64_t nb = V / bs;
    __m256 nan = _mm256_setzero_ps();
    int64_t b0 = 0;
#if defined(__AVX512F__)
    if (bs >= 16) {  // a max is exact in any order: the same block maxima as the 8-lane loop
        __mmask16 nan16 = 0;
        for (; b0 < nb; b0++) {
            const float* p = x + b0 * bs;
            __m512 m[4];
            int n = (int)(bs / 16);
            for (int u = 0; u < n; u++) m[u] = _mm512_loadu_ps(p + 16 * u);
            for (; n > 1; n /= 2)
                for (int u = 0; u < n / 2; u++) {
                    nan16 |= _mm512_cmp_ps_mask(m[2 * u], m[2 * u + 1], _CMP_UNORD_Q);
                    m[u] = _mm512_max_ps(m[2 * u], m[2 * u + 1]);
                }
            nan16 |= _mm512_cmp_ps_mask(m[0], m[0], _CMP_UNORD_Q);
            bmax[b0] = _mm512_reduce_max_ps(m[0]);
        }
        if (nan16) return false;
    }
#endif
    for (int64_t b = b0; b < nb; b++) {
        // Pairwise, not a chain: no block waits on the previous one's maxima (a chain of
        // dependent max_ps made this pass latency-bound, 3x slower).
        const float* p = x + b * bs;
        __m256 m[8];
        int n = (int)(bs / 8);
        for (int u = 0; u < n; u++) m[u] = _mm256_loadu_ps(p + 8 * u);
        for (; n > 1; n /= 2)
            for (int u = 0; u < n / 2; u++) {
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(m[2 * u], m[2 * u + 1], _CMP_UNORD_Q));
                m[u] = _mm256_max_ps(m[2 * u], m[2 * u + 1]);
            }
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(m[0], m[0], _CMP_UNORD_Q));  // bs == 8: no pairs
        __m256 h = _mm256_max_ps(m[0], _mm256_permute2f128_ps(m[0], m[0], 1));
        h = _mm256_max_ps(h, _mm256_shuffle_ps(h, h, 0x4E));
        h = _mm256_max_ps(h, _mm256_shuffle_ps(h, h, 0xB1));
        bmax[b] = _mm256_cvtss_f32(h);
    }
    if (_mm256_movemask_ps(nan) != 0) return false;
    for (int64_t j = nb * bs; j < V; j++)
        if (std::isnan(x[j])) return false;
    std::nth_element(bmax, bmax + (k - 1), bmax + nb, [](float a, float b) { return a > b; });
    const float t = bmax[k - 1];
    const __m256 tv = _mm256_set1_ps(t);
    int64_t n = 0, j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= V; j += 16)
        for (unsigned mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), _mm512_set1_ps(t), _CMP_GE_OQ); mask;
             mask &= mask - 1) {
            const int64_t id = j + __builtin_ctz(mask);
            cand[n++] = {x[id], id};
        }
#endif
    for (; j + 8 <= V; j += 8) {
        for (int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), tv, _CMP_GE_OQ)); mask;
             mask &= mask - 1) {
            const int64_t id = j + __builtin_ctz(mask);
            cand[n++] = {x[id], id};
        }
    }
    for (; j < V; j++)
        if (x[j] >= t) cand[n++] = {x[j], j};
    std::partial_sort(cand, cand + k, cand + n, before);  // n >= k: the k blocks' maxima are in
    for (int i = 0; i < k; i++) {
        vals[i] = cand[i].v;
        idx[i] = cand[i].i;
    }
    return true;
}

// The block size for topk_bounded: 64 ids, halved down to 8 until there are 2k blocks;
// 0 when even blocks of 8 are fewer than k (then topk_heap).
int64_t block_size(int64_t V, int k) {
    int64_t bs = 64;
    while (bs > 8 && V / bs < 2 * (int64_t)k) bs /= 2;
    return V / bs >= k ? bs : 0;
}

// log(sum(exp(x))) of one row: its max m, then m + log(sum(exp(x - m))) with four 8-lane
// accumulators in a fixed order. -inf for a row of -inf; NaN when the row holds a NaN.
float logsumexp_row(const float* x, int64_t V) {
    const int64_t full = V / 8 * 8;
    __m256 mx[4] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                    _mm256_set1_ps(-INFINITY)};
    __m256 nan = _mm256_setzero_ps();  // max_ps drops NaNs: they are collected apart
    int64_t j = 0;
#if defined(__AVX512F__)
    {  // a max is exact in any order
        __m512 m16[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)};
        __mmask16 nan16 = 0;
        for (; j + 32 <= full; j += 32)
            for (int u = 0; u < 2; u++) {
                const __m512 v = _mm512_loadu_ps(x + j + 16 * u);
                m16[u] = _mm512_max_ps(m16[u], v);
                nan16 |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            }
        const __m512 mm = _mm512_max_ps(m16[0], m16[1]);
        mx[0] = _mm512_castps512_ps256(mm);
        mx[1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(mm), 1));
        if (nan16) nan = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    }
#endif
    for (; j + 32 <= full; j += 32)
        for (int u = 0; u < 4; u++) {
            const __m256 v = _mm256_loadu_ps(x + j + 8 * u);
            mx[u] = _mm256_max_ps(mx[u], v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
    for (; j < full; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        mx[0] = _mm256_max_ps(mx[0], v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3])));
    float m = -INFINITY;
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (int u = 0; u < 8; u++) m = std::max(m, t[u]);
    for (int64_t i = full; i < V; i++) {
        has_nan = has_nan || std::isnan(x[i]);
        m = std::max(m, x[i]);
    }
    if (has_nan) return NAN;
    if (m == -INFINITY || m == INFINITY) return m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    j = 0;
#if defined(__AVX512F__)
    {  // s01 holds s[0] and s[1] side by side, s23 s[2] and s[3]: each lane's adds as below
        const __m512 mv16 = _mm512_set1_ps(m);
        __m512 s01 = _mm512_setzero_ps(), s23 = _mm512_setzero_ps();
        for (; j + 32 <= full; j += 32) {
            s01 = _mm512_add_ps(s01, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv16)));
            s23 = _mm512_add_ps(s23, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16), mv16)));
        }
        s[0] = _mm512_castps512_ps256(s01);
        s[1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s01), 1));
        s[2] = _mm512_castps512_ps256(s23);
        s[3] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s23), 1));
    }
#endif
    for (; j + 32 <= full; j += 32)
        for (int u = 0; u < 4; u++)
            s[u] = _mm256_add_ps(s[u], exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8 * u), mv)));
    for (; j < full; j += 8) s[0] = _mm256_add_ps(s[0], exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv)));
    if (full < V) {  // the partial last vector: its missing lanes contribute 0
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(V - full)), lanes));
        const __m256 e = exp8(_mm256_sub_ps(batchgen::load_part(x + full, V - full), mv));
        s[1] = _mm256_add_ps(s[1], _mm256_and_ps(e, valid));
    }
    // exp8 clamps below -88.4 (e^-88.4 ~ 4e-39 per element, not 0): against the max's own
    // 1 that is far below float32's resolution, so the sum is unchanged.
    return m + std::log(hsum8(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3]))));
}

// lowbias32 (C. Wellons, "Prospecting for hash functions", 2018): engine/sampling.py's _mix32_.
inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// batchgen_race_candidates' bound: see there.
struct RaceTable {
    static constexpr double kLow = -8.0, kPerUnit = 16.0;  // buckets of d: 1/16 wide from -8
    static constexpr int kN = (int)((23.5 - kLow) * kPerUnit);
    static constexpr double kShift = kLow + 1e-6;  // bucket(d) = floor((d - kShift) * 16): d taken 1e-6 lower
    uint32_t h[kN];  // a token in bucket k can win only if its hash >= h[k]
    RaceTable() : h() {
        for (int k = 0; k < kN; k++) {
            const double t = std::exp(-std::exp(-(kLow + k / kPerUnit))) * 0x1p32 * (1.0 - 1e-9) - 0.5;
            h[k] = t <= 1.0 ? 0 : (uint32_t)std::min(t - 1.0, 4294967295.0);
        }
    }
};
// Built on first use, not while the library loads: a static initializer runs at dlopen on
// whatever CPU loads the file, and compiled for AVX-512 its double-to-unsigned conversion is
// an AVX-512 instruction (vcvttsd2usi), which killed any process that merely loaded an
// AVX-512 build on an AVX2-only CPU (the AMX build's export test does).
const uint32_t* race_table() {
    static const RaceTable table;
    return table.h;
}

// d's bucket clamped to [-1, kN] (-1: always kept, kN: never); NaN gives -1 (kept).
inline double race_bucket(double s, float x) {
    const double t = std::floor((s - (double)x - RaceTable::kShift) * RaceTable::kPerUnit);
    if (t != t) return -1.0;
    return std::max(-1.0, std::min((double)RaceTable::kN, t));
}

// 8 lanes of mix32.
inline __m256i mix32x8(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// 4 buckets of race_bucket's, as int32: the same arithmetic (exact conversion, subtraction,
// multiplication by 16, floor), NaN to -1.
inline __m128i race_buckets4(__m256d s, __m128 x) {
    const __m256d t = _mm256_floor_pd(_mm256_mul_pd(_mm256_sub_pd(_mm256_sub_pd(s, _mm256_cvtps_pd(x)),
                                                                  _mm256_set1_pd(RaceTable::kShift)),
                                                    _mm256_set1_pd(RaceTable::kPerUnit)));
    // min(kN, t), then max(-1, .): each returns its second operand where one is NaN, so NaN
    // stays NaN, and NaN converts to INT_MIN (< 0: kept)
    const __m256d c = _mm256_max_pd(_mm256_set1_pd(-1.0), _mm256_min_pd(_mm256_set1_pd(RaceTable::kN), t));
    return _mm256_cvttpd_epi32(c);
}

}  // namespace

extern "C" {

// The k largest of each of B rows of x (row b at x + b * ld, V floats), best first (ties by
// smaller id; NaN first): vals (B, k) float32 and idx (B, k) int64, contiguous. 1 <= k <= V.
void batchgen_topk(const float* x, int64_t B, int64_t V, int64_t ld, int k, float* vals, int64_t* idx,
                   int threads) {
    const int64_t bs = block_size(V, k);
#pragma omp parallel num_threads(threads) if (B > 1)
    {
        // Scratch kept per thread from call to call (OpenMP's threads persist): a fresh
        // V-sized buffer every step would be page faults and zeroing each time.
        static thread_local std::vector<Cand> cand;
        static thread_local std::vector<float> bmax;
        cand.resize(std::max<size_t>(cand.size(), bs ? V : k));
        bmax.resize(std::max<size_t>(bmax.size(), bs ? V / bs : 0));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const float* row = x + b * ld;
            if (bs == 0 || !topk_bounded(row, V, k, bs, vals + b * k, idx + b * k, cand.data(), bmax.data()))
                topk_heap(row, V, k, vals + b * k, idx + b * k, cand.data());
        }
    }
}

// The race's uniforms for every token of B rows (engine/sampling.py, race_noise): row b of
// out (at out + b * ld, V doubles) gets u[v] = (h + 0.5) / 2^32, h = lowbias32 chained over
// first[v] (token v's first round), positions[b], keys[b, 1] and keys[b, 0], each word
// taken modulo 2^32. Integer arithmetic, an exact conversion, an exact add and a
// power-of-two scaling: the same bits as the torch operations it replaces, on any CPU.
// One pass that writes each element once, where torch makes about 30 over the row.
void batchgen_race_uniforms(const int32_t* first, int64_t V, const int64_t* keys, const int64_t* positions,
                            int64_t B, double* out, int64_t ld, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const uint32_t p = (uint32_t)positions[b], k1 = (uint32_t)keys[2 * b + 1], k0 = (uint32_t)keys[2 * b];
        double* row = out + b * ld;
        for (int64_t v = 0; v < V; v++) {
            const uint32_t h = mix32(mix32(mix32((uint32_t)first[v] ^ p) ^ k1) ^ k0);
            row[v] = ((double)h + 0.5) * 0x1p-32;
        }
    }
}

// The tokens of B rows that can win the whole-vocabulary race (engine/sampling.py,
// _race_candidates), so that the race's two float64 logs run on them alone. Token v of row b
// scores x[v] - log(-log u[v]) (x = the row's float32 q widened; u as batchgen_race_uniforms),
// and s0[b] is one token's score: the winner scores at least s0, and -log(-log u) rises with
// u, so a token at d = s0 - x[v] can reach s0 only if u[v] >= exp(-exp(-d)). The test runs on
// the integer hash against a table of that bound (race_table(): d in steps of 1/16, each
// bucket's bound at its low end, lowered by a relative 1e-9 and one step, d taken 1e-6
// lower): it keeps every token that can win, and a few that cannot. No token scores above
// x[v] + 22.87 (u < 1 - 2^-33), so d > 23.5 is never kept. Writes row b's candidates in
// increasing token order (idx at idx + b * cap, their u at u + b * cap) while they fit, and
// their number to count[b]; a row with more than cap stops there (count[b] = cap + 1) and
// the caller races its whole vocabulary instead.
void batchgen_race_candidates(const int32_t* first, int64_t V, const int64_t* keys, const int64_t* positions,
                              const float* q, int64_t q_ld, const double* s0, int64_t B, int64_t cap, int64_t* idx,
                              double* u, int64_t* count, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const uint32_t p = (uint32_t)positions[b], k1 = (uint32_t)keys[2 * b + 1], k0 = (uint32_t)keys[2 * b];
        const float* row = q + b * q_ld;
        int64_t* ib = idx + b * cap;
        double* ub = u + b * cap;
        const double s = s0[b];
        const uint32_t* table = race_table();
        int64_t n = 0;
        auto keep = [&](int64_t v, uint32_t h) {  // false once the row overflows
            if (n == cap) {
                n = cap + 1;
                return false;
            }
            ib[n] = v;
            ub[n] = ((double)h + 0.5) * 0x1p-32;
            n++;
            return true;
        };
        // 8 tokens at a time: buckets, hashes and the test in vectors, the rare kept ones
        // written in token order
        const __m256d sv = _mm256_set1_pd(s);
        const __m256i pv = _mm256_set1_epi32((int)p), k1v = _mm256_set1_epi32((int)k1),
                      k0v = _mm256_set1_epi32((int)k0), top = _mm256_set1_epi32(RaceTable::kN - 1),
                      zero = _mm256_setzero_si256(), nv = _mm256_set1_epi32(RaceTable::kN);
        int64_t v = 0;
        bool open = true;
        for (; open && v + 8 <= V; v += 8) {
            const __m256 x = _mm256_loadu_ps(row + v);
            const __m256i k = _mm256_set_m128i(race_buckets4(sv, _mm256_extractf128_ps(x, 1)),
                                               race_buckets4(sv, _mm256_castps256_ps128(x)));
            const __m256i reach = _mm256_cmpgt_epi32(nv, k);  // k < kN
            if (_mm256_testz_si256(reach, reach)) continue;  // all out of reach: no hash needed
            const __m256i f = _mm256_loadu_si256((const __m256i*)(first + v));
            const __m256i h = mix32x8(_mm256_xor_si256(
                mix32x8(_mm256_xor_si256(mix32x8(_mm256_xor_si256(f, pv)), k1v)), k0v));
            const __m256i thr = _mm256_i32gather_epi32((const int*)table,
                                                       _mm256_min_epi32(_mm256_max_epi32(k, zero), top), 4);
            const __m256i above = _mm256_cmpeq_epi32(_mm256_max_epu32(h, thr), h);  // h >= thr, unsigned
            const __m256i kept = _mm256_or_si256(_mm256_cmpgt_epi32(zero, k), _mm256_and_si256(reach, above));
            unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(kept));
            if (mask == 0) continue;
            alignas(32) uint32_t hs[8];
            _mm256_store_si256((__m256i*)hs, h);
            for (; mask != 0 && open; mask &= mask - 1) {
                const int j = __builtin_ctz(mask);
                open = keep(v + j, hs[j]);
            }
        }
        for (; open && v < V; v++) {
            const double k = race_bucket(s, row[v]);
            if (k >= RaceTable::kN) continue;
            const uint32_t h = mix32(mix32(mix32((uint32_t)first[v] ^ p) ^ k1) ^ k0);
            if (k >= 0 && h < table[(int)k]) continue;
            open = keep(v, h);
        }
        count[b] = n;
    }
}

// out[b] = log(sum(exp(row b))) for B rows of x (row b at x + b * ld, V floats).
void batchgen_logsumexp(const float* x, int64_t B, int64_t V, int64_t ld, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (B > 1)
    for (int64_t b = 0; b < B; b++) out[b] = logsumexp_row(x + b * ld, V);
}

}  // extern "C"
