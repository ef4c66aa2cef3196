// Hot copy path shared by the shm transport and the layout gather/scatter.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvp {

// Copies n spans: dst[i] <- src[i] for len[i] bytes. Spans must not overlap each other.
// Splits the work across up to `threads` threads when the total is large (>= 4 MiB).
void copy_batch(const uint64_t* dst, const uint64_t* src, const uint64_t* len, size_t n, int threads);

}  // namespace kvp
