// The AMX tile instructions the kernels use, done in scalar C++ on a per-thread register file, for the
// AmxEmulated tier: CI runs kernels_amx.inc's packing, tiling and epilogues on CPUs without AMX. The semantics
// follow Intel's pseudo-code (Intel 64 and IA-32 Architectures Software Developer's Manual, Vol. 2, LDTILECFG,
// TILELOADD, TILESTORED, TILEZERO, TDPBF16PS, TDPBSUD), except that TDPBF16PS rounds like an fp32 FMA chain
// here; tests compare against a reference with a tolerance. Speed is irrelevant (tests only). Defines the same
// names as GCC's AMX intrinsics (which exist only with -mamx-*, never set for this translation unit).
#pragma once
#include <cstdint>
#include <cstring>

namespace kvp::moe::amx_emu {

struct Tiles {
  uint8_t data[8][16][64];
  int rows[8], colsb[8];
};

inline Tiles& tiles() {
  static thread_local Tiles t;
  return t;
}

inline float bf16f(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void loadconfig(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);  // byte 0 palette, 16..47 colsb (u16), 48..63 rows
  Tiles& t = tiles();
  for (int i = 0; i < 8; ++i) {
    uint16_t cb;
    std::memcpy(&cb, c + 16 + 2 * i, 2);
    t.colsb[i] = c[0] == 1 ? cb : 0;
    t.rows[i] = c[0] == 1 ? c[48 + i] : 0;
  }
}

inline void zero(int i) { std::memset(tiles().data[i], 0, sizeof(tiles().data[i])); }

inline void loadd(int i, const void* base, long stride) {
  Tiles& t = tiles();
  zero(i);
  for (int r = 0; r < t.rows[i]; ++r)
    std::memcpy(t.data[i][r], static_cast<const uint8_t*>(base) + r * stride, t.colsb[i]);
}

inline void stored(int i, void* base, long stride) {
  Tiles& t = tiles();
  for (int r = 0; r < t.rows[i]; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[i][r], t.colsb[i]);
}

// C[m][n] (fp32) += sum over k-pairs p of A[m][2p] * B[p][2n] + A[m][2p+1] * B[p][2n+1] (bf16 elements)
inline void dpbf16ps(int c, int a, int b) {
  Tiles& t = tiles();
  for (int m = 0; m < t.rows[c]; ++m)
    for (int n = 0; n < t.colsb[c] / 4; ++n) {
      float acc;
      std::memcpy(&acc, &t.data[c][m][4 * n], 4);
      for (int p = 0; p < t.colsb[a] / 4; ++p)
        for (int e = 0; e < 2; ++e) {
          uint16_t x, y;
          std::memcpy(&x, &t.data[a][m][4 * p + 2 * e], 2);
          std::memcpy(&y, &t.data[b][p][4 * n + 2 * e], 2);
          acc += bf16f(x) * bf16f(y);
        }
      std::memcpy(&t.data[c][m][4 * n], &acc, 4);
    }
}

// C[m][n] (int32) += sum over k-quads p of the products of s8 A[m][4p + e] and u8 B[p][4n + e]
inline void dpbsud(int c, int a, int b) {
  Tiles& t = tiles();
  for (int m = 0; m < t.rows[c]; ++m)
    for (int n = 0; n < t.colsb[c] / 4; ++n) {
      int32_t acc;
      std::memcpy(&acc, &t.data[c][m][4 * n], 4);
      for (int p = 0; p < t.colsb[a] / 4; ++p)
        for (int e = 0; e < 4; ++e)
          acc += int32_t(int8_t(t.data[a][m][4 * p + e])) * int32_t(t.data[b][p][4 * n + e]);
      std::memcpy(&t.data[c][m][4 * n], &acc, 4);
    }
}

}  // namespace kvp::moe::amx_emu

#define _tile_loadconfig(cfg) ::kvp::moe::amx_emu::loadconfig(cfg)
#define _tile_release() ((void)0)
#define _tile_zero(i) ::kvp::moe::amx_emu::zero(i)
#define _tile_loadd(i, base, stride) ::kvp::moe::amx_emu::loadd(i, base, long(stride))
#define _tile_stored(i, base, stride) ::kvp::moe::amx_emu::stored(i, base, long(stride))
#define _tile_dpbf16ps(c, a, b) ::kvp::moe::amx_emu::dpbf16ps(c, a, b)
#define _tile_dpbsud(c, a, b) ::kvp::moe::amx_emu::dpbsud(c, a, b)
