// FastRoutes (see fast.h): small same-host batches checked and copied in one native call.
#include "fast.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/uio.h>
#include <unistd.h>

#include <vector>

namespace kvp::cma {

namespace {
bool exited(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) != 0;  // readable (the process exited) or an error
}
}  // namespace

std::shared_ptr<const int> own_pidfd(int pidfd) {
  const int fd = ::fcntl(pidfd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  return std::shared_ptr<const int>(new int(fd), [](const int* p) {
    ::close(*p);
    delete p;
  });
}

long FastRoutes::run(bool read, const void* remote, uint64_t region, const uint64_t* laddr, const uint64_t* roff,
                     const uint64_t* length, size_t n, uint64_t* digests, FastRoutePtr& keep) {
  if (n == 0 || n > max_spans_) return 0;
  keep = routes_.find(remote, region);
  const FastRoutePtr& route = keep;
  if (!route || (!read && route->readonly)) return 0;
  std::vector<iovec> local(n), peer(n);
  uint64_t total = 0;
  for (size_t j = 0; j < n; ++j) {
    const uint64_t len = length[j], off = roff[j];
    total += len;
    if (len == 0 || off > route->rlength || len > route->rlength - off) return 0;
    local[j] = iovec{reinterpret_cast<void*>(laddr[j]), len};
    peer[j] = iovec{reinterpret_cast<void*>(route->raddr + off), len};
  }
  std::vector<const Local*> at;
  std::vector<LocalRef> held;  // the local regions the spans lie in, kept until done
  if (!locals.hold(laddr, length, n, read, at, held)) return 0;
  if (exited(*route->pidfd)) return -1;
  const ssize_t got = read ? ::process_vm_readv(route->pid, local.data(), n, peer.data(), n, 0)
                           : ::process_vm_writev(route->pid, local.data(), n, peer.data(), n, 0);
  if (got < 0 || uint64_t(got) != total || exited(*route->pidfd)) return -1;
  return tally_.done(read, laddr, length, n, total, digests);
}

}  // namespace kvp::cma
