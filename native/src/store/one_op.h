// One store op in one native call (issue #35), with the GIL released throughout.
// get_one: the master's `get` RPC on the client's authenticated connection, the copy + xxh3 out of a same-host
// segment this process already maps (the shm transport's mappings, mirrored in ShmMaps), the checksum compare.
// put_one: the copy + xxh3 into the client's slab in such a segment, then the master's `put` RPC.
// Whatever the common case does not cover (a miss on disk, a mapping not made yet, a peer gone, a checksum
// mismatch, a read past its lease, a refusal, an expired slab) hands the master's reply body back, so the
// Python client goes on from it with no second round trip and the same errors. Wrapped by kvplugins/native.py;
// used by kvplugins/store/client/store_client.py.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <utility>

#include "kvp_hash.h"

namespace kvp::store {

// The peer regions this process maps (segment id, region id) -> address and length, each with a pidfd of its
// owner (dup'ed: the table owns it), and segment names (as the master calls them) -> segment ids.
// forget/clear wait for reads in flight (they hold the shared lock while copying), so the caller may unmap after.
class ShmMaps {
 public:
  ShmMaps() = default;
  ShmMaps(const ShmMaps&) = delete;
  ShmMaps& operator=(const ShmMaps&) = delete;
  ~ShmMaps();
  // Returns false when pidfd >= 0 cannot be duplicated (nothing is added then).
  bool add(const std::string& segment, uint32_t region, uint64_t base, uint64_t length, int pidfd);
  void alias(const std::string& name, const std::string& segment);
  void forget(const std::string& segment);
  void clear();
  uint64_t entries() const { return entries_.load(); }   // reads done natively, and their bytes
  uint64_t bytes() const { return bytes_.load(); }

  struct Mapping { uint64_t base, length; int pidfd; };
  // Under the shared lock: the mapping of region `region` of the segment the master names `name`, or nullptr.
  const Mapping* find(std::string_view name, uint32_t region) const;
  std::shared_mutex& mutex() const { return mu_; }
  void count(uint64_t nbytes) { entries_ += 1; bytes_ += nbytes; }

 private:
  mutable std::shared_mutex mu_;
  std::map<std::pair<std::string, uint32_t>, Mapping, std::less<>> maps_;
  std::map<std::string, std::string, std::less<>> names_;
  std::atomic<uint64_t> entries_{0}, bytes_{0};
};

enum OpStatus : int { kDone = 0, kMiss = 1, kAsPython = 2, kIoError = 3, kTimeout = 4, kNotSent = 5 };

struct OpResult {
  int status;         // OpStatus
  uint64_t size = 0;  // kDone: the object's bytes (get), the entry's code, OK or EXISTS (put)
  std::string text;   // kAsPython: the reply body (msgpack); kIoError/kTimeout: what failed
};

// Sends [1, rid, "get", [key], {}] on socket `fd` (blocking or not: poll decides), reads its reply frame, and
// for an OK answer whose first replica lies in a mapped region reads the object into the n local spans
// (addresses and byte lengths; the caller checked they are writable registered memory). `verify`: compare the
// bytes' xxh3_64 with the object's checksum. Never throws.
OpResult get_one(int fd, uint64_t rid, const std::string& key, const uint64_t* addrs, const uint64_t* lens,
                  size_t n, double timeout_ms, ShmMaps& maps, bool verify, const HashOps* ops);

// Copies the n local spans (readable registered memory) to `offset` of region `region` of segment `segment`
// (the master's name) hashing them, then sends [1, rid, "put", [[key, size, slab, offset]], {"xxh3": [digest]}]
// and reads its reply. kNotSent: nothing was written or sent (no mapping of that region, its owner is gone, or
// `write_ms` (the time left to write into the slab) is not positive). kDone: the answer was OK or EXISTS.
OpResult put_one(int fd, uint64_t rid, const std::string& key, const uint64_t* addrs, const uint64_t* lens,
                 size_t n, const std::string& segment, uint32_t region, uint64_t offset, uint64_t slab,
                 double write_ms, double timeout_ms, ShmMaps& maps, const HashOps* ops);

}  // namespace kvp::store
