#include "client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <mutex>
#include <thread>

#include "iov.h"
#include "wire.h"

namespace kvp::tcp {
namespace {

constexpr uint64_t kMinPiece = 1 << 20;   // smallest frame worth another connection

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Piece { size_t span; uint64_t local; WireEntry e; };

struct Plan {
  std::vector<Piece> pieces;
  std::vector<size_t> starts;   // frame f = pieces[starts[f], starts[f+1])
};

Plan plan(const Batch& b, size_t conns) {
  uint64_t total = 0;
  for (size_t j = 0; j < b.n; ++j) total += b.lens[j];
  const uint64_t target = std::min(b.limit, std::max(kMinPiece, (total + conns - 1) / conns));
  Plan p;
  p.pieces.reserve(b.n);
  p.starts.push_back(0);
  uint64_t room = target;
  for (size_t j = 0; j < b.n; ++j) {
    for (uint64_t off = 0; off < b.lens[j];) {
      if (room == 0 || p.pieces.size() - p.starts.back() == kMaxEntries) { p.starts.push_back(p.pieces.size()); room = target; }
      uint64_t k = std::min(room, b.lens[j] - off);
      p.pieces.push_back({j, b.addrs[j] + off, {b.regions[j], b.offs[j] + off, k}});
      off += k;
      room -= k;
    }
  }
  if (p.pieces.empty()) p.starts.assign(1, 0);             // no bytes to move: no frame
  else if (p.starts.back() != p.pieces.size()) p.starts.push_back(p.pieces.size());
  return p;
}

enum class St { kSend, kHead, kPayload, kDone, kBroken };

struct C {
  int fd;
  bool reused;
  std::vector<size_t> frames;
  size_t k = 0;
  St st = St::kSend;
  std::string out;
  IovCursor iov;
  std::vector<uint8_t> buf = std::vector<uint8_t>(64 << 10);
  size_t b0 = 0, b1 = 0;
  bool got_bytes = false;
  uint64_t rid = 0;
  short wait = 0;
};

class Run {
 public:
  Run(const Batch& b, Result& r, const Plan& p, std::atomic<uint64_t>& ids) : b_(b), r_(r), p_(p), ids_(ids) {}

  // A small batch re-polls its sockets for up to `spin_s` before sleeping in poll(): a sleeping thread's
  // wake-up costs tens of µs per round trip on a VM, more than the whole exchange (docs/transfer.md).
  void go(std::vector<C>& cs, double spin_s) {
    const double deadline = now_s() + b_.timeout_s;
    spin_until_ = spin_s > 0 ? now_s() + spin_s : 0;
    for (auto& c : cs) if (!c.frames.empty()) start(c); else c.st = St::kDone;
    std::vector<pollfd> pfd;
    std::vector<C*> who;
    for (;;) {
      pfd.clear();
      who.clear();
      // Past the deadline nothing more is sent: a process paused (SIGSTOP) mid-batch must not land a write,
      // on resume, in space its grant no longer covers (the store reclaims it and hands it to another put).
      const bool late = now_s() >= deadline;
      for (auto& c : cs) {
        if (c.st == St::kDone || c.st == St::kBroken) continue;
        if (late) { broken(c, "did not answer within the timeout", false, kTimeout); continue; }
        drive(c);
        if (c.st == St::kDone || c.st == St::kBroken) continue;
        pfd.push_back({c.fd, c.wait, 0});
        who.push_back(&c);
      }
      if (pfd.empty()) return;
      if (spin_until_ > 0 && now_s() < spin_until_) continue;    // a small batch: poll the sockets a while
      double left = deadline - now_s();
      int rc = left > 0 ? ::poll(pfd.data(), pfd.size(), int(std::ceil(left * 1000))) : 0;
      if (rc < 0 && errno == EINTR) continue;
      if (rc <= 0 && now_s() >= deadline) {
        for (C* c : who) broken(*c, "did not answer within the timeout", false, kTimeout);
        return;
      }
    }
  }

 private:
  void start(C& c) {
    const size_t f = c.frames[c.k];
    const size_t s = p_.starts[f], e = p_.starts[f + 1];
    std::vector<WireEntry> ents;
    ents.reserve(e - s);
    uint64_t payload = 0;
    for (size_t i = s; i < e; ++i) { ents.push_back(p_.pieces[i].e); payload += p_.pieces[i].e.length; }
    c.rid = ids_++;
    encode_request(c.out, b_.op, c.rid, ents.data(), ents.size(), b_.op == kWrite ? payload : 0,
                   b_.op == kWrite ? b_.land_by_ms : 0);
    c.iov.reset();
    c.iov.add(c.out.data(), c.out.size());
    if (b_.op == kWrite)
      for (size_t i = s; i < e; ++i) c.iov.add(reinterpret_cast<void*>(p_.pieces[i].local), p_.pieces[i].e.length);
    c.st = St::kSend;
  }

  void drive(C& c) {
    for (;;) {
      bool more = c.st == St::kSend ? send(c) : c.st == St::kHead ? head(c) : c.st == St::kPayload ? payload(c) : false;
      if (!more) return;
    }
  }

  bool send(C& c) {
    int e = c.iov.send_to(c.fd);
    if (e == EAGAIN) { c.wait = POLLOUT; return false; }
    if (e) return os_fail(c, e);
    c.st = St::kHead;
    return true;
  }

  // Receives at most `cap` more bytes of the frame (wire.h head_read) once the buffer can hold `need`.
  bool recv_more(C& c, size_t need, size_t cap) {
    if (c.b0 + need > c.buf.size()) {
      std::memmove(c.buf.data(), c.buf.data() + c.b0, c.b1 - c.b0);
      c.b1 -= c.b0;
      c.b0 = 0;
      if (need > c.buf.size()) c.buf.resize(need);
    }
    ssize_t got = ::recv(c.fd, c.buf.data() + c.b1, std::min(cap, c.buf.size() - c.b1), 0);
    if (got > 0) { c.b1 += size_t(got); c.got_bytes = true; return true; }
    if (got == 0) return closed(c, need - (c.b1 - c.b0));
    if (errno == EAGAIN || errno == EWOULDBLOCK) { c.wait = POLLIN; return false; }
    if (errno == EINTR) return true;
    return os_fail(c, errno);
  }

  bool head(C& c) {
    size_t have = c.b1 - c.b0;
    if (have < kPrefix) return recv_more(c, kPrefix, head_read(have, false, 0, 0, ~size_t(0)));
    uint32_t hlen;
    uint64_t plen;
    std::string err;
    if (!parse_prefix(&c.buf[c.b0], b_.max_frame, hlen, plen, err)) {
      if (std::memcmp(&c.buf[c.b0], "KVPA", 4) == 0) {
        static const char* kHex = "0123456789abcdef";
        std::string hex;
        for (size_t i = 0; i < kPrefix; ++i) { hex += kHex[c.buf[c.b0 + i] >> 4]; hex += kHex[c.buf[c.b0 + i] & 15]; }
        return broken(c, hex, false, kAuth);
      }
      return broken(c, "failed: ProtocolError: " + err, false);
    }
    if (have < kPrefix + hlen) return recv_more(c, kPrefix + hlen, head_read(have, true, hlen, plen, ~size_t(0)));
    const size_t f = c.frames[c.k];
    const size_t s = p_.starts[f], e = p_.starts[f + 1];
    std::vector<bool> ok;
    std::vector<std::string> errs;
    bool refused = false;
    if (!decode_response(&c.buf[c.b0 + kPrefix], hlen, c.rid, e - s, ok, errs, refused, err))
      return broken(c, refused ? err : "failed: ProtocolError: " + err, false);
    c.b0 += kPrefix + hlen;
    uint64_t want = 0;
    c.iov.reset();
    for (size_t i = s; i < e; ++i) {
      const Piece& pc = p_.pieces[i];
      if (!ok[i - s]) { mark(pc.span, kServer, "tcp peer answered: " + errs[i - s]); continue; }
      if (b_.op == kRead) { want += pc.e.length; c.iov.add(reinterpret_cast<void*>(pc.local), pc.e.length); }
    }
    if (plen != want)
      return broken(c, "failed: ProtocolError: response payload " + std::to_string(plen) + " bytes, expected " +
                           std::to_string(want), false);
    c.iov.take_from(c.buf.data(), c.b0, c.b1);
    c.st = St::kPayload;
    return true;
  }

  bool payload(C& c) {
    int e = c.iov.recv_from(c.fd);
    if (e == EAGAIN) { c.wait = POLLIN; return false; }
    if (e == IovCursor::kPeerClosed) return closed(c, c.iov.left());
    if (e) return os_fail(c, e);
    if (c.b0 != c.b1)
      return broken(c, "failed: ProtocolError: " + std::to_string(c.b1 - c.b0) + " unexpected bytes after a response", false);
    c.b0 = c.b1 = 0;
    if (++c.k == c.frames.size()) { c.st = St::kDone; return false; }
    start(c);
    return true;
  }

  bool closed(C& c, uint64_t left) {
    return broken(c, "failed: ConnectionError: peer closed the connection with " + std::to_string(left) +
                         " bytes still expected", true);
  }
  bool os_fail(C& c, int e) {
    return broken(c, std::string("failed: OSError: ") + std::strerror(e), e == ECONNRESET || e == EPIPE);
  }

  // The connection failed: every span of its current and later frames fails (first error wins).
  bool broken(C& c, const std::string& why, bool conn_gone, SpanCode code = kFailed) {
    const bool retry = conn_gone && c.reused && c.k == 0 && !c.got_bytes;
    for (size_t k = c.k; k < c.frames.size(); ++k) {
      const size_t f = c.frames[k];
      for (size_t i = p_.starts[f]; i < p_.starts[f + 1]; ++i) mark(p_.pieces[i].span, retry ? kRetry : code, why);
    }
    c.st = St::kBroken;
    return false;
  }

  void mark(size_t span, SpanCode code, const std::string& why) {
    std::lock_guard<std::mutex> g(mark_m_);        // a span cut into frames on two threads' connections
    if (r_.code[span] != kOk) return;
    r_.code[span] = code;
    r_.text[span] = why;
  }

  const Batch& b_;
  Result& r_;
  const Plan& p_;
  std::atomic<uint64_t>& ids_;
  double spin_until_ = 0;
  static inline std::mutex mark_m_;
};

// Connections per poll-loop thread: a big batch spreads its connections over threads, so the copies into
// and out of the socket (and, on loopback, the kernel's receive path run by the sender) use several cores.
constexpr uint64_t kThreadMin = 4ull << 20;
constexpr uint64_t kSpinMax = 256 << 10;     // batches up to this many bytes spin before sleeping
constexpr double kSpinS = 100e-6;

size_t loop_threads(uint64_t total, size_t conns) {
  if (total < kThreadMin || conns < 2) return 1;
  size_t cores = std::max(1u, std::thread::hardware_concurrency());
  return std::min({conns, cores, size_t(4)});
}

}  // namespace

Result transfer(const Batch& b, const std::vector<int>& fds, const std::vector<uint8_t>& reused,
                std::atomic<uint64_t>& ids) {
  if (fds.empty()) throw std::invalid_argument("tcp transfer: no connection given");
  Result r;
  r.code.assign(b.n, kOk);
  r.text.assign(b.n, std::string());
  r.broken.assign(fds.size(), 0);
  Plan p = plan(b, fds.size());
  std::vector<C> cs(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) {
    cs[i].fd = fds[i];
    cs[i].reused = reused[i] != 0;
    int fl = fcntl(fds[i], F_GETFL);
    if (!(fl & O_NONBLOCK)) fcntl(fds[i], F_SETFL, fl | O_NONBLOCK);
  }
  for (size_t f = 0; f + 1 < p.starts.size(); ++f) cs[f % cs.size()].frames.push_back(f);
  uint64_t total = 0;
  for (size_t j = 0; j < b.n; ++j) total += b.lens[j];
  const size_t nt = loop_threads(total, cs.size());
  if (nt == 1) {
    Run(b, r, p, ids).go(cs, total <= kSpinMax ? kSpinS : 0);
  } else {                        // thread t drives connections t, t+nt, ...
    std::vector<std::vector<C>> parts(nt);
    for (size_t i = 0; i < cs.size(); ++i) parts[i % nt].push_back(std::move(cs[i]));
    std::vector<std::thread> pool;
    for (size_t t = 1; t < nt; ++t) pool.emplace_back([&, t] { Run(b, r, p, ids).go(parts[t], 0); });
    Run(b, r, p, ids).go(parts[0], 0);
    for (auto& th : pool) th.join();
    for (size_t i = 0; i < cs.size(); ++i) cs[i] = std::move(parts[i % nt][i / nt]);
  }
  for (size_t i = 0; i < cs.size(); ++i) r.broken[i] = cs[i].st == St::kBroken;
  return r;
}

std::vector<double> loopback_baseline(uint64_t nbytes, int rounds) {
  int ls = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t al = sizeof a;
  if (ls < 0 || ::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a) || ::listen(ls, 1) ||
      ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &al)) {
    if (ls >= 0) ::close(ls);
    throw std::runtime_error(std::string("loopback baseline: ") + std::strerror(errno));
  }
  int cfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (::connect(cfd, reinterpret_cast<sockaddr*>(&a), sizeof a)) { ::close(ls); ::close(cfd); throw std::runtime_error("loopback connect failed"); }
  int sfd = ::accept(ls, nullptr, nullptr);
  ::close(ls);
  int one = 1;
  setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  std::vector<uint8_t> src(nbytes, 0x5a), dst(nbytes);
  std::vector<double> out;
  for (int r = 0; r < rounds; ++r) {
    double t0 = now_s();
    std::thread rx([&] {
      for (uint64_t got = 0; got < nbytes;) {
        ssize_t k = ::recv(sfd, dst.data() + got, nbytes - got, 0);
        if (k <= 0) return;
        got += uint64_t(k);
      }
    });
    for (uint64_t put = 0; put < nbytes;) {
      ssize_t k = ::send(cfd, src.data() + put, nbytes - put, MSG_NOSIGNAL);
      if (k <= 0) break;
      put += uint64_t(k);
    }
    rx.join();
    out.push_back(now_s() - t0);
  }
  ::close(cfd);
  ::close(sfd);
  return out;
}

}  // namespace kvp::tcp
