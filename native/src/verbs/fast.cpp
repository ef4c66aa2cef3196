// FastRoutes (see fast.h): small batches checked and posted in one native call.
#include "fast.h"

#include "kvp_hash.h"

#include <algorithm>
#include <mutex>

namespace kvp::verbs {

FastRoutes::FastRoutes(uint64_t max_bytes, size_t max_spans, size_t signal_every)
    : max_bytes_(max_bytes), max_spans_(max_spans), signal_every_(std::max<size_t>(signal_every, 1)) {}

void FastRoutes::add_local(FastLocal r) {
  std::unique_lock<std::shared_mutex> hold(mu_);
  locals_.erase(std::remove_if(locals_.begin(), locals_.end(), [&](const FastLocal& l) { return l.id == r.id; }),
                locals_.end());
  auto at = std::lower_bound(locals_.begin(), locals_.end(), r.addr,
                             [](const FastLocal& l, uint64_t a) { return l.addr < a; });
  locals_.insert(at, std::move(r));
}

void FastRoutes::drop_local(uint64_t id) {
  std::unique_lock<std::shared_mutex> hold(mu_);
  locals_.erase(std::remove_if(locals_.begin(), locals_.end(), [&](const FastLocal& l) { return l.id == id; }),
                locals_.end());
}

void FastRoutes::put_route(FastRoute r) {
  std::unique_lock<std::shared_mutex> hold(mu_);
  for (FastRoute& have : routes_)
    if (have.remote == r.remote && have.region == r.region) {
      have = std::move(r);
      return;
    }
  routes_.push_back(std::move(r));
}

void FastRoutes::drop_routes(const std::string& segment) {
  std::unique_lock<std::shared_mutex> hold(mu_);
  routes_.erase(std::remove_if(routes_.begin(), routes_.end(),
                               [&](const FastRoute& r) { return r.segment == segment; }),
                routes_.end());
}

void FastRoutes::clear() {
  std::unique_lock<std::shared_mutex> hold(mu_);
  routes_.clear();
}

// The registered region holding [addr, addr + length), or nullptr. Locals never overlap (one region per range).
const FastLocal* FastRoutes::local(uint64_t addr, uint64_t length) const {
  auto at = std::upper_bound(locals_.begin(), locals_.end(), addr,
                             [](uint64_t a, const FastLocal& l) { return a < l.addr; });
  if (at == locals_.begin()) return nullptr;
  const FastLocal& l = *(at - 1);
  return addr - l.addr <= l.length && length <= l.length - (addr - l.addr) ? &l : nullptr;
}

long FastRoutes::run(bool read, const void* remote, uint64_t region, const uint64_t* laddr, const uint64_t* roff,
                     const uint64_t* length, size_t n, double deadline_at, std::string& segment,
                     uint64_t* digests) {
  if (n == 0 || n > max_spans_) return 0;
  std::shared_lock<std::shared_mutex> hold(mu_);
  const FastRoute* route = nullptr;
  for (const FastRoute& r : routes_)
    if (r.remote == remote && r.region == region) route = &r;
  if (route == nullptr || route->qp->dead()) return 0;
  Work w;
  w.qp = route->qp;
  w.chunks.reserve(n);
  uint64_t total = 0;
  for (size_t j = 0; j < n; ++j) {
    const uint64_t len = length[j], off = roff[j];
    total += len;
    if (len == 0 || len > max_bytes_ || total > max_bytes_ || off > route->rlength || len > route->rlength - off)
      return 0;
    const FastLocal* l = local(laddr[j], len);
    if (l == nullptr || (read && l->readonly) || route->nic >= l->lkeys.size()) return 0;
    w.chunks.push_back(Chunk{laddr[j], route->raddr + off, l->lkeys[route->nic], route->rkey, uint32_t(len)});
  }
  std::unique_lock<std::mutex> busy(route->qp->busy_, std::try_to_lock);
  if (!busy.owns_lock()) return 0;  // another batch runs on it: the general path takes another queue pair
  std::vector<Work> works{std::move(w)};
  const size_t posted = run_held(read, works, deadline_at, signal_every_);
  wrs_.fetch_add(posted, std::memory_order_relaxed);
  if (!works[0].error.empty() || works[0].done != n) {
    segment = route->segment;
    return -1;
  }
  if (digests) {
    static const HashOps* ops = hash_ops("auto");
    for (size_t j = 0; j < n; ++j) digests[j] = ops->hash_spans(&laddr[j], &length[j], 1);
  }
  (read ? reads_ : writes_).fetch_add(1, std::memory_order_relaxed);
  entries_.fetch_add(n, std::memory_order_relaxed);
  bytes_.fetch_add(total, std::memory_order_relaxed);
  return long(n);
}

FastCounts FastRoutes::counts() const {
  return {reads_.load(), writes_.load(), entries_.load(), bytes_.load(), wrs_.load()};
}

}  // namespace kvp::verbs
