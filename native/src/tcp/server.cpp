#include "server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "iov.h"
#include "wire.h"

namespace kvp::tcp {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t unix_ms() {
  return uint64_t(std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch()).count());
}

// The status of every entry of a write frame that reached this server after its "dl" (the writer's grant of
// the space ended then: the store may have given it to another object). Python matches the prefix
// (kvplugins/transfer/wire.py LATE_WRITE).
std::string late_text(uint64_t land_by, uint64_t now) {
  return "late write: its bytes reached this peer " + std::to_string(now - land_by) +
         " ms after their deadline (unix ms " + std::to_string(land_by) +
         " by this host's clock); none of this frame counts as written: the space may be another object's by now";
}

constexpr uint64_t kNotStaged = ~uint64_t(0);
constexpr int kHostToDevice = 1, kDeviceToHost = 2;

enum class Phase { kHead, kPayload, kSend };
enum class Step { kMore, kWaitIn, kWaitOut, kClose };

}  // namespace

struct Conn {
  int fd;
  uint64_t id;
  std::vector<uint8_t> buf = std::vector<uint8_t>(64 << 10);
  size_t b0 = 0, b1 = 0;
  Phase phase = Phase::kHead;
  double frame_start = 0, last = now_s();
  uint32_t mask = EPOLLIN;
  // the request being served
  int op = 0;
  uint64_t rid = 0, land_by = 0;            // land_by: a write's "dl" (unix ms), 0 = none
  std::vector<WireEntry> entries;
  std::vector<std::shared_ptr<Region>> pins;
  IovCursor iov;
  std::string out;
  std::vector<uint8_t> scratch;
  std::vector<uint8_t> stage;               // a frame's bytes of device regions, staged through host memory
  std::vector<uint64_t> stage_at;           // per entry: its offset in stage, kNotStaged for host memory
  std::vector<bool> ok;
  std::vector<std::string> errs;
  EventKind kind = EventKind::kClosed;
  std::string reason;
  ~Conn() { if (fd >= 0) ::close(fd); }
};

class Worker {
 public:
  Worker(Server& s) : s_(s) {
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    wake_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (ep_ < 0 || wake_ < 0) throw std::runtime_error(std::string("epoll/eventfd: ") + std::strerror(errno));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = 0;
    epoll_ctl(ep_, EPOLL_CTL_ADD, wake_, &ev);
    th_ = std::thread([this] { loop(); });
  }
  ~Worker() { stop(); ::close(ep_); ::close(wake_); }

  void add(std::unique_ptr<Conn> c) {
    { std::lock_guard<std::mutex> g(m_); pending_.push_back(std::move(c)); }
    ring();
  }
  void stop() {
    if (!th_.joinable()) return;
    stop_ = true;
    ring();
    th_.join();
  }

 private:
  void ring() { uint64_t one = 1; (void)!::write(wake_, &one, sizeof one); }
  void loop();
  void take_pending();
  void drive(Conn& c);
  Step step(Conn& c);
  Step head(Conn& c);
  Step payload(Conn& c);
  void late(Conn& c, uint64_t now);
  Step send(Conn& c);
  void start_data(Conn& c, const uint8_t* h, uint32_t hlen);
  uint64_t stage_plan(Conn& c);
  uint64_t stage_reads(Conn& c);
  void unstage_writes(Conn& c);
  void* span_at(Conn& c, size_t i);
  void respond(Conn& c, uint64_t payload);
  void scan(double now);
  void finish(Conn& c) { close_conn(c.fd); }
  void close_conn(int fd);
  Step fail(Conn& c, EventKind k, std::string why) { c.kind = k; c.reason = std::move(why); return Step::kClose; }

  Server& s_;
  int ep_ = -1, wake_ = -1;
  std::mutex m_;
  std::vector<std::unique_ptr<Conn>> pending_;
  std::unordered_map<int, std::unique_ptr<Conn>> conns_;
  std::atomic<bool> stop_{false};
  double last_scan_ = 0;
  std::thread th_;
};

void Worker::loop() {
  epoll_event evs[64];
  while (!stop_) {
    int n = epoll_wait(ep_, evs, 64, 100);
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.u64 == 0) {
        uint64_t v;
        (void)!::read(wake_, &v, sizeof v);
        take_pending();
        continue;
      }
      auto it = conns_.find(int(evs[i].data.u64 >> 32));
      if (it != conns_.end() && uint32_t(evs[i].data.u64) == uint32_t(it->second->id)) drive(*it->second);
    }
    double now = now_s();
    if (now - last_scan_ > 0.05) { scan(now); last_scan_ = now; }
  }
  std::vector<int> fds;
  for (auto& kv : conns_) fds.push_back(kv.first);
  for (int fd : fds) close_conn(fd);
  take_pending();
  fds.clear();
  for (auto& kv : conns_) fds.push_back(kv.first);
  for (int fd : fds) close_conn(fd);
}

void Worker::take_pending() {
  std::vector<std::unique_ptr<Conn>> got;
  { std::lock_guard<std::mutex> g(m_); got.swap(pending_); }
  for (auto& c : got) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = (uint64_t(uint32_t(c->fd)) << 32) | uint32_t(c->id);
    if (epoll_ctl(ep_, EPOLL_CTL_ADD, c->fd, &ev) != 0) {
      s_.emit({c->id, EventKind::kError, std::string("epoll_ctl: ") + std::strerror(errno)});
      continue;
    }
    int fd = c->fd;
    conns_[fd] = std::move(c);
    drive(*conns_[fd]);           // bytes may already be waiting
  }
}

void Worker::drive(Conn& c) {
  Step st;
  do st = step(c); while (st == Step::kMore);
  if (st == Step::kClose) { close_conn(c.fd); return; }
  uint32_t want = st == Step::kWaitOut ? EPOLLOUT : EPOLLIN;
  if (want != c.mask) {
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = (uint64_t(uint32_t(c.fd)) << 32) | uint32_t(c.id);
    epoll_ctl(ep_, EPOLL_CTL_MOD, c.fd, &ev);
    c.mask = want;
  }
}

Step Worker::step(Conn& c) {
  switch (c.phase) {
    case Phase::kHead: return head(c);
    case Phase::kPayload: return payload(c);
    default: return send(c);
  }
}

Step Worker::head(Conn& c) {
  size_t have = c.b1 - c.b0;
  uint32_t hlen = 0;
  uint64_t plen = 0;
  if (have >= kPrefix) {
    std::string err;
    if (!parse_prefix(&c.buf[c.b0], s_.cfg.max_frame, hlen, plen, err)) return fail(c, EventKind::kProtocol, err);
    if (have >= kPrefix + hlen) {
      if (c.frame_start == 0) c.frame_start = now_s();
      const uint8_t* h = &c.buf[c.b0 + kPrefix];
      int op = 0;
      uint64_t id = 0;
      Decoded d = decode_request(h, hlen, plen, s_.cfg.max_frame, op, id, c.entries, c.land_by, err);
      if (d == Decoded::kError) return fail(c, EventKind::kProtocol, err);
      if (d == Decoded::kControl) {
        try {
          c.out = s_.control(c.id, std::string(reinterpret_cast<const char*>(h), hlen), plen);
        } catch (const std::exception& e) {
          return fail(c, EventKind::kProtocol, e.what());
        }
        c.b0 += kPrefix + hlen;
        c.iov.reset();
        c.iov.add(c.out.data(), c.out.size());
        c.phase = Phase::kSend;
        return Step::kMore;
      }
      c.op = op;
      c.rid = id;
      c.b0 += kPrefix + hlen;
      start_data(c, h, hlen);
      return Step::kMore;
    }
  }
  // need more bytes: compact / grow, then receive
  size_t need = have >= kPrefix ? kPrefix + hlen : kPrefix;
  if (c.b0 + need > c.buf.size()) {
    std::memmove(c.buf.data(), c.buf.data() + c.b0, have);
    c.b0 = 0;
    c.b1 = have;
    if (need > c.buf.size()) c.buf.resize(need);
  }
  const size_t room = c.buf.size() - c.b1;
  ssize_t got = ::recv(c.fd, c.buf.data() + c.b1, head_read(have, have >= kPrefix, hlen, plen, room), 0);
  if (got > 0) {
    if (c.frame_start == 0) c.frame_start = now_s();
    c.b1 += size_t(got);
    return Step::kMore;
  }
  if (got == 0) {
    if (have == 0) return fail(c, EventKind::kClosed, "");
    return fail(c, EventKind::kError, "peer closed the connection with " + std::to_string(need - have) +
                                          " bytes still expected");
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK) return Step::kWaitIn;
  if (errno == EINTR) return Step::kMore;
  return fail(c, EventKind::kError, std::strerror(errno));
}

void Worker::start_data(Conn& c, const uint8_t*, uint32_t) {
  const size_t n = c.entries.size();
  c.pins.assign(n, nullptr);
  c.ok.assign(n, true);
  c.errs.assign(n, std::string());
  c.iov.reset();
  uint64_t scratch = 0, served = 0;
  for (size_t i = 0; i < n; ++i) {
    const WireEntry& e = c.entries[i];
    auto r = s_.region(uint32_t(e.region));
    if (!r) {
      c.ok[i] = false;
      c.errs[i] = "region " + std::to_string(e.region) + " is not exported by this engine";
    } else if (c.op == kWrite && r->readonly) {
      c.ok[i] = false;
      c.errs[i] = "region " + std::to_string(e.region) + " is read-only memory; peers may only read it";
    } else if (e.offset > r->length || e.length > r->length - e.offset) {
      c.ok[i] = false;
      c.errs[i] = "remote region " + std::to_string(e.region) + " (length " + std::to_string(r->length) +
                  "): offset " + std::to_string(e.offset) + " + length " + std::to_string(e.length) + " is outside it";
    } else {
      c.pins[i] = std::move(r);
      served += e.length;
      continue;
    }
    scratch += e.length;
  }
  stage_plan(c);
  if (c.op == kWrite) {           // a rejected entry's bytes land in scratch (bounded by max_frame)
    c.scratch.resize(std::min<uint64_t>(scratch, 1 << 20));
    for (size_t i = 0; i < n; ++i) {
      const WireEntry& e = c.entries[i];
      if (c.ok[i]) { c.iov.add(span_at(c, i), e.length); continue; }
      for (uint64_t left = e.length; left;) {        // reuse one bounded scratch buffer for discarded bytes
        uint64_t k = std::min<uint64_t>(left, c.scratch.size());
        c.iov.add(c.scratch.data(), k);
        left -= k;
      }
    }
    if (c.land_by && unix_ms() > c.land_by) late(c, unix_ms());
    c.iov.take_from(c.buf.data(), c.b0, c.b1);
    if (c.b0 == c.b1) c.b0 = c.b1 = 0;
    c.phase = Phase::kPayload;
    return;
  }
  served -= stage_reads(c);
  respond(c, served);
  for (size_t i = 0; i < n; ++i)
    if (c.ok[i]) c.iov.add(span_at(c, i), c.entries[i].length);
}

// Where each accepted entry in device memory sits in c.stage (sized to their sum: at most max_frame, as the
// frame's payload or its read reply is).
uint64_t Worker::stage_plan(Conn& c) {
  const size_t n = c.entries.size();
  c.stage_at.assign(n, kNotStaged);
  uint64_t at = 0;
  for (size_t i = 0; i < n; ++i)
    if (c.ok[i] && c.pins[i]->device.on()) { c.stage_at[i] = at; at += c.entries[i].length; }
  if (at > c.stage.size()) c.stage.resize(at);
  return at;
}

void* Worker::span_at(Conn& c, size_t i) {
  if (c.stage_at[i] != kNotStaged) return c.stage.data() + c.stage_at[i];
  return reinterpret_cast<void*>(c.pins[i]->addr + c.entries[i].offset);
}

// A read's device entries copied to the host stage before the reply; one that fails answers its error and
// sends no bytes. Returns the bytes no longer served.
uint64_t Worker::stage_reads(Conn& c) {
  uint64_t dropped = 0;
  for (size_t i = 0; i < c.entries.size(); ++i) {
    if (c.stage_at[i] == kNotStaged) continue;
    const WireEntry& e = c.entries[i];
    const Region& r = *c.pins[i];
    std::string err = r.device.copy(c.stage.data() + c.stage_at[i], reinterpret_cast<void*>(r.addr + e.offset),
                                     e.length, kDeviceToHost);
    if (err.empty()) { s_.staged_bytes_ += e.length; continue; }
    c.ok[i] = false;
    c.errs[i] = "region " + std::to_string(e.region) + " (device memory): " + err;
    c.stage_at[i] = kNotStaged;
    dropped += e.length;
  }
  return dropped;
}

// A write's device entries copied from the host stage once the whole payload is in (entries a late frame
// rejected are not copied).
void Worker::unstage_writes(Conn& c) {
  for (size_t i = 0; i < c.entries.size(); ++i) {
    if (c.stage_at[i] == kNotStaged || !c.ok[i]) continue;
    const WireEntry& e = c.entries[i];
    const Region& r = *c.pins[i];
    std::string err = r.device.copy(reinterpret_cast<void*>(r.addr + e.offset), c.stage.data() + c.stage_at[i],
                                    e.length, kHostToDevice);
    if (err.empty()) { s_.staged_bytes_ += e.length; continue; }
    c.ok[i] = false;
    c.errs[i] = "region " + std::to_string(e.region) + " (device memory): " + err;
  }
}

void Worker::respond(Conn& c, uint64_t payload) {
  encode_response(c.out, c.rid, c.errs, c.ok, payload);
  c.iov.reset();
  c.iov.add(c.out.data(), c.out.size());
  c.phase = Phase::kSend;
}

// The write frame's deadline passed (this worker was stalled, or the bytes were): the rest of its payload is
// read into scratch and every entry answers late_text, also those that landed in time (the writer puts again).
void Worker::late(Conn& c, uint64_t now) {
  const uint64_t land_by = c.land_by;
  c.land_by = 0;                  // decided once: the rest of this frame goes to scratch
  c.ok.assign(c.entries.size(), false);
  c.errs.assign(c.entries.size(), late_text(land_by, now));
  const uint64_t rest = c.iov.left();
  if (!rest) return;
  if (c.scratch.size() < std::min<uint64_t>(rest, 1 << 20)) c.scratch.resize(std::min<uint64_t>(rest, 1 << 20));
  c.iov.redirect(c.scratch.data(), c.scratch.size());
}

Step Worker::payload(Conn& c) {
  int e = c.iov.recv_from(c.fd, c.land_by, unix_ms);
  if (e == IovCursor::kLate) {
    late(c, unix_ms());
    return Step::kMore;
  }
  if (e == EAGAIN) return Step::kWaitIn;
  if (e == IovCursor::kPeerClosed)
    return fail(c, EventKind::kError, "peer closed the connection with " + std::to_string(c.iov.left()) +
                                          " payload bytes still expected");
  if (e) return fail(c, EventKind::kError, std::strerror(e));
  unstage_writes(c);
  respond(c, 0);
  return Step::kMore;
}

Step Worker::send(Conn& c) {
  int e = c.iov.send_to(c.fd);
  if (e == EAGAIN) return Step::kWaitOut;
  if (e) return fail(c, EventKind::kError, std::strerror(e));
  c.pins.clear();                 // the frame is served: drop the region pins
  c.entries.clear();
  c.phase = Phase::kHead;
  c.frame_start = 0;
  c.last = now_s();
  return Step::kMore;
}

void Worker::scan(double now) {
  std::vector<int> slow, idle;
  for (auto& kv : conns_) {
    Conn& c = *kv.second;
    if (c.frame_start > 0 && now - c.frame_start > s_.cfg.frame_timeout_s) slow.push_back(kv.first);
    else if (c.frame_start == 0 && s_.cfg.idle_timeout_s > 0 && now - c.last > s_.cfg.idle_timeout_s) idle.push_back(kv.first);
  }
  for (int fd : slow) {
    Conn& c = *conns_[fd];
    c.kind = EventKind::kSlow;
    s_.closed_slow_++;
    close_conn(fd);
  }
  for (int fd : idle) {
    Conn& c = *conns_[fd];
    c.kind = EventKind::kIdle;
    s_.closed_idle_++;
    close_conn(fd);
  }
}

void Worker::close_conn(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  std::unique_ptr<Conn> c = std::move(it->second);
  conns_.erase(it);
  epoll_ctl(ep_, EPOLL_CTL_DEL, fd, nullptr);
  s_.emit({c->id, c->kind, c->reason});
}

Server::Server(const ServerConfig& c, ControlFn ctl) : cfg(c), control(std::move(ctl)) {
  for (int i = 0; i < std::max(1, c.threads); ++i) workers_.push_back(std::make_unique<Worker>(*this));
}

Server::~Server() { close(); }

std::string DeviceCopy::copy(void* dst, const void* src, uint64_t n, int kind) const {
  using SetDevice = int (*)(int);
  using Memcpy = int (*)(void*, const void*, size_t, int);
  int rc = set_device_fn ? reinterpret_cast<SetDevice>(set_device_fn)(index) : 0;
  if (rc != 0) return "setting device " + std::to_string(index) + " failed (error " + std::to_string(rc) + ")";
  rc = reinterpret_cast<Memcpy>(memcpy_fn)(dst, src, size_t(n), kind);
  if (rc != 0)
    return std::string(kind == kHostToDevice ? "host to device" : "device to host") + " copy of " +
           std::to_string(n) + " bytes failed (error " + std::to_string(rc) + ")";
  return "";
}

void Server::add_region(uint32_t id, uint64_t addr, uint64_t length, bool readonly, void* pin, DeviceCopy device) {
  auto r = std::shared_ptr<Region>(new Region{addr, length, readonly, pin, grave_, device});
  std::unique_lock<std::shared_mutex> g(regions_m_);
  regions_[id] = std::move(r);
}

void Server::remove_region(uint32_t id) {
  std::shared_ptr<Region> gone;
  std::unique_lock<std::shared_mutex> g(regions_m_);
  auto it = regions_.find(id);
  if (it != regions_.end()) { gone = std::move(it->second); regions_.erase(it); }
}

std::shared_ptr<Region> Server::region(uint32_t id) {
  std::shared_lock<std::shared_mutex> g(regions_m_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

uint64_t Server::adopt(int fd) {
  if (closed_) { ::close(fd); throw std::runtime_error("the transfer server is closed"); }
  int fl = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  c->id = next_conn_++;
  uint64_t id = c->id;
  workers_[id % workers_.size()]->add(std::move(c));
  return id;
}

void Server::emit(Event e) {
  { std::lock_guard<std::mutex> g(ev_m_); events_.push_back(std::move(e)); }
  ev_cv_.notify_all();
}

std::vector<Event> Server::wait_events(double timeout_s) {
  std::unique_lock<std::mutex> g(ev_m_);
  ev_cv_.wait_for(g, std::chrono::duration<double>(timeout_s), [this] { return !events_.empty() || closed_; });
  std::vector<Event> out;
  out.swap(events_);
  return out;
}

std::vector<void*> Server::take_released() {
  std::lock_guard<std::mutex> g(grave_->m);
  std::vector<void*> out;
  out.swap(grave_->pins);
  return out;
}

void Server::close() {
  if (closed_.exchange(true)) return;
  for (auto& w : workers_) w->stop();
  workers_.clear();
  { std::unique_lock<std::shared_mutex> g(regions_m_); regions_.clear(); }
  ev_cv_.notify_all();
}

}  // namespace kvp::tcp
