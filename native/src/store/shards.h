// A sharded store's keyed reads routed natively (issue #35): each key hashed onto the ring (xxh3_64 of its UTF-8
// bytes, the first point at or after it, wrapping: store/cluster/ring.py), then one request per shard sent on
// that shard master's connection, every reply read in one poll loop, with the GIL released.
// kvplugins/store/client/router.py takes it when no shard move is on. `shard_exists` merges the answers back in
// the caller's order; `shard_call` (any other read op) hands each shard's reply body back with the shard of each
// key, for the caller to decode and merge. The caller goes on from any reply this does not finish (a refusal)
// and treats a failed connection as that shard down.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvp_hash.h"

namespace kvp::store {

struct ShardAnswer {
  int status;        // kDone (merged into `out`), kAsPython (text: the reply body), kIoError / kTimeout (text:
                     // what failed; close the connection), kNotSent (no key of this batch is on the shard)
  std::string text;
};

// The ring: points (ascending, npoints > 0) and point_shard[i] < the number of shards.
struct Ring {
  const uint64_t* points;
  const uint32_t* point_shard;
  size_t npoints;
};

// owner[k] = the shard of keys[k] on `ring`.
void ring_owners(const std::vector<std::string_view>& keys, const Ring& ring, const HashOps* ops, uint32_t* owner);

// fds[s], rids[s]: shard s's connection and request id (only shards that own a key are used); owner[k] < fds.size():
// key k's shard (ring_owners). out[k] = 1 / 0 when shard answered key k is / is not stored, 2 where it did not.
std::vector<ShardAnswer> shard_exists(const std::vector<int>& fds, const std::vector<uint64_t>& rids,
                                      const std::vector<std::string_view>& keys, const uint32_t* owner, double timeout_ms,
                                      uint8_t* out);

// `op` [keys on the shard] {} sent to each shard that owns a key. Each sent shard's answer is kAsPython (its reply
// body, keys in the caller's order) or kIoError / kTimeout.
std::vector<ShardAnswer> shard_call(const std::vector<int>& fds, const std::vector<uint64_t>& rids,
                                    const std::string& op, const std::vector<std::string_view>& keys,
                                    const uint32_t* owner, double timeout_ms);

}  // namespace kvp::store
