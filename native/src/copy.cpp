#include "kvp_copy.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace kvp {
namespace {

constexpr uint64_t kParallelMin = 4ull << 20;  // below this a second thread costs more than it saves

struct Span { uint64_t dst, src, len; };

void run_spans(const std::vector<Span>& spans, size_t lo, size_t hi) {
  for (size_t i = lo; i < hi; ++i)
    std::memcpy(reinterpret_cast<void*>(spans[i].dst), reinterpret_cast<const void*>(spans[i].src), spans[i].len);
}

// Cut spans into pieces of at most `piece` bytes so threads get equal shares.
std::vector<Span> split(const uint64_t* dst, const uint64_t* src, const uint64_t* len, size_t n, uint64_t piece) {
  std::vector<Span> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i)
    for (uint64_t off = 0; off < len[i]; off += piece)
      out.push_back({dst[i] + off, src[i] + off, std::min(piece, len[i] - off)});
  return out;
}

// Runs fn(lo, hi) over [0, n) cut into up to `threads` ranges of about equal bytes (weights w).
template <class Fn>
void by_bytes(size_t n, const uint64_t* w, uint64_t total, int threads, Fn fn) {
  if (threads <= 1 || total < kParallelMin || n < 2) {
    fn(size_t(0), n);
    return;
  }
  std::vector<size_t> cut{0};
  uint64_t acc = 0;
  const uint64_t share = (total + threads - 1) / threads;
  for (size_t i = 0; i < n; ++i) {
    acc += w[i];
    if (acc >= share * cut.size() && cut.size() < size_t(threads) && i + 1 < n) cut.push_back(i + 1);
  }
  cut.push_back(n);
  std::vector<std::thread> pool;
  for (size_t t = 1; t + 1 < cut.size(); ++t) pool.emplace_back(fn, cut[t], cut[t + 1]);
  fn(cut[0], cut[1]);
  for (auto& th : pool) th.join();
}

uint64_t sum(const uint64_t* len, size_t n) {
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += len[i];
  return total;
}

}  // namespace

void copy_batch(const uint64_t* dst, const uint64_t* src, const uint64_t* len, size_t n, int threads,
                uint64_t* digests, const HashOps* ops) {
  const uint64_t total = sum(len, n);
  if (digests) {
    by_bytes(n, len, total, threads, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i)
        digests[i] = ops->copy_hash(reinterpret_cast<char*>(dst[i]), reinterpret_cast<const char*>(src[i]), len[i]);
    });
    return;
  }
  if (threads <= 1 || total < kParallelMin) {
    for (size_t i = 0; i < n; ++i)
      std::memcpy(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]), len[i]);
    return;
  }
  const uint64_t piece = std::max<uint64_t>(1ull << 20, total / (uint64_t(threads) * 4));
  std::vector<Span> spans = split(dst, src, len, n, piece);
  std::vector<std::thread> pool;
  const size_t per = (spans.size() + threads - 1) / threads;
  for (int t = 1; t < threads; ++t) {
    size_t lo = t * per, hi = std::min(spans.size(), lo + per);
    if (lo < hi) pool.emplace_back(run_spans, std::cref(spans), lo, hi);
  }
  run_spans(spans, 0, std::min(spans.size(), per));
  for (auto& th : pool) th.join();
}

bool hash_keys(const uint64_t* addr, const uint64_t* len, const uint64_t* owner, size_t n, uint64_t* digests,
               size_t nkeys, int threads, const HashOps* ops) {
  // first[k]..first[k+1]: the spans of key k (checked consecutive)
  std::vector<size_t> first(nkeys + 1, n), count(nkeys, 0);
  for (size_t i = 0; i < n; ++i) {
    if (owner[i] >= nkeys) return false;
    if (count[owner[i]]++ == 0) first[owner[i]] = i;
    else if (owner[i - 1] != owner[i]) return false;
  }
  std::vector<uint64_t> key_bytes(nkeys, 0);
  for (size_t i = 0; i < n; ++i) key_bytes[owner[i]] += len[i];
  by_bytes(nkeys, key_bytes.data(), sum(len, n), threads, [&](size_t lo, size_t hi) {
    for (size_t k = lo; k < hi; ++k)
      digests[k] = ops->hash_spans(addr + first[k], len + first[k], count[k]);  // no spans: the empty digest
  });
  return true;
}

}  // namespace kvp
