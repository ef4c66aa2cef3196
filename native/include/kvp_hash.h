// xxh3_64 tiers (SSE2 baseline, AVX2, AVX-512) picked at run time by cpu support: src/xxh3/hash_dispatch.cpp.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvp {

struct HashOps {
  const char* name;
  // memcpy len bytes src -> dst chunk by chunk, hashing each chunk from dst right after it lands; returns xxh3_64.
  uint64_t (*copy_hash)(char* dst, const char* src, uint64_t len);
  // xxh3_64 of the concatenation of n spans (addresses and byte lengths).
  uint64_t (*hash_spans)(const uint64_t* addr, const uint64_t* len, size_t n);
};

extern const HashOps kHashSse2, kHashAvx2, kHashAvx512;

// The tier named `name` ("auto" = the best this CPU and OS support; else sse2, avx2, avx512), or nullptr if
// unknown or unsupported here.
const HashOps* hash_ops(const char* name);
// Names of the tiers this CPU supports, best first, comma-separated.
const char* hash_tiers();

}  // namespace kvp
