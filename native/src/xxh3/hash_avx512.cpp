// xxh3_64 helpers built for avx512 (flags in CMakeLists.txt).
#include "hash_impl.h"

namespace kvp {
extern const HashOps kHashAvx512 = {"avx512", copy_hash, hash_spans};
}  // namespace kvp
