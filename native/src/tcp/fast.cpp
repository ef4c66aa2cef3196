// FastRoutes (see fast.h): small TCP batches checked and sent in one native call.
#include "fast.h"

#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <mutex>
#include <utility>

#include "client.h"
#include "wire.h"

namespace kvp::tcp {

namespace {
double monotonic_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}
}  // namespace

FastRoutes::FastRoutes(Peers& peers, size_t max_spans, size_t max_routes)
    : peers_(peers),
      max_spans_(std::min<size_t>(max_spans, kMaxEntries)),
      routes_(max_routes) {}

long FastRoutes::run(bool read, const void* remote, uint64_t region, const uint64_t* laddr, const uint64_t* roff,
                     const uint64_t* length, size_t n, double deadline_at, uint64_t* digests, FastRoutePtr& keep) {
  if (n == 0 || n > max_spans_) return 0;
  keep = routes_.find(remote, region);
  const FastRoutePtr& route = keep;
  if (!route || (!read && route->readonly)) return 0;
  uint64_t total = 0;
  for (size_t j = 0; j < n; ++j) {
    const uint64_t len = length[j], off = roff[j];
    total += len;
    if (len == 0 || total > route->limit || off > route->rlength || len > route->rlength - off) return 0;
  }
  std::vector<const Local*> at;
  std::vector<LocalRef> held;  // the local regions the spans lie in, kept until done
  if (!locals.hold(laddr, length, n, read, at, held)) return 0;
  const double left = deadline_at - monotonic_s();
  if (!(left > 0)) return 0;  // the general path names the timeout
  const int fd = peers_.take(route->peer);
  if (fd < 0) return 0;  // no idle connection: the general path connects
  const std::vector<uint64_t> regions(n, region);
  const int op = read ? kRead : kWrite;
  const Batch b{op, laddr, regions.data(), roff, length, n, route->limit, peers_.max_frame(), left, 0};
  const Result r = transfer(b, {fd}, {1}, peers_.ids());
  if (r.broken[0]) abort_fd(fd);
  else if (!peers_.give(route->peer, fd)) ::close(fd);
  for (size_t j = 0; j < n; ++j)
    if (r.code[j] == kRetry) return 0;  // a pooled connection the server had closed: nothing moved
    else if (r.code[j] != kOk) return -1;
  return tally_.done(read, laddr, length, n, total, digests);
}

}  // namespace kvp::tcp
