// Small batches in one native call from the transfer API's entry (issue #35): the RDMA transport hands this
// table the local regions it registered (their lkeys) and, for a remote region whose last small batch went well,
// the route (queue pair, remote address, rkey) it took. TransferEngine.read_spans / write_spans (and a small
// batch_read / batch_write) then check the spans and post them here, with no Python in between; anything the
// table cannot take (unknown region or route, too many spans or bytes, a busy or dead queue pair) comes back
// untouched, and the Python path runs it and names any error.
//
// Lifecycle, in call order: locals.add per registered region; put_route after a good batch; run, from any thread;
// drop_routes when a path fails; locals.drop before an MR is deregistered; clear (the routes) before the queue
// pairs close.
// A run holds the entries it uses (shared pointers taken under a brief shared lock), not the table, so a run on a
// stalled peer delays no other batch or mutator. A route owns the caller's objects it points at (`owner`: the
// remote descriptor and the queue pair's Python objects), released with the last holder: the calls that can drop
// a route (put_route, drop_routes, clear, run) hand it back to the caller to release where that is safe (with the
// GIL held: bind.cpp). locals.drop waits for the runs holding that region (its memory stays mapped until then).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "kvp_fastpath.h"
#include "verbs.h"

namespace kvp::verbs {

struct FastRoute {
  const void* remote;  // the caller's descriptor object (identity; kept alive by `owner`)
  uint64_t region;     // its region id
  std::string segment;
  QueuePair* qp;        // kept alive by `owner`
  size_t nic, rnic;     // local NIC index (which lkey), the peer's NIC index
  uint64_t raddr, rlength;
  uint32_t rkey;
  std::shared_ptr<void> owner;  // released by the caller's rule (see above)
};
using Routes = RouteTable<FastRoute>::List;

struct FastCounts {
  uint64_t reads, writes, entries, bytes, wrs;
};

class FastRoutes {
 public:
  FastRoutes(uint64_t max_bytes, size_t max_spans, size_t signal_every, size_t max_routes);
  Locals locals;  // the registered regions, their keys an lkey per local NIC
  // Each returns the routes it took out (the caller releases them).
  Routes put_route(FastRoute r);  // replaces the route of the same (remote, region); past max_routes, all go
  Routes drop_routes(const std::string& segment);
  Routes clear();  // every route (the locals stay)
  // Moves span j (length[j] bytes between laddr[j] and offset roff[j] of the remote region) by READ or WRITE,
  // done by deadline_at (CLOCK_MONOTONIC s). Returns n once every span completed; 0 where the table cannot take
  // the batch (nothing was posted); -1 when a work request failed (the queue pair is killed; `segment` names the
  // peer, whose routes the caller drops): the caller runs the batch again on its general path.
  // `digests` (nullptr, or n entries): set to each span's xxh3_64 of its local bytes after the move. `keep`: the
  // route used (the caller releases it).
  long run(bool read, const void* remote, uint64_t region, const uint64_t* laddr, const uint64_t* roff,
           const uint64_t* length, size_t n, double deadline_at, uint64_t* digests,
           std::shared_ptr<const FastRoute>& keep);
  FastCounts counts() const;

 private:
  const uint64_t max_bytes_;
  const size_t max_spans_, signal_every_;
  RouteTable<FastRoute> routes_;
  Tally tally_;
  std::atomic<uint64_t> wrs_{0};
};

}  // namespace kvp::verbs
