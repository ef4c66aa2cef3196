// One ISA tier of the xxh3_64 helpers. Included once per tier by hash_<tier>.cpp, each compiled with its own
// target flags; XXH_INLINE_ALL makes every xxhash symbol static, so the tiers never mix (no ODR clash).
// The digest is the same on every tier (xxhash 0.8.1, the Python package's XXH3_64bits).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "kvp_hash.h"

namespace {

constexpr uint64_t kChunk = 64ull << 10;  // copy-then-hash unit: still in L2 when it is hashed

uint64_t copy_hash(char* dst, const char* src, uint64_t len) {
  if (len <= kChunk) {
    std::memcpy(dst, src, len);
    return XXH3_64bits(dst, len);
  }
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  for (uint64_t off = 0; off < len; off += kChunk) {
    const uint64_t n = std::min(kChunk, len - off);
    std::memcpy(dst + off, src + off, n);
    XXH3_64bits_update(&st, dst + off, n);
  }
  return XXH3_64bits_digest(&st);
}

uint64_t hash_spans(const uint64_t* addr, const uint64_t* len, size_t n) {
  if (n == 1) return XXH3_64bits(reinterpret_cast<const void*>(addr[0]), len[0]);
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  for (size_t i = 0; i < n; ++i) XXH3_64bits_update(&st, reinterpret_cast<const void*>(addr[i]), len[i]);
  return XXH3_64bits_digest(&st);
}

}  // namespace
