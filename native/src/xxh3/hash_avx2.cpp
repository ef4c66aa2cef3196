// xxh3_64 helpers built for avx2 (flags in CMakeLists.txt).
#include "hash_impl.h"

namespace kvp {
extern const HashOps kHashAvx2 = {"avx2", copy_hash, hash_spans};
}  // namespace kvp
