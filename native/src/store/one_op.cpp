#include "one_op.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <vector>

#include "../tcp/mp.h"
#include "kvp_copy.h"

namespace kvp::store {
namespace {

constexpr uint64_t kVersion = 1;               // store/wire/protocol.py VERSION
constexpr uint64_t kOk = 0, kNotFound = 1, kExists = 3;   // per-entry codes
constexpr uint32_t kMaxReply = 64u << 20;      // a one-key get answer is a few hundred bytes

using Clock = std::chrono::steady_clock;

double ms_left(Clock::time_point deadline) {
  return std::chrono::duration<double, std::milli>(deadline - Clock::now()).count();
}

// Waits for `events` on fd until the deadline: 1 ready, 0 timed out, -1 error (errno).
int wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    double left = ms_left(deadline);
    if (left <= 0) return 0;
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, int(left) + 1);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return r;
    return 1;
  }
}

OpResult io_fail(int status, std::string what) { return {status, 0, std::move(what)}; }

bool send_all(int fd, const std::string& out, Clock::time_point deadline, OpResult& fail) {
  size_t sent = 0;
  while (sent < out.size()) {
    ssize_t k = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) { sent += size_t(k); continue; }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      fail = io_fail(kIoError, std::string("send: ") + std::strerror(errno));
      return false;
    }
    int w = wait_fd(fd, POLLOUT, deadline);
    if (w <= 0) {
      fail = w == 0 ? io_fail(kTimeout, "send timed out") : io_fail(kIoError, std::string("poll: ") + std::strerror(errno));
      return false;
    }
  }
  return true;
}

// Reads one frame (4-byte big-endian length, then the body) into `body`. Bytes past that frame are a protocol
// error: nothing else is in flight on this connection.
bool recv_frame(int fd, std::string& body, Clock::time_point deadline, OpResult& fail) {
  std::vector<uint8_t> buf(4096);
  size_t have = 0, want = 4;
  bool sized = false;
  for (;;) {
    if (!sized && have >= 4) {
      uint32_t n = (uint32_t(buf[0]) << 24) | (uint32_t(buf[1]) << 16) | (uint32_t(buf[2]) << 8) | buf[3];
      if (n > kMaxReply) { fail = io_fail(kIoError, "reply frame of " + std::to_string(n) + " bytes"); return false; }
      want = 4 + size_t(n);
      sized = true;
      if (buf.size() < want) buf.resize(want);
    }
    if (sized && have >= want) break;
    ssize_t k = ::recv(fd, buf.data() + have, buf.size() - have, MSG_DONTWAIT);
    if (k > 0) { have += size_t(k); continue; }
    if (k == 0) { fail = io_fail(kIoError, "master closed the connection"); return false; }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      fail = io_fail(kIoError, std::string("recv: ") + std::strerror(errno));
      return false;
    }
    int w = wait_fd(fd, POLLIN, deadline);
    if (w <= 0) {
      fail = w == 0 ? io_fail(kTimeout, "no reply in time") : io_fail(kIoError, std::string("poll: ") + std::strerror(errno));
      return false;
    }
  }
  if (have != want) { fail = io_fail(kIoError, "bytes past the reply frame"); return false; }
  body.assign(reinterpret_cast<const char*>(buf.data()) + 4, want - 4);
  return true;
}

bool alive(int pidfd) {
  if (pidfd < 0) return true;   // no pidfd on this kernel: the Python path checked /proc when it mapped
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

// The fields of a one-key `get` answer the native read needs.
struct Answer {
  uint64_t code = 0, size = 0, region = 0, offset = 0, ttl_ms = 0, checksum = 0;
  bool has_checksum = false;
  std::string_view segment;
};

// Reads [1, rid, true, [[code, ...: the header of a one-entry answer, up to its code.
bool entry_code(tcp::MpReader& r, uint64_t rid, uint64_t& code) {
  uint32_t n;
  uint64_t v;
  bool ok;
  return r.array(n, "reply") && n == 4 && r.uint(v, "version") && v == kVersion && r.uint(v, "id") && v == rid &&
         r.boolean(ok, "ok") && ok && r.array(n, "entries") && n == 1 && r.array(n, "entry") && n == 2 &&
         r.uint(code, "code");
}

// [1, rid, true, [[code, value]]]; value of an OK entry: [size, [[segment, region, offset], ...], ttl, xxh3|nil].
// false: anything else (the Python client parses it and raises or goes on).
bool parse(const std::string& body, uint64_t rid, Answer& a) {
  tcp::MpReader r(reinterpret_cast<const uint8_t*>(body.data()), body.size());
  if (!entry_code(r, rid, a.code)) return false;
  if (a.code != kOk) return true;
  uint32_t fields, replicas, loc;
  if (!r.array(fields, "value") || fields < 3 || fields > 4 || !r.uint(a.size, "size") ||
      !r.array(replicas, "replicas") || replicas < 1 || !r.array(loc, "location") || loc != 3 ||
      !r.str(a.segment, "segment") || !r.uint(a.region, "region") || !r.uint(a.offset, "offset"))
    return false;
  for (uint32_t i = 1; i < replicas; ++i)
    if (!r.skip("replica")) return false;
  if (!r.uint(a.ttl_ms, "lease")) return false;
  if (fields == 4 && !r.is_nil()) {
    if (!r.uint(a.checksum, "checksum")) return false;
    a.has_checksum = true;
  }
  return r.done() && a.region <= UINT32_MAX;
}

// A request frame: the 4-byte length, then [1, rid, op, ...] with the entries and opts `body` writes.
template <class Body>
std::string request(uint64_t rid, const char* op, Body body) {
  std::string out(4, '\0');
  tcp::MpWriter w(out);
  w.array(5);
  w.uint(kVersion);
  w.uint(rid);
  w.str(op);
  body(w);
  const uint32_t n = uint32_t(out.size() - 4);
  for (int i = 0; i < 4; ++i) out[i] = char((n >> (8 * (3 - i))) & 0xff);
  return out;
}

bool roundtrip(int fd, const std::string& frame, Clock::time_point deadline, OpResult& res) {
  return send_all(fd, frame, deadline, res) && recv_frame(fd, res.text, deadline, res);
}

// Copies the object at `src` into the local spans; true when its bytes check out.
bool read_into(uint64_t src, const uint64_t* addrs, const uint64_t* lens, size_t n, const Answer& a, bool verify,
               const HashOps* ops) {
  const bool check = verify && a.has_checksum;
  if (n == 1 && check)
    return ops->copy_hash(reinterpret_cast<char*>(addrs[0]), reinterpret_cast<const char*>(src), lens[0]) == a.checksum;
  std::vector<uint64_t> from(n);
  for (size_t j = 0, off = 0; j < n; off += lens[j], ++j) from[j] = src + off;
  kvp::copy_batch(addrs, from.data(), lens, n, 1);
  return !check || ops->hash_spans(addrs, lens, n) == a.checksum;
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

OpResult get_one(int fd, uint64_t rid, const std::string& key, const uint64_t* addrs, const uint64_t* lens,
                  size_t n, double timeout_ms, ShmMaps& maps, bool verify, const HashOps* ops) {
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::microseconds(int64_t(timeout_ms * 1000));
  OpResult res{kAsPython};
  const std::string frame = request(rid, "get", [&](tcp::MpWriter& w) { w.array(1); w.str(key); w.map(0); });
  if (!roundtrip(fd, frame, deadline, res)) return res;
  Answer a;
  if (!parse(res.text, rid, a)) return res;
  if (a.code == kNotFound) return {kMiss};
  if (a.code != kOk || a.size == 0) return res;
  uint64_t total = 0;
  for (size_t j = 0; j < n; ++j) total += lens[j];
  if (total != a.size) return res;   // SizeMismatch: the Python client names it
  std::shared_lock l(maps.mutex());
  const ShmMaps::Mapping* m = maps.find(a.segment, uint32_t(a.region));
  if (m == nullptr || a.offset > m->length || a.size > m->length - a.offset || !alive(m->pidfd)) return res;
  const bool good = read_into(m->base + a.offset, addrs, lens, n, a, verify, ops);
  const auto lease_end = t0 + std::chrono::milliseconds(a.ttl_ms);
  if (!good || !alive(m->pidfd) || Clock::now() > lease_end) return res;   // the Python client reads again
  maps.count(a.size);
  return {kDone, a.size};
}

OpResult put_one(int fd, uint64_t rid, const std::string& key, const uint64_t* addrs, const uint64_t* lens,
                 size_t n, const std::string& segment, uint32_t region, uint64_t offset, uint64_t slab,
                 double write_ms, double timeout_ms, ShmMaps& maps, const HashOps* ops) {
  const auto t0 = Clock::now();
  uint64_t size = 0, digest = 0;
  for (size_t j = 0; j < n; ++j) size += lens[j];
  {
    std::shared_lock l(maps.mutex());
    const ShmMaps::Mapping* m = maps.find(segment, region);
    if (write_ms <= 0 || size == 0 || m == nullptr || offset > m->length || size > m->length - offset || !alive(m->pidfd))
      return {kNotSent};
    if (n == 1) {
      digest = ops->copy_hash(reinterpret_cast<char*>(m->base + offset), reinterpret_cast<const char*>(addrs[0]), size);
    } else {
      std::vector<uint64_t> to(n);
      for (size_t j = 0, off = 0; j < n; off += lens[j], ++j) to[j] = m->base + offset + off;
      kvp::copy_batch(to.data(), addrs, lens, n, 1);
      digest = ops->hash_spans(addrs, lens, n);
    }
    maps.count(size);
  }
  OpResult res{kAsPython};
  const std::string frame = request(rid, "put", [&](tcp::MpWriter& w) {
    w.array(1);
    w.array(4);
    w.str(key);
    w.uint(size);
    w.uint(slab);
    w.uint(offset);
    w.map(1);
    w.str("xxh3");
    w.array(1);
    w.uint(digest);
  });
  if (!roundtrip(fd, frame, t0 + std::chrono::microseconds(int64_t(timeout_ms * 1000)), res)) return res;
  tcp::MpReader r(reinterpret_cast<const uint8_t*>(res.text.data()), res.text.size());
  uint64_t code;
  if (entry_code(r, rid, code) && (code == kOk || code == kExists) && r.skip("value") && r.done()) return {kDone, code};
  return res;
}

}  // namespace kvp::store
