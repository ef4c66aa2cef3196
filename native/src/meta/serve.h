// The master's native front for its hottest ops (issue #35): a get or exists request body answered from the
// object table in one C++ pass, with no Python decode, dispatch or encode. kvplugins/store/master/rpc_server.py
// offers it each whole request frame of an authenticated raw connection first; everything it does not take
// (another op, a key that is not plain ASCII, an unknown option, an object with more than one replica or only a
// disk copy, a batch over the key limit) is left untouched for the Python path, which answers it (and every error) as
// before. The answers are those of master/service.py op_get (both forms) and op_exists, byte for byte in meaning.
// A slab put (master/slabs.py op_put) is served in two steps, because its slab lives in Python: serve() parses and
// checks the request (PutRequest), the caller looks its slab up, and commit_put() applies it or changes nothing.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "table.h"

namespace kvp::meta {

enum FrontOp : uint32_t { kGet = 1, kExists = 2, kPut = 4 };   // also the bits of Limits::ops

struct Limits {
  uint32_t ops;          // the FrontOps the connection's role may run (others go to Python, which refuses them)
  uint64_t max_keys;     // entries per request taken here: min(max_batch, service.py FRONT_MAX_KEYS)
  uint64_t max_key_bytes;
  uint64_t ttl_ms;       // a get's lease (MasterConfig.lease_ttl_ms)
};

// A slab put's request in its one fast form: every entry [key, size, slab, offset] names the same slab; opts
// {} or {"xxh3": nil or one uint-or-nil per entry}. Keys are views into the request body.
struct PutRequest {
  uint64_t rid = 0, slab = 0;
  std::vector<std::string_view> keys;
  std::vector<uint64_t> sizes, offs, sums;
  std::vector<uint8_t> has_sum;
};

struct Served {
  std::string reply;     // the reply body: [1, rid, true, payload] (empty for kPut: see put)
  FrontOp op;
  uint64_t keys = 0, hits = 0;
  std::optional<PutRequest> put;   // kPut: the parsed request, for commit_put
};

// The answer to request `body` at master time `now` (s), or nullopt (nothing changed) for the Python path.
// names/regions: the table's interned segment names and their region ids (-1 unknown).
std::optional<Served> serve(Table& t, const std::vector<std::string>& names, const std::vector<int64_t>& regions,
                            std::string_view body, double now, const Limits& lim);

// Applies put `q` into the slab whose unused part is [front, end) of segment `seg` (the table's id), whose
// allocations are rounded up to `align` (a power of two), at master time `now`: when every entry lies back to back
// from `front` and inside the slab, and no key is in the table or repeats, each key becomes a complete object (as
// slabs.py _put_run), `reply` its all-OK reply, `rounded` each entry's allocation size, and true comes back.
// Otherwise false with nothing changed (the Python path answers the request key by key).
bool commit_put(Table& t, const PutRequest& q, uint32_t seg, uint64_t align, uint64_t front, uint64_t end,
                double now, std::string& reply, std::vector<uint64_t>& rounded, std::vector<uint32_t>& recs);

}  // namespace kvp::meta
