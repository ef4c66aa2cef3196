// The master's native front for its hottest ops (issue #35): a get or exists request body answered from the
// object table in one C++ pass, with no Python decode, dispatch or encode. kvplugins/store/master/rpc_server.py
// offers it each whole request frame of an authenticated raw connection first; everything it does not take
// (another op, a key that is not plain ASCII, an unknown option, an object with more than one replica or only a
// disk copy, a batch over the key limit) is left untouched for the Python path, which answers it (and every error) as
// before. The answers are those of master/service.py op_get (both forms) and op_exists, byte for byte in meaning.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "table.h"

namespace kvp::meta {

enum FrontOp : uint32_t { kGet = 1, kExists = 2 };   // also the bits of Limits::ops

struct Limits {
  uint32_t ops;          // the FrontOps the connection's role may run (others go to Python, which refuses them)
  uint64_t max_keys;     // entries per request taken here: min(max_batch, service.py FRONT_MAX_KEYS)
  uint64_t max_key_bytes;
  uint64_t ttl_ms;       // a get's lease (MasterConfig.lease_ttl_ms)
};

struct Served {
  std::string reply;     // the reply body: [1, rid, true, payload]
  FrontOp op;
  uint64_t keys = 0, hits = 0;
};

// The answer to request `body` at master time `now` (s), or nullopt (nothing changed) for the Python path.
// names/regions: the table's interned segment names and their region ids (-1 unknown).
std::optional<Served> serve(Table& t, const std::vector<std::string>& names, const std::vector<int64_t>& regions,
                            std::string_view body, double now, const Limits& lim);

}  // namespace kvp::meta
