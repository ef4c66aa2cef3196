// Hot copy path shared by the shm transport and the layout gather/scatter, and the object checksums
// (xxh3_64, the same digest as the Python ``xxhash.xxh3_64_intdigest``).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvp_hash.h"

namespace kvp {

// Copies n spans: dst[i] <- src[i] for len[i] bytes. Spans must not overlap each other.
// Splits the work across up to `threads` threads when the total is large (>= 4 MiB).
// With `digests` (n entries), also sets digests[i] = xxh3_64 of span i's bytes, hashed from the destination
// chunk by chunk right after each chunk is copied (while it is in cache): one pass over the bytes. Threads
// then take whole spans (a span's hash is sequential). `ops`: the xxh3 tier (hash_ops.h), needed with digests.
void copy_batch(const uint64_t* dst, const uint64_t* src, const uint64_t* len, size_t n, int threads,
                uint64_t* digests = nullptr, const HashOps* ops = nullptr);

// digests[k] = xxh3_64 of the concatenation of the spans i with owner[i] == k, for k < nkeys (spans of one
// key must be consecutive; keys without spans get the digest of no bytes). Returns false if owner[i] >= nkeys
// or a key's spans are not consecutive.
bool hash_keys(const uint64_t* addr, const uint64_t* len, const uint64_t* owner, size_t n, uint64_t* digests,
               size_t nkeys, int threads, const HashOps* ops);

}  // namespace kvp
