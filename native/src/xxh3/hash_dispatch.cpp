#include <cstring>

#include "kvp_hash.h"

namespace kvp {
namespace {

// __builtin_cpu_supports checks cpuid and, for AVX/AVX-512, that the OS saves the registers (XCR0).
bool supported(const HashOps* ops) {
  if (ops == &kHashAvx512) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (ops == &kHashAvx2) return __builtin_cpu_supports("avx2");
  return true;  // SSE2 is part of x86-64
}

}  // namespace

const HashOps* hash_ops(const char* name) {
  static const HashOps* const tiers[] = {&kHashAvx512, &kHashAvx2, &kHashSse2};
  for (const HashOps* t : tiers)
    if ((std::strcmp(name, "auto") == 0 || std::strcmp(name, t->name) == 0) && supported(t)) return t;
  return nullptr;
}

const char* hash_tiers() {
  static const char* names = supported(&kHashAvx512) ? "avx512,avx2,sse2" : supported(&kHashAvx2) ? "avx2,sse2" : "sse2";
  return names;
}

}  // namespace kvp
