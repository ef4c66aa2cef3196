// FastRoutes (see fast.h): small batches checked and posted in one native call.
#include "fast.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>

namespace kvp::verbs {

FastRoutes::FastRoutes(uint64_t max_bytes, size_t max_spans, size_t signal_every, size_t max_routes)
    : max_bytes_(max_bytes),
      max_spans_(max_spans),
      signal_every_(std::max<size_t>(signal_every, 1)),
      routes_(max_routes) {}

Routes FastRoutes::put_route(FastRoute r) { return routes_.put(std::move(r)); }
Routes FastRoutes::drop_routes(const std::string& segment) { return routes_.drop(segment); }
Routes FastRoutes::clear() { return routes_.clear(); }

long FastRoutes::run(bool read, const void* remote, uint64_t region, const uint64_t* laddr, const uint64_t* roff,
                     const uint64_t* length, size_t n, double deadline_at, uint64_t* digests,
                     std::shared_ptr<const FastRoute>& keep) {
  if (n == 0 || n > max_spans_) return 0;
  std::shared_ptr<const FastRoute>& route = keep;
  route = routes_.find(remote, region);
  if (!route || route->qp->dead()) return 0;
  uint64_t total = 0;
  for (size_t j = 0; j < n; ++j) {
    const uint64_t len = length[j], off = roff[j];
    total += len;
    if (len == 0 || len > max_bytes_ || total > max_bytes_ || off > route->rlength || len > route->rlength - off)
      return 0;
  }
  std::vector<const Local*> at;
  std::vector<LocalRef> held;  // the local regions the spans lie in, kept until done
  if (!locals.hold(laddr, length, n, read, at, held)) return 0;
  Work w;
  w.qp = route->qp;
  w.chunks.reserve(n);
  for (size_t j = 0; j < n; ++j) {
    if (route->nic >= at[j]->keys.size()) return 0;
    const uint32_t lkey = at[j]->keys[route->nic];
    w.chunks.push_back(Chunk{laddr[j], route->raddr + roff[j], lkey, route->rkey, uint32_t(length[j])});
  }
  std::unique_lock<std::mutex> busy(route->qp->busy_, std::try_to_lock);
  if (!busy.owns_lock()) return 0;  // another batch runs on it: the general path takes another queue pair
  std::vector<Work> works{std::move(w)};
  const size_t posted = run_held(read, works, deadline_at, signal_every_);
  wrs_.fetch_add(posted, std::memory_order_relaxed);
  if (!works[0].error.empty() || works[0].done != n) return -1;
  return tally_.done(read, laddr, length, n, total, digests);
}

FastCounts FastRoutes::counts() const {
  return {tally_.reads.load(), tally_.writes.load(), tally_.entries.load(), tally_.bytes.load(), wrs_.load()};
}

}  // namespace kvp::verbs
