// xxh3_64 helpers built for sse2 (flags in CMakeLists.txt).
#include "hash_impl.h"

namespace kvp {
extern const HashOps kHashSse2 = {"sse2", copy_hash, hash_spans};
}  // namespace kvp
