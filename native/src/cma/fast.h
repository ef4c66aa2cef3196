// Small same-host batches in one native call from the transfer API's entry (issue #35), as tcp/fast.h does for
// TCP: the cma transport hands this table its registered local regions and, for a peer's region the router chose
// cma for first and whose batch went well, the route (the peer's pid and a pidfd watching it, the region's
// address and length). TransferEngine.read_spans / write_spans (and a small batch_read / batch_write) then check
// the spans and copy them with one process_vm_readv / process_vm_writev, the peer's pidfd polled before and after
// (a peer that exited fails the batch, as kvplugins/transfer/peers.py does); what the table cannot take comes back
// untouched, and the Python path runs it.
//
// Lifecycle, in call order: locals.add per registered region; put_route after a good batch; run, from any thread;
// drop_routes when a batch on a route failed; locals.drop before a region is unregistered (waits for the runs
// holding it); clear at close. A route owns the caller's descriptor object (`owner`, released by the caller's rule
// as tcp/fast.h) and its own duplicate of the peer's pidfd (closed with the route).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "kvp_fastpath.h"

namespace kvp::cma {

struct FastRoute : RouteBase {
  int pid;
  std::shared_ptr<const int> pidfd;  // this route's own duplicate, closed with the last holder
  uint64_t raddr, rlength;           // the region in the peer's address space
};
using FastRoutePtr = RouteTable<FastRoute>::Ptr;
using FastRouteList = RouteTable<FastRoute>::List;

class FastRoutes {
 public:
  FastRoutes(size_t max_spans, size_t max_routes) : max_spans_(max_spans), routes_(max_routes) {}
  Locals locals;  // the registered regions (no keys)
  // Each returns the routes it took out (the caller releases them).
  FastRouteList put_route(FastRoute r) { return routes_.put(std::move(r)); }  // RouteTable::put
  FastRouteList drop_routes(const std::string& segment) { return routes_.drop(segment); }
  FastRouteList clear() { return routes_.clear(); }
  // Copies span j (length[j] bytes between laddr[j] and offset roff[j] of the peer's region) with one system
  // call. Returns n once every span is copied and the peer still runs; 0 where the table cannot take the batch
  // (nothing copied); -1 when the copy failed or the peer exited (the caller drops the peer's routes and runs the
  // batch again on its general path, which names the error). `digests` and `keep` as tcp/fast.h.
  long run(bool read, const void* remote, uint64_t region, const uint64_t* laddr, const uint64_t* roff,
           const uint64_t* length, size_t n, uint64_t* digests, FastRoutePtr& keep);
  Counts counts() const { return tally_.counts(); }

 private:
  const size_t max_spans_;
  RouteTable<FastRoute> routes_;
  Tally tally_;
};

// A pidfd of the caller's duplicated for a route (closed with it); nullptr when dup fails.
std::shared_ptr<const int> own_pidfd(int pidfd);

}  // namespace kvp::cma
