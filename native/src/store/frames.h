// The master RPC's framing for native store ops (store/wire/protocol.py): a 4-byte big-endian length, then a
// msgpack body; requests [1, id, op, entries, opts], replies [1, id, ok, payload]. `exchange` sends one request
// frame on each of several connections and reads one reply frame from each, all in one poll loop (a native
// shard router's fan-out; a single op is the case of one). Sockets may be blocking or not: every call is
// MSG_DONTWAIT and waits in poll.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "../tcp/mp.h"

namespace kvp::store {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kVersion = 1;   // store/wire/protocol.py VERSION

// Where one connection's exchange ended.
enum ConnStatus : int { kBusy = -1, kReplied = 0, kBroken = 3, kLate = 4 };

struct Conn {
  int fd;
  std::string out;               // the request frame
  int status = kBusy;
  std::string body;              // kReplied: the reply body; else what failed
  size_t sent = 0, have = 0, want = 4;
  bool sized = false;
  std::vector<uint8_t> in = std::vector<uint8_t>(4096);
};

// Runs every connection's exchange until each replied or failed, or the deadline passed (kLate). A
// connection that failed is not usable again (bytes may be in flight): the caller closes it.
void exchange(std::vector<Conn>& conns, Clock::time_point deadline);

Clock::time_point deadline_in(double timeout_ms);

// A request frame: the 4-byte length, then [1, rid, op, <what body writes: entries, opts>].
template <class Body>
std::string request(uint64_t rid, const char* op, Body body) {
  std::string out(4, '\0');
  tcp::MpWriter w(out);
  w.array(5);
  w.uint(kVersion);
  w.uint(rid);
  w.str(op);
  body(w);
  const uint32_t n = uint32_t(out.size() - 4);
  for (int i = 0; i < 4; ++i) out[i] = char((n >> (8 * (3 - i))) & 0xff);
  return out;
}

// Reads [1, rid, true, of a reply; false for another version or id, or a refusal (ok false).
bool accepted(tcp::MpReader& r, uint64_t rid);

}  // namespace kvp::store
