#include "serve.h"

#include <algorithm>
#include <unordered_map>

#include "../tcp/mp.h"

namespace kvp::meta {
namespace {

constexpr uint64_t kVersion = 1;        // store/wire/protocol.py VERSION
constexpr uint64_t kMaxRid = (1ull << 63) - 1;
constexpr uint64_t kOk = 0, kNotFound = 1;   // protocol.OK, protocol.NOT_FOUND
constexpr uint64_t kMaxSize = 1ull << 48;     // wire/schema.py MAX_SIZE: sizes in (0, it], offsets below it

struct Request {
  uint64_t rid;
  FrontOp op;
  bool cols = false;
  std::vector<std::string_view> keys;
  std::optional<PutRequest> put;
};

bool ascii_key(std::string_view k, uint64_t max_bytes) {
  if (k.empty() || k.size() > max_bytes) return false;
  for (unsigned char ch : k)
    if (ch >= 0x80) return false;   // msgspec counts characters and checks UTF-8: non-ASCII keys go to Python
  return true;
}

// The options map: a get's {"cols": bool or 0/1} or nothing; exists takes none.
bool options(tcp::MpReader& r, Request& q) {
  uint32_t n;
  if (!r.map(n, "opts") || n > 1 || (n == 1 && q.op != kGet)) return false;
  if (n == 0) return true;
  std::string_view name;
  if (!r.str(name, "opts") || name != "cols") return false;
  bool b;
  if (r.boolean(b, "cols")) {   // a mismatch moves nothing on: then an int
    q.cols = b;
    return true;
  }
  uint64_t v;
  if (!r.uint(v, "cols") || v > 1) return false;
  q.cols = v == 1;
  return true;
}

// A put's {} or {"xxh3": nil or n uint-or-nil}: the only options schema.CommitOpts has.
bool put_sums(tcp::MpReader& r, PutRequest& p) {
  uint32_t n, m;
  std::string_view name;
  const size_t keys = p.keys.size();
  p.sums.assign(keys, 0), p.has_sum.assign(keys, 0);
  if (!r.map(n, "opts") || n > 1) return false;
  if (n == 0) return true;
  if (!r.str(name, "opts") || name != "xxh3") return false;
  if (r.is_nil()) return true;
  if (!r.array(m, "xxh3") || m != keys) return false;
  for (size_t k = 0; k < keys; ++k) {
    if (r.is_nil()) continue;
    if (!r.uint(p.sums[k], "xxh3")) return false;
    p.has_sum[k] = 1;
  }
  return true;
}

// n entries [key, size, slab, offset], all of one slab, then the options.
std::optional<Request> parse_put(tcp::MpReader& r, uint32_t n, Request& q, const Limits& lim) {
  PutRequest& p = q.put.emplace();
  p.rid = q.rid;
  p.keys.resize(n), p.sizes.resize(n), p.offs.resize(n);
  for (uint32_t k = 0; k < n; ++k) {
    uint32_t four;
    uint64_t slab;
    if (!r.array(four, "entry") || four != 4 || !r.str(p.keys[k], "key") || !ascii_key(p.keys[k], lim.max_key_bytes) ||
        !r.uint(p.sizes[k], "size") || p.sizes[k] == 0 || p.sizes[k] > kMaxSize || !r.uint(slab, "slab") ||
        (k > 0 && slab != p.slab) || !r.uint(p.offs[k], "offset") || p.offs[k] >= kMaxSize)
      return std::nullopt;
    p.slab = slab;
  }
  if (!put_sums(r, p) || !r.done()) return std::nullopt;
  return std::move(q);
}

std::optional<Request> parse(std::string_view body, const Limits& lim) {
  tcp::MpReader r(reinterpret_cast<const uint8_t*>(body.data()), body.size());
  Request q;
  uint32_t n;
  uint64_t version;
  std::string_view op;
  if (!r.array(n, "request") || n != 5 || !r.uint(version, "version") || version != kVersion ||
      !r.uint(q.rid, "rid") || q.rid > kMaxRid || !r.str(op, "op"))
    return std::nullopt;
  q.op = op == "get" ? kGet : op == "exists" ? kExists : op == "put" ? kPut : FrontOp(0);
  if (!(q.op & lim.ops) || !r.array(n, "entries") || n == 0 || n > lim.max_keys) return std::nullopt;
  if (q.op == kPut) return parse_put(r, n, q, lim);
  q.keys.resize(n);
  for (auto& k : q.keys)
    if (!r.str(k, "key") || !ascii_key(k, lim.max_key_bytes)) return std::nullopt;
  if (!options(r, q) || !r.done()) return std::nullopt;
  return q;
}

void head(tcp::MpWriter& w, uint64_t rid) {
  w.array(4);
  w.uint(kVersion);
  w.uint(rid);
  w.boolean(true);
}

// Each key's record as a get answers it from memory: complete, one replica, in DRAM (NONE: a miss). False where
// a key is Python's to answer (several replicas, or only on disk).
bool readable(const Table& t, const Request& q, std::vector<uint32_t>& found) {
  found.resize(q.keys.size());
  t.find_many(q.keys.data(), q.keys.size(), found.data());
  for (uint32_t& i : found) {
    if (i == NONE || !t.rec(i).complete) {
      i = NONE;
      continue;
    }
    if (t.rec(i).seg == NONE || t.more_replicas(i)) return false;
  }
  return true;
}

std::optional<Served> get(Table& t, const std::vector<std::string>& names, const std::vector<int64_t>& regions,
                          const Request& q, double now, const Limits& lim) {
  std::vector<uint32_t> found;
  if (!readable(t, q, found)) return std::nullopt;
  Served s{{}, kGet, q.keys.size(), 0};
  const double lease = now + double(lim.ttl_ms) / 1000;
  std::vector<uint32_t> segs;                   // the reply's segment names, in first use
  std::unordered_map<uint32_t, uint32_t> index;  // segment id -> its place in segs
  std::vector<int64_t> at(found.size(), -1);
  constexpr size_t kAhead = 4;   // moving a record to the LRU tail writes its neighbours: fetched this far ahead
  for (size_t j = 0; j < found.size(); ++j) {
    if (j + kAhead < found.size() && found[j + kAhead] != NONE) {
      const Rec& next = t.rec(found[j + kAhead]);
      if (next.prev != NONE) __builtin_prefetch(&t.rec(next.prev), 1);
      if (next.next != NONE) __builtin_prefetch(&t.rec(next.next), 1);
    }
    if (found[j] == NONE) continue;
    Rec& r = t.rec(found[j]);
    if (r.lease_until < lease) r.lease_until = lease;
    r.last_access = now;
    t.touch(found[j]);
    at[j] = index.try_emplace(r.seg, uint32_t(segs.size())).first->second;
    if (size_t(at[j]) == segs.size()) segs.push_back(r.seg);
    ++s.hits;
  }
  tcp::MpWriter w(s.reply);
  head(w, q.rid);
  if (q.cols) {   // [ttl, sizes, names, regions, seg_idx, offs, {more}, sums, {disk}]
    w.array(9);
    w.uint(lim.ttl_ms);
    w.array(uint32_t(found.size()));
    for (uint32_t i : found) i == NONE ? w.sint(-1) : w.uint(t.rec(i).size);
    w.array(uint32_t(segs.size()));
    for (uint32_t g : segs) w.str(names[g]);
    w.array(uint32_t(segs.size()));
    for (uint32_t g : segs) w.sint(regions[g]);
    w.array(uint32_t(found.size()));
    for (int64_t a : at) w.sint(a);
    w.array(uint32_t(found.size()));
    for (uint32_t i : found) w.uint(i == NONE ? 0 : t.rec(i).off);
    w.map(0);
    w.array(uint32_t(found.size()));
    for (uint32_t i : found) i != NONE && t.rec(i).has_sum ? w.uint(t.rec(i).checksum) : w.nil();
    w.map(0);
    return s;
  }
  w.array(uint32_t(found.size()));   // per key [OK, [size, [[name, region, off]], ttl, checksum]] or [NOT_FOUND, nil]
  for (uint32_t i : found) {
    w.array(2);
    if (i == NONE) {
      w.uint(kNotFound);
      w.nil();
      continue;
    }
    const Rec& r = t.rec(i);
    w.uint(kOk);
    w.array(4);
    w.uint(r.size);
    w.array(1);
    w.array(3);
    w.str(names[r.seg]);
    w.sint(regions[r.seg]);
    w.uint(r.off);
    w.uint(lim.ttl_ms);
    r.has_sum ? w.uint(r.checksum) : w.nil();
  }
  return s;
}

Served exists(const Table& t, const Request& q) {
  Served s{{}, kExists, q.keys.size(), 0};
  tcp::MpWriter w(s.reply);
  head(w, q.rid);
  w.array(uint32_t(q.keys.size()));
  std::vector<uint32_t> found(q.keys.size());
  t.find_many(q.keys.data(), q.keys.size(), found.data());
  for (uint32_t i : found) {
    const bool ok = i != NONE && t.rec(i).complete;
    s.hits += ok;
    w.boolean(ok);
  }
  return s;
}

}  // namespace

std::optional<Served> serve(Table& t, const std::vector<std::string>& names, const std::vector<int64_t>& regions,
                            std::string_view body, double now, const Limits& lim) {
  auto q = parse(body, lim);
  if (!q) return std::nullopt;
  if (q->op == kExists) return exists(t, *q);
  if (q->op == kPut) return Served{{}, kPut, q->put->keys.size(), 0, std::move(q->put)};
  return get(t, names, regions, *q, now, lim);
}

bool commit_put(Table& t, const PutRequest& q, uint32_t seg, uint64_t align, uint64_t front, uint64_t end,
                double now, std::string& reply, std::vector<uint64_t>& rounded, std::vector<uint32_t>& recs) {
  const size_t n = q.keys.size();
  rounded.resize(n);
  uint64_t at = front;
  for (size_t k = 0; k < n; ++k) {   // back to back from the slab's front, inside it (sizes <= 2**48: no overflow)
    rounded[k] = (q.sizes[k] + align - 1) & ~(align - 1);
    if (q.offs[k] != at || rounded[k] > end - std::min(at, end)) return false;
    at += rounded[k];
  }
  recs.resize(n);
  if (!t.insert_committed(q.keys.data(), n, seg, q.sizes.data(), q.offs.data(), now, q.sums.data(),
                          q.has_sum.data(), recs.data()))
    return false;
  tcp::MpWriter w(reply);
  head(w, q.rid);
  w.array(uint32_t(n));   // per key [OK, nil]
  for (size_t k = 0; k < n; ++k) {
    w.array(2);
    w.uint(kOk);
    w.nil();
  }
  return true;
}

}  // namespace kvp::meta
