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

}  // namespace

void copy_batch(const uint64_t* dst, const uint64_t* src, const uint64_t* len, size_t n, int threads) {
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += len[i];
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

}  // namespace kvp
