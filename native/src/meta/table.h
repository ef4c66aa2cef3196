// The master's object table (issue #18 part 2): key -> one fixed 80-byte record, in an open-addressing index,
// with intrusive LRU lists. Python (kvplugins/store/master/metadata.py) owns the policy; this owns the bytes.
#pragma once
#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace kvp::meta {

constexpr uint32_t NONE = 0xffffffffu;
enum List : uint8_t { UNPINNED = 0, PINNED = 1, PARKED = 2, FREE = 3 };

struct Replica { uint32_t seg; uint64_t off; };

struct Rec {
  char* key;              // malloc'd UTF-8, keylen bytes, not terminated
  uint64_t size, off, checksum;
  double lease_until, last_access, t;   // t: put deadline while pending, commit time (born) once complete
  uint32_t keylen, seg, prev, next, gen;   // seg/off: first replica (seg NONE: no DRAM replica)
  uint8_t complete, has_sum, pin, list;
};

class Table {
 public:
  Table();
  ~Table();
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  uint32_t find(std::string_view key) const;            // record index or NONE
  // find of each keys[k] into out[k], the slot, record and key of later keys prefetched while earlier ones are
  // compared (a big table's lookup is ~3 cache misses, taken one after another by find)
  void find_many(const std::string_view* keys, size_t n, uint32_t* out) const;
  uint32_t insert(std::string_view key);                // new record (pending, no replica, unlisted); NONE if present
  uint32_t insert_placed(std::string_view key, uint32_t seg, uint64_t off);   // new record, complete, its one
                                                         // replica at (seg, off), unlisted; NONE if present
  // A batch of new complete objects (a slab put): when no keys[k] is in the table and none repeats, each becomes
  // an object of sizes[k] bytes at offs[k] of segment `seg`, born and last used `now`, checksum sums[k] where
  // has_sum[k] (has_sum null: none), most recently used; out[k] its record. False, nothing changed, otherwise.
  bool insert_committed(const std::string_view* keys, size_t n, uint32_t seg, const uint64_t* sizes,
                        const uint64_t* offs, double now, const uint64_t* sums, const uint8_t* has_sum,
                        uint32_t* out);
  void erase(uint32_t i);
  void link(uint32_t i, List l);                         // append to list l (most recently used); unlinks first
  void unlink(uint32_t i);
  void touch(uint32_t i) { if (recs_[i].list < FREE) link(i, List(recs_[i].list)); }
  void set_complete(uint32_t i, bool c);
  std::vector<Replica> replicas(uint32_t i) const;
  void set_replicas(uint32_t i, const std::vector<Replica>& r);
  bool more_replicas(uint32_t i) const { return more_.count(i) != 0; }
  bool on_segment(uint32_t i, uint32_t seg) const;

  Rec& rec(uint32_t i) { return recs_[i]; }
  const Rec& rec(uint32_t i) const { return recs_[i]; }
  bool live(uint32_t i, uint32_t gen) const { return i < recs_.size() && recs_[i].key && recs_[i].gen == gen; }
  uint32_t head(List l) const { return head_[l]; }
  uint32_t tail(List l) const { return tail_[l]; }
  uint64_t count(List l) const { return count_[l]; }
  uint64_t size() const { return live_; }
  uint64_t seg_count(uint32_t seg) const { return seg < seg_count_.size() ? seg_count_[seg] : 0; }
  const std::unordered_set<uint32_t>& pending() const { return pending_; }
  std::unordered_map<uint32_t, double>& pin_until() { return pin_until_; }
  uint64_t bytes() const;                                // memory held (records, index, keys, side maps)

 private:
  struct Slot { uint32_t idx1, hash; };                  // idx1 = record index + 1 (0 = empty)
  uint32_t add(std::string_view key);                    // new record (not pending, no replica, unlisted); NONE if present
  uint32_t add(std::string_view key, uint32_t h);        // add of a key hashed `h`, the index already grown for it
  uint32_t probe(std::string_view key, uint32_t h, size_t* slot) const;
  void grow();
  void count_seg(uint32_t seg, int64_t d);

  std::vector<Rec> recs_;
  std::vector<uint32_t> free_;
  std::vector<Slot> slots_;
  uint64_t live_ = 0, key_bytes_ = 0;
  uint32_t head_[3], tail_[3];
  uint64_t count_[3] = {0, 0, 0};
  std::vector<uint64_t> seg_count_;
  std::unordered_map<uint32_t, std::vector<Replica>> more_;   // replicas after the first (rare)
  std::unordered_map<uint32_t, double> pin_until_;            // soft pins only
  std::unordered_set<uint32_t> pending_;
};

// offset -> allocation size, for a segment's allocator (kvplugins/store/master/allocator.py): open addressing,
// 12 bytes a slot. Sizes are multiples of ``align`` below 2**32 * align.
class SizeMap {
 public:
  explicit SizeMap(uint64_t align);
  bool get(uint64_t off, uint64_t* size) const;
  void set(uint64_t off, uint64_t size);
  bool pop(uint64_t off, uint64_t* size);
  uint64_t size() const { return n_; }
  uint64_t bytes() const { return keys_.capacity() * 8 + vals_.capacity() * 4; }
 private:
  size_t slot(uint64_t off) const;
  void grow();
  uint64_t align_;
  unsigned shift_;
  std::vector<uint64_t> keys_;    // ~0 = empty
  std::vector<uint32_t> vals_;
  uint64_t n_ = 0;
};

}  // namespace kvp::meta
