// FastRoutes (see fast.h): small batches checked and posted in one native call.
#include "fast.h"

#include "kvp_hash.h"

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
      max_routes_(std::max<size_t>(max_routes, 1)) {}

void FastRoutes::add_local(FastLocal r) {
  std::unique_lock<std::shared_mutex> hold(mu_);
  locals_.erase(std::remove_if(locals_.begin(), locals_.end(),
                               [&](const std::shared_ptr<const FastLocal>& l) { return l->id == r.id; }),
                locals_.end());
  auto at = std::lower_bound(locals_.begin(), locals_.end(), r.addr,
                             [](const std::shared_ptr<const FastLocal>& l, uint64_t a) { return l->addr < a; });
  locals_.insert(at, std::make_shared<const FastLocal>(std::move(r)));
}

void FastRoutes::drop_local(uint64_t id) {
  std::vector<std::shared_ptr<const FastLocal>> gone;
  {
    std::unique_lock<std::shared_mutex> hold(mu_);
    for (auto it = locals_.begin(); it != locals_.end();)
      if ((*it)->id == id) gone.push_back(std::move(*it)), it = locals_.erase(it);
      else ++it;
  }
  for (auto& l : gone)  // out of the table: only runs in flight hold it; wait for them
    while (l.use_count() > 1) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

Routes FastRoutes::put_route(FastRoute r) {
  Routes gone;
  std::unique_lock<std::shared_mutex> hold(mu_);
  auto fresh = std::make_shared<const FastRoute>(std::move(r));
  auto it = std::find_if(routes_.begin(), routes_.end(), [&](const std::shared_ptr<const FastRoute>& h) {
    return h->remote == fresh->remote && h->region == fresh->region;
  });
  if (it != routes_.end()) {
    gone.push_back(std::exchange(*it, std::move(fresh)));
    return gone;
  }
  if (routes_.size() >= max_routes_) gone.swap(routes_);
  routes_.push_back(std::move(fresh));
  return gone;
}

Routes FastRoutes::drop_routes(const std::string& segment) {
  Routes gone;
  std::unique_lock<std::shared_mutex> hold(mu_);
  for (auto it = routes_.begin(); it != routes_.end();)
    if ((*it)->segment == segment) gone.push_back(std::move(*it)), it = routes_.erase(it);
    else ++it;
  return gone;
}

Routes FastRoutes::clear() {
  Routes gone;
  std::unique_lock<std::shared_mutex> hold(mu_);
  gone.swap(routes_);
  return gone;
}

// The registered region holding [addr, addr + length), or nullptr. Locals never overlap (one region per range).
const std::shared_ptr<const FastLocal>* FastRoutes::local(uint64_t addr, uint64_t length) const {
  auto at = std::upper_bound(locals_.begin(), locals_.end(), addr,
                             [](uint64_t a, const std::shared_ptr<const FastLocal>& l) { return a < l->addr; });
  if (at == locals_.begin()) return nullptr;
  const FastLocal& l = **(at - 1);
  return addr - l.addr <= l.length && length <= l.length - (addr - l.addr) ? &*(at - 1) : nullptr;
}

long FastRoutes::run(bool read, const void* remote, uint64_t region, const uint64_t* laddr, const uint64_t* roff,
                     const uint64_t* length, size_t n, double deadline_at, uint64_t* digests,
                     std::shared_ptr<const FastRoute>& keep) {
  if (n == 0 || n > max_spans_) return 0;
  std::shared_ptr<const FastRoute>& route = keep;
  std::vector<std::shared_ptr<const FastLocal>> held;  // the local regions the spans lie in, kept until done
  Work w;
  uint64_t total = 0;
  {
    std::shared_lock<std::shared_mutex> hold(mu_);
    for (const auto& r : routes_)
      if (r->remote == remote && r->region == region) route = r;
    if (!route || route->qp->dead()) return 0;
    w.qp = route->qp;
    w.chunks.reserve(n);
    for (size_t j = 0; j < n; ++j) {
      const uint64_t len = length[j], off = roff[j];
      total += len;
      if (len == 0 || len > max_bytes_ || total > max_bytes_ || off > route->rlength || len > route->rlength - off)
        return 0;
      const std::shared_ptr<const FastLocal>* l = local(laddr[j], len);
      if (l == nullptr || (read && (*l)->readonly) || route->nic >= (*l)->lkeys.size()) return 0;
      if (held.empty() || held.back() != *l) held.push_back(*l);
      w.chunks.push_back(Chunk{laddr[j], route->raddr + off, (*l)->lkeys[route->nic], route->rkey, uint32_t(len)});
    }
  }
  std::unique_lock<std::mutex> busy(route->qp->busy_, std::try_to_lock);
  if (!busy.owns_lock()) return 0;  // another batch runs on it: the general path takes another queue pair
  std::vector<Work> works{std::move(w)};
  const size_t posted = run_held(read, works, deadline_at, signal_every_);
  wrs_.fetch_add(posted, std::memory_order_relaxed);
  if (!works[0].error.empty() || works[0].done != n) return -1;
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
