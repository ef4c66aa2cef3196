// See table.h. Linear probing with backward-shift deletion (no tombstones), load factor <= 0.75.
#define XXH_INLINE_ALL
#include "table.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

namespace kvp::meta {

static uint32_t hash32(std::string_view k) { return uint32_t(XXH3_64bits(k.data(), k.size())); }

Table::Table() : slots_(1024, Slot{0, 0}) {
  for (int l = 0; l < 3; ++l) head_[l] = tail_[l] = NONE;
}

Table::~Table() {
  for (auto& r : recs_)
    std::free(r.key);
}

uint32_t Table::probe(std::string_view key, uint32_t h, size_t* slot) const {
  const size_t mask = slots_.size() - 1;
  for (size_t s = h & mask;; s = (s + 1) & mask) {
    const Slot& e = slots_[s];
    if (!e.idx1) { *slot = s; return NONE; }
    if (e.hash == h) {
      const Rec& r = recs_[e.idx1 - 1];
      if (r.keylen == key.size() && std::memcmp(r.key, key.data(), key.size()) == 0) { *slot = s; return e.idx1 - 1; }
    }
  }
}

uint32_t Table::find(std::string_view key) const {
  size_t s;
  return probe(key, hash32(key), &s);
}

void Table::find_many(const std::string_view* keys, size_t n, uint32_t* out) const {
  constexpr size_t kSlot = 12, kRec = 8, kKey = 4;   // how far ahead each line is fetched (keys)
  const size_t mask = slots_.size() - 1;
  std::vector<uint32_t> h(n), cand(n, NONE);
  for (size_t k = 0; k < n; ++k) h[k] = hash32(keys[k]);
  auto first_match = [&](size_t k) {   // the first slot holding key k's hash: its record, or NONE
    for (size_t s = h[k] & mask;; s = (s + 1) & mask) {
      const Slot& e = slots_[s];
      if (!e.idx1) return NONE;
      if (e.hash == h[k]) return e.idx1 - 1;
    }
  };
  for (size_t k = 0; k < n + kSlot; ++k) {
    if (k < n) __builtin_prefetch(&slots_[h[k] & mask]);
    if (k >= kSlot - kRec && k - (kSlot - kRec) < n) {   // its slot fetched: fetch the record it names
      const size_t j = k - (kSlot - kRec);
      cand[j] = first_match(j);
      if (cand[j] != NONE) __builtin_prefetch(&recs_[cand[j]]);
    }
    if (k >= kSlot - kKey && k - (kSlot - kKey) < n) {   // its record fetched: fetch the key bytes
      const size_t j = k - (kSlot - kKey);
      if (cand[j] != NONE) __builtin_prefetch(recs_[cand[j]].key);
    }
    if (k >= kSlot) {
      const size_t j = k - kSlot;
      size_t s;
      out[j] = probe(keys[j], h[j], &s);
    }
  }
}

void Table::grow() {
  std::vector<Slot> old(slots_.size() * 2, Slot{0, 0});
  old.swap(slots_);
  const size_t mask = slots_.size() - 1;
  for (const Slot& e : old) {
    if (!e.idx1) continue;
    size_t s = e.hash & mask;
    while (slots_[s].idx1) s = (s + 1) & mask;
    slots_[s] = e;
  }
}

uint32_t Table::insert(std::string_view key) {
  const uint32_t i = add(key);
  if (i != NONE) pending_.insert(i);
  return i;
}

uint32_t Table::insert_placed(std::string_view key, uint32_t seg, uint64_t off) {
  const uint32_t i = add(key);
  if (i == NONE) return NONE;
  Rec& r = recs_[i];
  r.complete = 1, r.seg = seg, r.off = off;
  count_seg(seg, 1);
  return i;
}

bool Table::insert_committed(const std::string_view* keys, size_t n, uint32_t seg, const uint64_t* sizes,
                             const uint64_t* offs, double now, const uint64_t* sums, const uint8_t* has_sum,
                             uint32_t* out) {
  // Each key hashed once and inserted, its slot fetched kAhead keys early (the index grown for the whole batch
  // first, so slots stay put); a key already stored, or repeated in the batch, is found by its own insert, and
  // the keys inserted before it are erased again: nothing changed.
  constexpr size_t kAhead = 8;
  std::vector<uint32_t> h(n);
  for (size_t k = 0; k < n; ++k) h[k] = hash32(keys[k]);
  while ((live_ + n) * 4 > slots_.size() * 3) grow();
  const size_t mask = slots_.size() - 1;
  for (size_t k = 0; k < std::min(n, kAhead); ++k) __builtin_prefetch(&slots_[h[k] & mask]);
  for (size_t k = 0; k < n; ++k) {
    if (k + kAhead < n) __builtin_prefetch(&slots_[h[k + kAhead] & mask]);
    out[k] = add(keys[k], h[k]);
    if (out[k] == NONE) {
      while (k) erase(out[--k]);
      return false;
    }
  }
  for (size_t k = 0; k < n; ++k) {
    Rec& r = recs_[out[k]];
    r.complete = 1, r.seg = seg, r.off = offs[k];
    r.size = sizes[k], r.t = now, r.last_access = now, r.pin = 0;
    r.has_sum = has_sum && has_sum[k], r.checksum = r.has_sum ? sums[k] : 0;
    link(out[k], UNPINNED);
  }
  if (n) count_seg(seg, int64_t(n));
  return true;
}

uint32_t Table::add(std::string_view key) {
  if ((live_ + 1) * 4 > slots_.size() * 3) grow();
  return add(key, hash32(key));
}

uint32_t Table::add(std::string_view key, uint32_t h) {
  size_t s;
  if (probe(key, h, &s) != NONE) return NONE;
  if (recs_.size() >= NONE - 1 && free_.empty()) throw std::length_error("object table is full (2**32 records)");
  char* k = static_cast<char*>(std::malloc(key.size() ? key.size() : 1));
  if (!k) throw std::bad_alloc();
  std::memcpy(k, key.data(), key.size());
  uint32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else {
    i = uint32_t(recs_.size());
    recs_.push_back(Rec{});
  }
  Rec& r = recs_[i];
  const uint32_t gen = r.gen + 1;
  r = Rec{};
  r.key = k, r.keylen = uint32_t(key.size()), r.seg = NONE, r.prev = r.next = NONE, r.gen = gen, r.list = FREE;
  slots_[s] = Slot{i + 1, h};
  ++live_;
  key_bytes_ += key.size();
  return i;
}

void Table::erase(uint32_t i) {
  Rec& r = recs_[i];
  unlink(i);
  const std::string_view key(r.key, r.keylen);
  size_t s;
  if (probe(key, hash32(key), &s) != i) throw std::logic_error("object table: record not in its index");
  const size_t mask = slots_.size() - 1;
  for (size_t j = s;;) {               // backward shift: pull later members of the cluster into the hole
    j = (j + 1) & mask;
    if (!slots_[j].idx1) break;
    const size_t home = slots_[j].hash & mask;
    const bool between = s <= j ? (s < home && home <= j) : (s < home || home <= j);
    if (!between) { slots_[s] = slots_[j]; s = j; }
  }
  slots_[s] = Slot{0, 0};
  set_replicas(i, {});
  pin_until_.erase(i);
  pending_.erase(i);
  key_bytes_ -= r.keylen;
  std::free(r.key);
  r.key = nullptr, r.list = FREE;
  ++r.gen;
  free_.push_back(i);
  --live_;
}

void Table::unlink(uint32_t i) {
  Rec& r = recs_[i];
  if (r.list >= FREE) return;
  const List l = List(r.list);
  (r.prev == NONE ? head_[l] : recs_[r.prev].next) = r.next;
  (r.next == NONE ? tail_[l] : recs_[r.next].prev) = r.prev;
  r.prev = r.next = NONE;
  r.list = FREE;
  --count_[l];
}

void Table::link(uint32_t i, List l) {
  unlink(i);
  Rec& r = recs_[i];
  r.list = l, r.prev = tail_[l], r.next = NONE;
  (tail_[l] == NONE ? head_[l] : recs_[tail_[l]].next) = i;
  tail_[l] = i;
  ++count_[l];
}

void Table::set_complete(uint32_t i, bool c) {
  recs_[i].complete = c;
  if (c) pending_.erase(i); else pending_.insert(i);
}

void Table::count_seg(uint32_t seg, int64_t d) {
  if (seg == NONE) return;
  if (seg >= seg_count_.size()) seg_count_.resize(seg + 1, 0);
  seg_count_[seg] += d;
}

std::vector<Replica> Table::replicas(uint32_t i) const {
  const Rec& r = recs_[i];
  std::vector<Replica> out;
  if (r.seg == NONE) return out;
  out.push_back({r.seg, r.off});
  auto it = more_.find(i);
  if (it != more_.end()) out.insert(out.end(), it->second.begin(), it->second.end());
  return out;
}

void Table::set_replicas(uint32_t i, const std::vector<Replica>& rs) {
  for (const Replica& x : replicas(i)) count_seg(x.seg, -1);
  Rec& r = recs_[i];
  more_.erase(i);
  r.seg = rs.empty() ? NONE : rs[0].seg;
  r.off = rs.empty() ? 0 : rs[0].off;
  if (rs.size() > 1) more_[i] = std::vector<Replica>(rs.begin() + 1, rs.end());
  for (const Replica& x : rs) count_seg(x.seg, 1);
}

bool Table::on_segment(uint32_t i, uint32_t seg) const {
  const Rec& r = recs_[i];
  if (r.seg == seg) return true;
  auto it = more_.find(i);
  if (it == more_.end()) return false;
  for (const Replica& x : it->second)
    if (x.seg == seg) return true;
  return false;
}

uint64_t Table::bytes() const {
  return recs_.capacity() * sizeof(Rec) + slots_.capacity() * sizeof(Slot) + free_.capacity() * 4 + key_bytes_ +
         (more_.size() + pin_until_.size() + pending_.size()) * 48;
}

SizeMap::SizeMap(uint64_t align) : align_(align), shift_(0), keys_(64, ~0ull), vals_(64, 0) {
  if (!align || (align & (align - 1))) throw std::invalid_argument("SizeMap: align must be a power of two");
  while ((1ull << shift_) < align) ++shift_;
}

size_t SizeMap::slot(uint64_t off) const {
  const size_t mask = keys_.size() - 1;
  size_t s = size_t(((off >> shift_) * 0x9E3779B97F4A7C15ull) >> 20) & mask;
  while (keys_[s] != ~0ull && keys_[s] != off) s = (s + 1) & mask;
  return s;
}

bool SizeMap::get(uint64_t off, uint64_t* size) const {
  const size_t s = slot(off);
  if (keys_[s] == ~0ull) return false;
  *size = uint64_t(vals_[s]) << shift_;
  return true;
}

void SizeMap::grow() {
  std::vector<uint64_t> ok(keys_.size() * 2, ~0ull);
  std::vector<uint32_t> ov(vals_.size() * 2, 0);
  ok.swap(keys_), ov.swap(vals_);
  for (size_t j = 0; j < ok.size(); ++j)
    if (ok[j] != ~0ull) {
      const size_t s = slot(ok[j]);
      keys_[s] = ok[j], vals_[s] = ov[j];
    }
}

void SizeMap::set(uint64_t off, uint64_t size) {
  if (off == ~0ull || size & (align_ - 1) || (size >> shift_) > 0xffffffffull)
    throw std::invalid_argument("SizeMap: size " + std::to_string(size) + " is not a multiple of the alignment " +
                                std::to_string(align_) + " below 2**32 of them");
  if ((n_ + 1) * 4 > keys_.size() * 3) grow();
  const size_t s = slot(off);
  if (keys_[s] == ~0ull) ++n_;
  keys_[s] = off, vals_[s] = uint32_t(size >> shift_);
}

bool SizeMap::pop(uint64_t off, uint64_t* size) {
  size_t s = slot(off);
  if (keys_[s] == ~0ull) return false;
  *size = uint64_t(vals_[s]) << shift_;
  const size_t mask = keys_.size() - 1;
  auto home = [&](uint64_t k) { return size_t(((k >> shift_) * 0x9E3779B97F4A7C15ull) >> 20) & mask; };
  for (size_t j = s;;) {
    j = (j + 1) & mask;
    if (keys_[j] == ~0ull) break;
    const size_t h = home(keys_[j]);
    const bool between = s <= j ? (s < h && h <= j) : (s < h || h <= j);
    if (!between) { keys_[s] = keys_[j], vals_[s] = vals_[j]; s = j; }
  }
  keys_[s] = ~0ull;
  --n_;
  return true;
}

}  // namespace kvp::meta
