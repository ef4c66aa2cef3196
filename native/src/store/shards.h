// A sharded store's `exists` routed natively (issue #35): each key hashed onto the ring (xxh3_64 of its UTF-8
// bytes, the first point at or after it, wrapping: store/cluster/ring.py), one request per shard sent on that
// shard master's connection, every reply read in one poll loop and merged back in the caller's order, with the
// GIL released. kvplugins/store/client/router.py takes it when no shard move is on; it goes on from any reply
// this does not finish (a refusal) and treats a failed connection as that shard down.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kvp_hash.h"

namespace kvp::store {

struct ShardAnswer {
  int status;        // kDone (merged into `out`), kAsPython (text: the reply body), kIoError / kTimeout (text:
                     // what failed; close the connection), kNotSent (no key of this batch is on the shard)
  std::string text;
};

// fds[s], rids[s]: shard s's connection and request id. points (ascending, npoints > 0) and point_shard[i] < the
// number of shards: the ring. out[k] = 1 / 0 when shard answered key k is / is not stored, 2 where it did not.
std::vector<ShardAnswer> shard_exists(const std::vector<int>& fds, const std::vector<uint64_t>& rids,
                                      const std::vector<std::string>& keys, const uint64_t* points,
                                      const uint32_t* point_shard, size_t npoints, double timeout_ms,
                                      const HashOps* ops, uint8_t* out);

}  // namespace kvp::store
