#include "frames.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace kvp::store {
namespace {

constexpr uint32_t kMaxReply = 64u << 20;   // a reply of one batch op is far below this

void fail(Conn& c, int status, std::string what) {
  c.status = status;
  c.body = std::move(what);
}

// Moves `c` on as far as the socket allows without blocking.
void step(Conn& c) {
  while (c.sent < c.out.size()) {
    ssize_t k = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) { c.sent += size_t(k); continue; }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    return fail(c, kBroken, std::string("send: ") + std::strerror(errno));
  }
  for (;;) {
    if (!c.sized && c.have >= 4) {
      const uint8_t* p = c.in.data();
      const uint32_t n = (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
      if (n > kMaxReply) return fail(c, kBroken, "a reply frame of " + std::to_string(n) + " bytes");
      c.want = 4 + size_t(n);
      c.sized = true;
      if (c.in.size() < c.want) c.in.resize(c.want);
    }
    if (c.sized && c.have >= c.want) {
      if (c.have != c.want) return fail(c, kBroken, "bytes past the reply frame");
      c.body.assign(reinterpret_cast<const char*>(c.in.data()) + 4, c.want - 4);
      c.status = kReplied;
      return;
    }
    ssize_t k = ::recv(c.fd, c.in.data() + c.have, c.in.size() - c.have, MSG_DONTWAIT);
    if (k > 0) { c.have += size_t(k); continue; }
    if (k == 0) return fail(c, kBroken, "the master closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    return fail(c, kBroken, std::string("recv: ") + std::strerror(errno));
  }
}

}  // namespace

Clock::time_point deadline_in(double timeout_ms) {
  return Clock::now() + std::chrono::microseconds(int64_t(timeout_ms * 1000));
}

void exchange(std::vector<Conn>& conns, Clock::time_point deadline) {
  std::vector<pollfd> fds;
  std::vector<Conn*> busy;
  for (;;) {
    fds.clear();
    busy.clear();
    for (Conn& c : conns) {
      if (c.status != kBusy) continue;
      step(c);
      if (c.status != kBusy) continue;
      fds.push_back({c.fd, short(c.sent < c.out.size() ? POLLOUT : POLLIN), 0});
      busy.push_back(&c);
    }
    if (busy.empty()) return;
    const double left = std::chrono::duration<double, std::milli>(deadline - Clock::now()).count();
    if (left <= 0) {
      for (Conn* c : busy) fail(*c, kLate, "no reply in time");
      return;
    }
    if (::poll(fds.data(), fds.size(), int(left) + 1) < 0 && errno != EINTR) {
      for (Conn* c : busy) fail(*c, kBroken, std::string("poll: ") + std::strerror(errno));
      return;
    }
  }
}

bool accepted(tcp::MpReader& r, uint64_t rid) {
  uint32_t n;
  uint64_t v;
  bool ok;
  return r.array(n, "reply") && n == 4 && r.uint(v, "version") && v == kVersion && r.uint(v, "id") && v == rid &&
         r.boolean(ok, "ok") && ok;
}

}  // namespace kvp::store
