// AMX tiles for the compiled kernels that use them (gemm_amx.cpp, decode attention's prompt
// blocks): the tile configuration, and the tile instructions as macros, which the
// BATCHGEN_AMX_EMULATE test build computes in scalar code after the pseudo-code named by
// BATCHGEN_AMX_EMULATE_MODE (gemm_amx.cpp's header). Included only where the build has AMX
// (-mamx-tile -mamx-bf16) or emulates it; `BATCHGEN_HAVE_TILES` says so.
#pragma once

#if (defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(BATCHGEN_AMX_EMULATE)
#define BATCHGEN_HAVE_TILES 1

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace batchgen::amx {

// The 64-byte tile configuration of ldtilecfg (palette 1).
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// tmm0-3: C (16 rows x 16 float32), tmm4-5: A (16 rows x 16 pairs), tmm6-7: B (16 pair-rows
// x 16 columns), each 16 rows of 64 bytes.
inline TileConfig tile_config() {
    TileConfig c;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    return c;
}

// GCC's AMX intrinsics are asm statements that do not tell the compiler they read or write
// memory (ldtilecfg: 8 of the 64 bytes): a compiler barrier around them keeps the buffers'
// stores before a load and their loads after a store.
#define BG_BARRIER() __asm__ volatile("" ::: "memory")

#if defined(BATCHGEN_AMX_EMULATE)
struct EmuTile {
    int rows = 0, colsb = 0;
    alignas(64) unsigned char d[16][64];
};
inline thread_local EmuTile emu[8];

inline void emu_config(const TileConfig* c) {
    for (int t = 0; t < 8; t++) {
        emu[t].rows = c->rows[t];
        emu[t].colsb = c->colsb[t];
        std::memset(emu[t].d, 0, sizeof(emu[t].d));
    }
}
inline void emu_load(int t, const void* base, int64_t stride) {
    std::memset(emu[t].d, 0, sizeof(emu[t].d));
    for (int r = 0; r < emu[t].rows; r++) std::memcpy(emu[t].d[r], (const char*)base + r * stride, emu[t].colsb);
}
inline void emu_store(int t, void* base, int64_t stride) {
    for (int r = 0; r < emu[t].rows; r++) std::memcpy((char*)base + r * stride, emu[t].d[r], emu[t].colsb);
}
inline void emu_zero(int t) { std::memset(emu[t].d, 0, sizeof(emu[t].d)); }

inline int emu_mode() {  // 0 guide, 1 odd, 2 sdm
    static const int mode = [] {
        const char* m = std::getenv("BATCHGEN_AMX_EMULATE_MODE");
        if (m != nullptr && std::strcmp(m, "odd") == 0) return 1;
        if (m != nullptr && std::strcmp(m, "guide") == 0) return 0;
        return 2;
    }();
    return mode;
}

inline float emu_bf16(const unsigned char* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float emu_fma(float a, float b, float c) {
    return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}
inline float emu_add(float a, float b) { return _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(a), _mm_set_ss(b))); }

inline void emu_dp(int c, int a, int b) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr((csr & ~0x6000u) | 0x8040u);  // RNE, FTZ, DAZ
    const int mode = emu_mode();
    EmuTile &C = emu[c], &A = emu[a], &B = emu[b];
    for (int m = 0; m < C.rows; m++)
        for (int n = 0; n < C.colsb / 4; n++) {
            float acc;
            std::memcpy(&acc, C.d[m] + 4 * n, 4);
            float even = 0.f, odd = 0.f;
            for (int k = 0; k < A.colsb / 4; k++) {
                const float a0 = emu_bf16(A.d[m] + 4 * k), a1 = emu_bf16(A.d[m] + 4 * k + 2);
                const float b0 = emu_bf16(B.d[k] + 4 * n), b1 = emu_bf16(B.d[k] + 4 * n + 2);
                if (mode == 0) {
                    acc = emu_fma(a1, b1, emu_fma(a0, b0, acc));
                } else if (mode == 1) {
                    acc = emu_fma(a0, b0, emu_fma(a1, b1, acc));
                } else {
                    even = emu_fma(a0, b0, even);
                    odd = emu_fma(a1, b1, odd);
                }
            }
            if (mode == 2) acc = emu_add(acc, emu_add(even, odd));
            std::memcpy(C.d[m] + 4 * n, &acc, 4);
        }
    _mm_setcsr(csr);
}

#define BG_TILE_CONFIG(cfg) emu_config(cfg)
#define BG_TILE_RELEASE() ((void)0)
#define BG_TILE_ZERO(t) emu_zero(t)
#define BG_TILE_LOAD(t, p, s) emu_load(t, p, s)
#define BG_TILE_STORE(t, p, s) emu_store(t, p, s)
#define BG_TILE_DP(c, a, b) emu_dp(c, a, b)
inline constexpr bool kEmulated = true;
#else
#define BG_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define BG_TILE_RELEASE() _tile_release()
#define BG_TILE_ZERO(t) _tile_zero(t)
#define BG_TILE_LOAD(t, p, s) _tile_loadd(t, p, s)
#define BG_TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define BG_TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
inline constexpr bool kEmulated = false;
#endif


}  // namespace batchgen::amx

#endif
