// Small batches in one native call from the transfer API's entry (issue #35): the RDMA transport hands this
// table the local regions it registered (their lkeys) and, for a remote region whose last small batch went well,
// the route (queue pair, remote address, rkey) it took. TransferEngine.read_spans / write_spans (and a small
// batch_read / batch_write) then check the spans and post them here, with no Python in between; anything the
// table cannot take (unknown region or route, too many spans or bytes, a busy or dead queue pair) comes back
// untouched, and the Python path runs it and names any error.
//
// Lifecycle, in call order: add_local per registered region; put_route after a good batch; run, from any thread;
// drop_routes when a path fails; drop_local before an MR is deregistered; clear (the routes) before the queue
// pairs close.
// The mutators wait for the runs in flight (a shared lock each), so a queue pair, MR or mapping is never released
// under a run. The caller keeps the objects a route points at (the remote descriptor, the queue pair) alive until
// after drop_routes / clear / a replacing put_route returned.
#pragma once
#include <atomic>
#include <cstdint>
#include <shared_mutex>
#include <string>
#include <vector>

#include "verbs.h"

namespace kvp::verbs {

struct FastLocal {
  uint64_t id, addr, length;
  bool readonly;
  std::vector<uint32_t> lkeys;  // per local NIC
};

struct FastRoute {
  const void* remote;  // the caller's descriptor object (identity only)
  uint64_t region;     // its region id
  std::string segment;
  QueuePair* qp;
  size_t nic;  // local NIC index: which lkey
  uint64_t raddr, rlength;
  uint32_t rkey;
};

struct FastCounts {
  uint64_t reads, writes, entries, bytes, wrs;
};

class FastRoutes {
 public:
  FastRoutes(uint64_t max_bytes, size_t max_spans, size_t signal_every);
  void add_local(FastLocal r);
  void drop_local(uint64_t id);
  void put_route(FastRoute r);          // replaces the route of the same (remote, region)
  void drop_routes(const std::string& segment);
  void clear();  // every route (the locals stay)
  // Moves span j (length[j] bytes between laddr[j] and offset roff[j] of the remote region) by READ or WRITE,
  // done by deadline_at (CLOCK_MONOTONIC s). Returns n once every span completed; 0 where the table cannot take
  // the batch (nothing was posted); -1 when a work request failed (the queue pair is killed; `segment` names the
  // peer, whose routes the caller drops): the caller runs the batch again on its general path.
  // `digests` (nullptr, or n entries): set to each span's xxh3_64 of its local bytes after the move.
  long run(bool read, const void* remote, uint64_t region, const uint64_t* laddr, const uint64_t* roff,
           const uint64_t* length, size_t n, double deadline_at, std::string& segment, uint64_t* digests);
  FastCounts counts() const;

 private:
  const FastLocal* local(uint64_t addr, uint64_t length) const;
  const uint64_t max_bytes_;
  const size_t max_spans_, signal_every_;
  mutable std::shared_mutex mu_;
  std::vector<FastLocal> locals_;  // by address
  std::vector<FastRoute> routes_;
  std::atomic<uint64_t> reads_{0}, writes_{0}, entries_{0}, bytes_{0}, wrs_{0};
};

}  // namespace kvp::verbs
