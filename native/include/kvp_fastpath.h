// What the native small-batch tables share (issue #35): the RDMA one (verbs/fast.h, with each region's lkeys) and
// the TCP one (tcp/fast.h).
// * Locals: the registered local memory a batch's spans are checked against. A run holds the regions its spans
//   lie in (shared pointers, taken under a brief shared lock) until its bytes moved; drop() waits for those runs,
//   so a region's memory stays mapped until no native batch uses it.
// * RouteTable: the routes, keyed by the caller's descriptor object (identity) and region id. A run holds the
//   route it found, not the table; every call that takes routes out hands them back, for the caller to release
//   where that is safe (a route owns Python objects: with the GIL held).
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvp_hash.h"

namespace kvp {

struct Local {
  uint64_t id, addr, length;
  bool readonly;               // never a read's destination
  std::vector<uint32_t> keys;  // the transport's own (RDMA: an lkey per local NIC; TCP: none)
};
using LocalRef = std::shared_ptr<const Local>;

class Locals {
 public:
  // Adds (or replaces, by id) a region. Regions never overlap.
  void add(Local r) {
    std::unique_lock<std::shared_mutex> hold(mu_);
    erase(r.id);
    auto at = std::lower_bound(locals_.begin(), locals_.end(), r.addr,
                               [](const LocalRef& l, uint64_t a) { return l->addr < a; });
    locals_.insert(at, std::make_shared<const Local>(std::move(r)));
  }

  // Removes region `id`, then waits for the runs still holding it.
  void drop(uint64_t id) {
    std::vector<LocalRef> gone;
    {
      std::unique_lock<std::shared_mutex> hold(mu_);
      for (auto it = locals_.begin(); it != locals_.end();)
        if ((*it)->id == id) gone.push_back(std::move(*it)), it = locals_.erase(it);
        else ++it;
    }
    for (auto& l : gone)
      while (l.use_count() > 1) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

  // Span j's region in `at[j]` (each also in `held`, once) when every span lies inside one (a writable one for
  // `writable`); false otherwise (nothing held).
  bool hold(const uint64_t* addr, const uint64_t* length, size_t n, bool writable, std::vector<const Local*>& at,
            std::vector<LocalRef>& held) const {
    std::shared_lock<std::shared_mutex> hold(mu_);
    at.resize(n);
    for (size_t j = 0; j < n; ++j) {
      const LocalRef* l = find(addr[j], length[j]);
      if (l == nullptr || (writable && (*l)->readonly)) {
        held.clear();
        return false;
      }
      if (held.empty() || held.back() != *l) held.push_back(*l);
      at[j] = l->get();
    }
    return true;
  }

 private:
  void erase(uint64_t id) {
    locals_.erase(std::remove_if(locals_.begin(), locals_.end(), [&](const LocalRef& l) { return l->id == id; }),
                  locals_.end());
  }
  // The region holding [addr, addr + length), or nullptr (caller holds mu_).
  const LocalRef* find(uint64_t addr, uint64_t length) const {
    auto at = std::upper_bound(locals_.begin(), locals_.end(), addr,
                               [](uint64_t a, const LocalRef& l) { return a < l->addr; });
    if (at == locals_.begin()) return nullptr;
    const Local& l = **(at - 1);
    return addr - l.addr <= l.length && length <= l.length - (addr - l.addr) ? &*(at - 1) : nullptr;
  }

  mutable std::shared_mutex mu_;
  std::vector<LocalRef> locals_;  // by address
};

// A table's counters: batches read and written, their spans (entries) and bytes.
struct Counts {
  uint64_t reads, writes, entries, bytes;
};

// The batches a table completed: counts, and each span's xxh3_64 of its local bytes for the caller that asks.
class Tally {
 public:
  Counts counts() const { return {reads.load(), writes.load(), entries.load(), bytes.load()}; }
  // A batch of n spans (total bytes) done: digests[j] (when digests is not null) = xxh3_64 of span j. Returns n.
  long done(bool read, const uint64_t* laddr, const uint64_t* length, size_t n, uint64_t total, uint64_t* digests) {
    if (digests) {
      static const HashOps* ops = hash_ops("auto");
      for (size_t j = 0; j < n; ++j) digests[j] = ops->hash_spans(&laddr[j], &length[j], 1);
    }
    (read ? reads : writes).fetch_add(1, std::memory_order_relaxed);
    entries.fetch_add(n, std::memory_order_relaxed);
    bytes.fetch_add(total, std::memory_order_relaxed);
    return long(n);
  }
  std::atomic<uint64_t> reads{0}, writes{0}, entries{0}, bytes{0};
};

// What a route of the TCP and cma tables starts with (RDMA's has its queue pair's own fields instead).
struct RouteBase {
  const void* remote;  // the caller's descriptor object (identity; kept alive by `owner`)
  uint64_t region;     // its region id
  std::string segment;
  bool readonly;               // read-only to peers: no write takes this route
  std::shared_ptr<void> owner;  // released by the caller's rule (RouteTable)
};

// Route: any struct with `const void* remote`, `uint64_t region` and `std::string segment`.
template <class Route>
class RouteTable {
 public:
  using Ptr = std::shared_ptr<const Route>;
  using List = std::vector<Ptr>;
  explicit RouteTable(size_t max_routes) : max_(std::max<size_t>(max_routes, 1)) {}

  // Replaces the route of the same (remote, region); past max_routes, all go first. Returns the routes taken out.
  List put(Route r) {
    List gone;
    std::unique_lock<std::shared_mutex> hold(mu_);
    auto fresh = std::make_shared<const Route>(std::move(r));
    auto it = std::find_if(routes_.begin(), routes_.end(),
                           [&](const Ptr& h) { return h->remote == fresh->remote && h->region == fresh->region; });
    if (it != routes_.end()) {
      gone.push_back(std::exchange(*it, std::move(fresh)));
      return gone;
    }
    if (routes_.size() >= max_) gone.swap(routes_);
    routes_.push_back(std::move(fresh));
    return gone;
  }

  List drop(const std::string& segment) {
    List gone;
    std::unique_lock<std::shared_mutex> hold(mu_);
    for (auto it = routes_.begin(); it != routes_.end();)
      if ((*it)->segment == segment) gone.push_back(std::move(*it)), it = routes_.erase(it);
      else ++it;
    return gone;
  }

  List clear() {
    List gone;
    std::unique_lock<std::shared_mutex> hold(mu_);
    gone.swap(routes_);
    return gone;
  }

  Ptr find(const void* remote, uint64_t region) const {
    std::shared_lock<std::shared_mutex> hold(mu_);
    for (const auto& r : routes_)
      if (r->remote == remote && r->region == region) return r;
    return nullptr;
  }

 private:
  const size_t max_;
  mutable std::shared_mutex mu_;  // never held during a transfer
  List routes_;
};

}  // namespace kvp
