// Small TCP batches in one native call from the transfer API's entry (issue #35), as verbs/fast.h does for RDMA:
// the TCP transport hands this table its registered local regions and, for a remote region the router chose TCP
// for first and whose batch went well, the route (the peer's pooled connections, the region's length and the
// frame payload limit). TransferEngine.read_spans / write_spans (and a small batch_read / batch_write) then check
// the spans and run them as one frame over one idle pooled connection (Peers), with no Python in between; what
// the table cannot take (unknown region or route, too many spans or bytes for one frame, no idle connection)
// comes back untouched, and the Python path runs it (it connects, and names any error).
//
// Lifecycle, in call order: locals.add per registered region; put_route after a good batch; run, from any thread;
// drop_routes when a batch on a route failed; locals.drop before a region is unregistered (waits for the runs
// holding it); clear before the pooled connections close. A run holds its route and regions (shared pointers),
// not the table. A route owns the caller's descriptor object (`owner`), released with the last holder: the calls
// that can drop a route hand it back to the caller to release with the GIL held (module.cpp).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "kvp_fastpath.h"
#include "peers.h"

namespace kvp::tcp {

struct FastRoute : RouteBase {
  std::string peer;         // the pooled connections' key (Peers), host:port
  uint64_t rlength, limit;  // the region's length; payload bytes per frame
};
using FastRoutePtr = RouteTable<FastRoute>::Ptr;
using FastRouteList = RouteTable<FastRoute>::List;

class FastRoutes {
 public:
  FastRoutes(Peers& peers, size_t max_spans, size_t max_routes);
  Locals locals;  // the registered regions (no keys)
  // Each returns the routes it took out (the caller releases them).
  FastRouteList put_route(FastRoute r) { return routes_.put(std::move(r)); }  // RouteTable::put
  FastRouteList drop_routes(const std::string& segment) { return routes_.drop(segment); }
  FastRouteList clear() { return routes_.clear(); }
  // Moves span j (length[j] bytes between laddr[j] and offset roff[j] of the remote region) as one frame over
  // one idle pooled connection, done by deadline_at (CLOCK_MONOTONIC s). Returns n once every span is done; 0
  // where the table cannot take the batch (nothing sent); -1 when the frame failed (the connection is reset; the
  // caller drops the peer's routes and runs the batch again on its general path, which names the error).
  // `digests` (nullptr, or n entries): each span's xxh3_64 of its local bytes after the move. `keep`: the route
  // used (the caller releases it).
  long run(bool read, const void* remote, uint64_t region, const uint64_t* laddr, const uint64_t* roff,
           const uint64_t* length, size_t n, double deadline_at, uint64_t* digests, FastRoutePtr& keep);
  Counts counts() const { return tally_.counts(); }

 private:
  Peers& peers_;
  const size_t max_spans_;
  RouteTable<FastRoute> routes_;
  Tally tally_;
};

}  // namespace kvp::tcp
