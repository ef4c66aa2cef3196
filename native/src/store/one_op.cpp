#include "one_op.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "frames.h"
#include "kvp_copy.h"
#include "../tcp/client.h"
#include "../tcp/wire.h"

namespace kvp::store {
namespace {

constexpr uint64_t kOk = 0, kExists = 3;   // per-entry codes (store/wire/protocol.py)

bool alive(int pidfd) {
  if (pidfd < 0) return true;   // no pidfd on this kernel: the Python path checked /proc when it mapped
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

// The column answer of a get (master/service.py op_get with {"cols": 1}), as views into the reply body.
struct Cols {
  uint64_t ttl_ms = 0;
  std::vector<int64_t> sizes, seg_idx;     // -1: a miss
  std::vector<std::string_view> names;     // segment names, with their region ids
  std::vector<uint64_t> regions, offs, sums;
  std::vector<uint8_t> has_sum, python;    // python: the key has more replicas or is on disk
};

// An array of n ints read with `read` (MpReader::sint or ::uint) into `out`.
template <class T>
bool column(tcp::MpReader& r, size_t n, std::vector<T>& out, bool (tcp::MpReader::*read)(T&, const char*),
            const char* what) {
  uint32_t m;
  if (!r.array(m, what) || m != n) return false;
  out.resize(n);
  for (auto& v : out)
    if (!(r.*read)(v, what)) return false;
  return true;
}

// A {key index: value} map: marks those keys for Python.
bool marked(tcp::MpReader& r, std::vector<uint8_t>& python, const char* what) {
  uint32_t m;
  uint64_t j;
  if (!r.map(m, what)) return false;
  for (uint32_t i = 0; i < m; ++i) {
    if (!r.uint(j, what) || j >= python.size() || !r.skip(what)) return false;
    python[j] = 1;
  }
  return true;
}

bool parse_cols(const std::string& body, uint64_t rid, size_t n, Cols& c) {
  tcp::MpReader r(reinterpret_cast<const uint8_t*>(body.data()), body.size());
  uint32_t fields, m;
  if (!accepted(r, rid) || !r.array(fields, "payload") || fields != 9 || !r.uint(c.ttl_ms, "ttl") ||
      !column(r, n, c.sizes, &tcp::MpReader::sint, "sizes") || !r.array(m, "names"))
    return false;
  c.names.resize(m);
  for (auto& name : c.names)
    if (!r.str(name, "names")) return false;
  c.python.assign(n, 0);
  if (!column(r, m, c.regions, &tcp::MpReader::uint, "regions") ||
      !column(r, n, c.seg_idx, &tcp::MpReader::sint, "seg_idx") || !column(r, n, c.offs, &tcp::MpReader::uint, "offs") ||
      !marked(r, c.python, "more") || !r.array(m, "sums") || m != n)
    return false;
  c.sums.assign(n, 0);
  c.has_sum.assign(n, 0);
  for (size_t k = 0; k < n; ++k) {
    if (r.is_nil()) continue;
    if (!r.uint(c.sums[k], "sums")) return false;
    c.has_sum[k] = 1;
  }
  return marked(r, c.python, "disk") && r.done();
}

// Whether key k of `c` is a plain hit (one replica in memory, sized as its spans): then its bytes, else `code`
// kMiss or kAsPython.
bool plain_hit(const Cols& c, size_t k, const KeySpans& s, uint64_t& size, uint8_t& code) {
  code = kAsPython;
  if (c.python[k]) return false;
  if (c.sizes[k] < 0) {
    code = kMiss;
    return false;
  }
  size = 0;
  for (uint64_t j = s.starts[k]; j < s.starts[k + 1]; ++j) size += s.lens[j];
  const int64_t seg = c.seg_idx[k];
  return size == uint64_t(c.sizes[k]) && size != 0 && seg >= 0 && size_t(seg) < c.names.size() &&
         c.regions[seg] <= UINT32_MAX;   // else a SizeMismatch: the Python client names it
}

// Where key k's object lies (its answer in `c`): its mapping, or nullptr with `code` kMiss or kAsPython.
const ShmMaps::Mapping* source(const Cols& c, size_t k, const KeySpans& s, const ShmMaps& maps, uint8_t& code) {
  uint64_t size;
  if (!plain_hit(c, k, s, size, code)) return nullptr;
  const int64_t seg = c.seg_idx[k];
  const ShmMaps::Mapping* m = maps.find(c.names[seg], uint32_t(c.regions[seg]));
  if (m == nullptr || c.offs[k] > m->length || size > m->length - c.offs[k]) return nullptr;
  code = kDone;
  return m;
}

// Copies key k's object out of mapping `m` into its spans (copy + xxh3 in one pass for one span): whether its
// checksum matched (or was not asked) and it ended within its lease.
bool copy_key(const Cols& c, size_t k, const KeySpans& s, const ShmMaps::Mapping& m, bool verify,
              const HashOps* ops, Clock::time_point lease_end) {
  const uint64_t *addrs = s.addrs + s.starts[k], *lens = s.lens + s.starts[k];
  const size_t n = s.starts[k + 1] - s.starts[k];
  const uint64_t size = uint64_t(c.sizes[k]), from = m.base + c.offs[k];
  const bool check = verify && c.has_sum[k];
  uint64_t digest = 0;
  if (n == 1) {
    digest = ops->copy_hash(reinterpret_cast<char*>(addrs[0]), reinterpret_cast<const char*>(from), size);
  } else {
    std::vector<uint64_t> src(n);
    for (size_t j = 0, o = 0; j < n; o += lens[j], ++j) src[j] = from + o;
    kvp::copy_batch(addrs, src.data(), lens, n, 1);
    if (check) digest = ops->hash_spans(addrs, lens, n);
  }
  return (!check || digest == c.sums[k]) && Clock::now() <= lease_end;
}

// The owners (pidfds) of a batch's mappings, each checked alive once before the copies and once after (a poll
// per owner, not per key): a key whose owner died by then goes to Python.
struct Owners {
  std::vector<int> fds;
  std::vector<uint8_t> live;
  size_t index(int fd) {
    for (size_t i = 0; i < fds.size(); ++i)
      if (fds[i] == fd) return i;
    fds.push_back(fd);
    live.push_back(1);
    return fds.size() - 1;
  }
  void check() {
    for (size_t i = 0; i < fds.size(); ++i) live[i] = live[i] && alive(fds[i]);
  }
};

// Reads every key of `c` whose object lies in a mapped region: per key kDone, kMiss or kAsPython (in `codes`).
void read_keys(const Cols& c, const KeySpans& s, ShmMaps& maps, bool verify, const HashOps* ops,
               Clock::time_point lease_end, std::string& codes) {
  const size_t n = codes.size();
  std::vector<const ShmMaps::Mapping*> src(n);
  std::vector<uint32_t> owner(n);
  Owners owners;
  for (size_t k = 0; k < n; ++k) {
    uint8_t code;
    src[k] = source(c, k, s, maps, code);
    codes[k] = char(code);
    if (src[k] != nullptr) owner[k] = uint32_t(owners.index(src[k]->pidfd));
  }
  owners.check();
  for (size_t k = 0; k < n; ++k)
    if (src[k] != nullptr && (!owners.live[owner[k]] || !copy_key(c, k, s, *src[k], verify, ops, lease_end)))
      codes[k] = char(kAsPython);
  owners.check();
  for (size_t k = 0; k < n; ++k) {
    if (codes[k] != char(kDone)) continue;
    if (owners.live[owner[k]])
      maps.count(uint64_t(c.sizes[k]));
    else
      codes[k] = char(kAsPython);
  }
}

// Plans the TCP reads of every key still kAsPython that is a plain hit in a region `peers` routes to a TCP peer:
// one frame batch per peer, each key marked kTcp. Run by TcpReads::run once the master's connection is free.
std::unique_ptr<TcpReads> plan_tcp(const Cols& c, const KeySpans& s, tcp::Peers& peers, bool verify,
                                   const HashOps* ops, Clock::time_point lease_end, double timeout_s,
                                   std::string& codes) {
  std::map<std::string, size_t> index;
  auto reads = std::make_unique<TcpReads>();
  for (size_t k = 0; k < codes.size(); ++k) {
    uint64_t size;
    uint8_t code;
    if (codes[k] != char(kAsPython) || !plain_hit(c, k, s, size, code)) continue;
    const int64_t seg = c.seg_idx[k];
    const auto route = peers.find(c.names[seg], uint32_t(c.regions[seg]));
    if (!route || c.offs[k] > route->length || size > route->length - c.offs[k]) continue;
    auto [it, added] = index.try_emplace(route->peer, reads->groups.size());
    if (added) reads->groups.push_back({route->peer, route->limit});
    TcpReads::Group& g = reads->groups[it->second];
    g.keys.push_back({k, g.lens.size(), uint64_t(c.sizes[k]), verify && c.has_sum[k], c.sums[k]});
    uint64_t off = c.offs[k];
    for (uint64_t j = s.starts[k]; j < s.starts[k + 1]; off += s.lens[j], ++j) {
      g.addrs.push_back(s.addrs[j]);
      g.regions.push_back(c.regions[seg]);
      g.offs.push_back(off);
      g.lens.push_back(s.lens[j]);
    }
    codes[k] = char(kTcp);
  }
  if (reads->groups.empty()) return nullptr;
  reads->peers = &peers;
  reads->ops = ops;
  reads->lease_end = lease_end;
  reads->timeout_s = timeout_s;
  return reads;
}

}  // namespace

ShmMaps::~ShmMaps() { clear(); }

bool ShmMaps::add(const std::string& segment, uint32_t region, uint64_t base, uint64_t length, int pidfd) {
  int own = pidfd >= 0 ? ::fcntl(pidfd, F_DUPFD_CLOEXEC, 0) : -1;
  if (pidfd >= 0 && own < 0) return false;
  std::unique_lock l(mu_);
  auto [it, added] = maps_.try_emplace({segment, region}, Mapping{base, length, own});
  if (!added) {
    if (it->second.pidfd >= 0) ::close(it->second.pidfd);
    it->second = Mapping{base, length, own};
  }
  return true;
}

void ShmMaps::alias(const std::string& name, const std::string& segment) {
  std::unique_lock l(mu_);
  names_[name] = segment;
}

void ShmMaps::forget(const std::string& segment) {
  std::unique_lock l(mu_);
  for (auto it = maps_.lower_bound(std::make_pair(segment, uint32_t(0))); it != maps_.end() && it->first.first == segment;) {
    if (it->second.pidfd >= 0) ::close(it->second.pidfd);
    it = maps_.erase(it);
  }
}

void ShmMaps::clear() {
  std::unique_lock l(mu_);
  for (auto& [k, m] : maps_)
    if (m.pidfd >= 0) ::close(m.pidfd);
  maps_.clear();
  names_.clear();
}

const ShmMaps::Mapping* ShmMaps::find(std::string_view name, uint32_t region) const {
  auto seg = names_.find(name);
  if (seg == names_.end()) return nullptr;
  auto it = maps_.find(std::make_pair(seg->second, region));
  return it == maps_.end() ? nullptr : &it->second;
}

void TcpReads::run(std::string& codes) {
  for (const Group& g : groups) read_group(g, codes);
}

void TcpReads::read_group(const Group& g, std::string& codes) {
  for (const Key& key : g.keys) codes[key.k] = char(kAsPython);
  const int fd = peers->take(g.peer);
  if (fd < 0) return;
  const tcp::Batch b{tcp::kRead, g.addrs.data(), g.regions.data(), g.offs.data(), g.lens.data(), g.lens.size(),
                     g.limit, peers->max_frame(), timeout_s, 0};
  const tcp::Result r = tcp::transfer(b, {fd}, {1}, peers->ids());
  if (r.broken[0]) tcp::abort_fd(fd);
  else if (!peers->give(g.peer, fd)) ::close(fd);
  if (Clock::now() > lease_end) return;
  for (size_t i = 0; i < g.keys.size(); ++i) {
    const Key& key = g.keys[i];
    const size_t end = i + 1 < g.keys.size() ? g.keys[i + 1].first : g.lens.size();
    bool ok = true;
    for (size_t j = key.first; j < end; ++j) ok = ok && r.code[j] == tcp::kOk;
    if (ok && key.check) ok = ops->hash_spans(&g.addrs[key.first], &g.lens[key.first], end - key.first) == key.sum;
    if (!ok) continue;
    codes[key.k] = char(kDone);
    peers->count(key.size);
  }
}

BatchResult get_many(int fd, uint64_t rid, const std::vector<std::string_view>& keys, const KeySpans& spans,
                     double timeout_ms, ShmMaps& maps, bool verify, const HashOps* ops, tcp::Peers* peers,
                     double transfer_timeout_ms) {
  const auto t0 = Clock::now();
  std::vector<Conn> one{Conn{fd, request(rid, "get", [&](tcp::MpWriter& w) {
                               w.array(uint32_t(keys.size()));
                               for (const auto& k : keys) w.str(k);
                               w.map(1);
                               w.str("cols");
                               w.uint(1);
                             })}};
  exchange(one, deadline_in(timeout_ms));
  BatchResult res;
  if (one[0].status != kReplied) return {one[0].status, {}, std::move(one[0].body)};
  res.codes.assign(keys.size(), char(kAsPython));
  Cols c;
  if (parse_cols(one[0].body, rid, keys.size(), c)) {
    const auto lease_end = t0 + std::chrono::milliseconds(c.ttl_ms);
    {
      std::shared_lock l(maps.mutex());
      read_keys(c, spans, maps, verify, ops, lease_end, res.codes);
    }
    if (peers != nullptr && res.codes.find(char(kAsPython)) != std::string::npos)
      res.tcp = plan_tcp(c, spans, *peers, verify, ops, lease_end, transfer_timeout_ms / 1000, res.codes);
  }
  if (res.codes.find(char(kAsPython)) != std::string::npos) res.body = std::move(one[0].body);
  return res;
}

WriteStatus write_tcp(tcp::Peers& peers, const KeySpans& s, const std::string& segment, uint32_t region,
                      const uint64_t* offsets, double timeout_ms, uint64_t land_by_ms, const HashOps* ops,
                      std::vector<uint64_t>& digests) {
  const auto route = peers.find(segment, region);
  if (!route || timeout_ms <= 0 || s.keys == 0) return kWriteNotSent;
  const size_t n = s.starts[s.keys];
  std::vector<uint64_t> regions(n, region), offs(n);
  for (size_t k = 0; k < s.keys; ++k) {
    uint64_t off = offsets[k];
    if (off > route->length || s.starts[k] == s.starts[k + 1]) return kWriteNotSent;
    for (uint64_t j = s.starts[k]; j < s.starts[k + 1]; off += s.lens[j], ++j) offs[j] = off;
    if (off - offsets[k] > route->length - offsets[k]) return kWriteNotSent;
  }
  const int fd = peers.take(route->peer);
  if (fd < 0) return kWriteNotSent;
  const tcp::Batch b{tcp::kWrite, s.addrs, regions.data(), offs.data(), s.lens, n, route->limit, peers.max_frame(),
                     timeout_ms / 1000, land_by_ms};
  const tcp::Result r = tcp::transfer(b, {fd}, {1}, peers.ids());
  if (r.broken[0]) tcp::abort_fd(fd);
  else if (!peers.give(route->peer, fd)) ::close(fd);
  for (uint8_t code : r.code)
    if (code != tcp::kOk) return kWriteFailed;
  digests.resize(s.keys);
  for (size_t k = 0; k < s.keys; ++k) {
    const size_t first = s.starts[k], count = s.starts[k + 1] - first;
    digests[k] = ops->hash_spans(s.addrs + first, s.lens + first, count);
    uint64_t size = 0;
    for (size_t j = first; j < first + count; ++j) size += s.lens[j];
    peers.count(size);
  }
  return kWritten;
}

BatchResult put_many(int fd, uint64_t rid, const std::vector<std::string_view>& keys, const KeySpans& spans,
                     const std::string& segment, uint32_t region, const uint64_t* offsets, uint64_t slab,
                     double write_ms, double timeout_ms, ShmMaps& maps, const HashOps* ops,
                     const uint64_t* written) {
  const auto deadline = deadline_in(timeout_ms);
  const size_t n = keys.size();
  std::vector<uint64_t> sizes(n, 0), digests(n, 0);
  if (written != nullptr) {
    for (size_t k = 0; k < n; ++k) {
      for (uint64_t j = spans.starts[k]; j < spans.starts[k + 1]; ++j) sizes[k] += spans.lens[j];
      digests[k] = written[k];
    }
  } else {
    std::shared_lock l(maps.mutex());
    const ShmMaps::Mapping* m = maps.find(segment, region);
    if (write_ms <= 0 || m == nullptr || !alive(m->pidfd)) return {kNotSent};
    for (size_t k = 0; k < n; ++k) {
      for (uint64_t j = spans.starts[k]; j < spans.starts[k + 1]; ++j) sizes[k] += spans.lens[j];
      if (sizes[k] == 0 || offsets[k] > m->length || sizes[k] > m->length - offsets[k]) return {kNotSent};
    }
    for (size_t k = 0; k < n; ++k) {
      const uint64_t *addrs = spans.addrs + spans.starts[k], *lens = spans.lens + spans.starts[k];
      const size_t ns = spans.starts[k + 1] - spans.starts[k];
      if (ns == 1) {
        digests[k] = ops->copy_hash(reinterpret_cast<char*>(m->base + offsets[k]), reinterpret_cast<const char*>(addrs[0]), sizes[k]);
        continue;
      }
      std::vector<uint64_t> to(ns);
      for (size_t j = 0, o = 0; j < ns; o += lens[j], ++j) to[j] = m->base + offsets[k] + o;
      kvp::copy_batch(to.data(), addrs, lens, ns, 1);
      digests[k] = ops->hash_spans(addrs, lens, ns);
    }
    for (size_t k = 0; k < n; ++k) maps.count(sizes[k]);
  }
  std::vector<Conn> one{Conn{fd, request(rid, "put", [&](tcp::MpWriter& w) {
                               w.array(uint32_t(n));
                               for (size_t k = 0; k < n; ++k) {
                                 w.array(4);
                                 w.str(keys[k]);
                                 w.uint(sizes[k]);
                                 w.uint(slab);
                                 w.uint(offsets[k]);
                               }
                               w.map(1);
                               w.str("xxh3");
                               w.array(uint32_t(n));
                               for (uint64_t d : digests) w.uint(d);
                             })}};
  exchange(one, deadline);
  if (one[0].status != kReplied) return {one[0].status, {}, std::move(one[0].body)};
  BatchResult res;
  tcp::MpReader r(reinterpret_cast<const uint8_t*>(one[0].body.data()), one[0].body.size());
  uint32_t m, pair;
  uint64_t code;
  bool plain = accepted(r, rid) && r.array(m, "answers") && m == n;
  for (size_t k = 0; plain && k < n; ++k) {
    plain = r.array(pair, "answer") && pair == 2 && r.uint(code, "code") && r.skip("value") &&
            (code == kOk || code == kExists);
    res.codes.push_back(char(code));
  }
  if (!plain || !r.done()) res.body = std::move(one[0].body);
  return res;
}

}  // namespace kvp::store
