// One store op in one native call (issue #35), with the GIL released throughout.
// get_many: the master's `get` RPC on the client's authenticated connection, the copy + xxh3 out of a same-host
// segment this process already maps (the shm transport's mappings, mirrored in ShmMaps) or the frames from a
// node over the TCP transport's pooled connections (tcp::Peers), the checksum compare.
// put_many: the copy + xxh3 into the client's slab in such a segment (or, after write_tcp, its bytes written to
// a node over TCP), then the master's `put` RPC.
// Whatever the common case does not cover (a miss on disk, a mapping not made yet, a peer gone, a checksum
// mismatch, a read past its lease, a refusal, an expired slab) hands the master's reply body back, so the
// Python client goes on from it with no second round trip and the same errors. Wrapped by kvplugins/native.py;
// used by kvplugins/store/client/store_client.py.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvp_hash.h"
#include "../tcp/peers.h"

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

// Per key: kDone, kMiss, kAsPython, or kTcp (a TCP read planned in BatchResult::tcp). Per batch: kDone or the
// exchange's failure kIoError / kTimeout, or kNotSent (a put).
enum OpStatus : int { kDone = 0, kMiss = 1, kAsPython = 2, kIoError = 3, kTimeout = 4, kNotSent = 5, kTcp = 6 };

// A get's reads over TCP, planned by get_many and run after it (the master's connection free again): per peer,
// one frame batch on one idle pooled connection of `peers`. Owns copies of everything it needs (the spans'
// addresses stay the caller's memory, which must stay registered until run returns).
struct TcpReads {
  struct Key {
    size_t k, first;      // the key's index in the batch; its first span in the group's columns
    uint64_t size;
    bool check;           // compare the xxh3 of the bytes read with `sum`
    uint64_t sum;
  };
  struct Group {
    std::string peer;
    uint64_t limit;
    std::vector<Key> keys;
    std::vector<uint64_t> addrs, regions, offs, lens;
  };
  std::vector<Group> groups;
  tcp::Peers* peers = nullptr;
  const HashOps* ops = nullptr;
  std::chrono::steady_clock::time_point lease_end;
  double timeout_s = 0;
  // Turns each kTcp key of `codes` into kDone (every span arrived, checksum matched, within the lease) or
  // kAsPython (no idle connection, a frame failed, a mismatch, a read ending past the lease). Never throws.
  void run(std::string& codes);

 private:
  void read_group(const Group& g, std::string& codes);
};

// A batch's local spans: key k's are [starts[k], starts[k+1]) of (addrs, lens) (bytes; registered memory,
// writable for a get: the caller checked).
struct KeySpans {
  const uint64_t *addrs, *lens, *starts;
  size_t keys;
};

struct BatchResult {
  int status = kDone;   // kDone (replied: codes set), kIoError / kTimeout (body: what failed), kNotSent (put)
  std::string codes;    // per key: get: kDone, kMiss or kAsPython; put: the answer's code (OK, EXISTS, ...)
  std::string body;     // the reply body where the caller must read it (a get with a kAsPython key, a put with a
                        // code other than OK/EXISTS or an answer not parsed), else empty
  std::unique_ptr<TcpReads> tcp;   // a get's planned TCP reads (keys kTcp), or null
};

// Sends the column-form get of `keys` ([1, rid, "get", keys, {"cols": 1}]: master/service.py op_get) on socket
// `fd` and reads its reply; each hit whose first replica lies in a mapped region is read into its spans (copy +
// xxh3 in one pass), its checksum compared (`verify`) and its lease checked (kDone); each one in a region
// `peers` (may be null) routes to a TCP peer is planned for a TCP read (kTcp, BatchResult::tcp: frame batches
// within `transfer_timeout_ms`, the caller runs them once it has freed the connection `fd`). Each plain miss is
// kMiss, anything else kAsPython (another replica count, the disk tier, a region neither mapped nor routed, a dead
// owner, a size or checksum mismatch, a read ending past its lease). Never throws.
BatchResult get_many(int fd, uint64_t rid, const std::vector<std::string_view>& keys, const KeySpans& spans,
                     double timeout_ms, ShmMaps& maps, bool verify, const HashOps* ops, tcp::Peers* peers,
                     double transfer_timeout_ms);

// Copies each key's spans to offsets[k] of region `region` of segment `segment` (the master's name: the
// client's slab `slab`), hashing them, then sends [1, rid, "put", [[key, size, slab, offset], ...], {"xxh3":
// [...]}] and reads the reply. kNotSent: nothing was written or sent (no mapping of that region, its owner is
// gone, or `write_ms`, the time left to write into the slab, is not positive).
// `written` (may be null): the keys' bytes are already in the slab (write_tcp) with these xxh3 digests; only the
// `put` is sent.
BatchResult put_many(int fd, uint64_t rid, const std::vector<std::string_view>& keys, const KeySpans& spans,
                     const std::string& segment, uint32_t region, const uint64_t* offsets, uint64_t slab,
                     double write_ms, double timeout_ms, ShmMaps& maps, const HashOps* ops,
                     const uint64_t* written);

// Writes each key's spans to offsets[k] of region `region` of segment `segment` (the master's name: the client's
// slab) over one idle pooled connection to the TCP peer `peers` routes it to, within `timeout_ms`, fenced at
// `land_by_ms` (unix ms: the peer drops bytes arriving later, transfer/wire.py LATE_WRITE), then hashes them into
// `digests` (xxh3_64 per key). kWriteNotSent: nothing was sent (no route or idle connection, an object past the
// region's end); kWriteFailed: a frame failed (bytes may be partly written; fenced). Never throws.
enum WriteStatus : int { kWritten = 0, kWriteNotSent = 1, kWriteFailed = 2 };
WriteStatus write_tcp(tcp::Peers& peers, const KeySpans& spans, const std::string& segment, uint32_t region,
               const uint64_t* offsets, double timeout_ms, uint64_t land_by_ms, const HashOps* ops,
               std::vector<uint64_t>& digests);

}  // namespace kvp::store
