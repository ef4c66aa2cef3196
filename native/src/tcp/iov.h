// A cursor over a list of (address, length) buffers for readv/sendmsg: at most kIovMax buffers per call,
// partial progress advanced in place.
#pragma once
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvp::tcp {

constexpr size_t kIovMax = 1024;

class IovCursor {
 public:
  void reset() { v_.clear(); i_ = 0; }
  void add(const void* p, uint64_t n) {
    if (n) v_.push_back({const_cast<void*>(p), size_t(n)});
  }
  bool done() const { return i_ == v_.size(); }
  iovec* vec() { return v_.data() + i_; }
  int count() const { return int(std::min(kIovMax, v_.size() - i_)); }
  uint64_t left() const {
    uint64_t t = 0;
    for (size_t j = i_; j < v_.size(); ++j) t += v_[j].iov_len;
    return t;
  }
  void advance(size_t n) {
    while (n && i_ < v_.size()) {
      iovec& e = v_[i_];
      if (n >= e.iov_len) { n -= e.iov_len; ++i_; continue; }
      e.iov_base = static_cast<char*>(e.iov_base) + n;
      e.iov_len -= n;
      n = 0;
    }
  }
  // sendmsg until every buffer is sent: 0 when done, EAGAIN when the socket would block, else the errno.
  int send_to(int fd) {
    while (!done()) {
      msghdr mh{};
      mh.msg_iov = vec();
      mh.msg_iovlen = count();
      ssize_t put = ::sendmsg(fd, &mh, MSG_NOSIGNAL);
      if (put > 0) { advance(size_t(put)); continue; }
      if (put < 0 && errno == EINTR) continue;
      return put < 0 ? (errno == EWOULDBLOCK ? EAGAIN : errno) : EPIPE;
    }
    return 0;
  }
  // readv until every buffer is full: 0 when done, EAGAIN when the socket would block, kPeerClosed, else errno.
  // With `land_by` (unix ms, from `clock`): kLate, before any readv once clock() is past it.
  static constexpr int kPeerClosed = -1, kLate = -2;
  int recv_from(int fd, uint64_t land_by = 0, uint64_t (*clock)() = nullptr) {
    while (!done()) {
      if (land_by && clock() > land_by) return kLate;
      ssize_t got = ::readv(fd, vec(), count());
      if (got > 0) { advance(size_t(got)); continue; }
      if (got == 0) return kPeerClosed;
      if (errno == EINTR) continue;
      return errno == EWOULDBLOCK ? EAGAIN : errno;
    }
    return 0;
  }
  // The bytes still expected land in `scratch` (`cap` bytes, reused) instead of where they were going.
  void redirect(void* scratch, size_t cap) {
    uint64_t rest = left();
    v_.clear();
    i_ = 0;
    for (; rest; rest -= std::min<uint64_t>(rest, cap)) add(scratch, std::min<uint64_t>(rest, cap));
  }
  // Fill from already-buffered bytes buf[b0, b1) (advances b0).
  void take_from(const uint8_t* buf, size_t& b0, size_t b1) {
    while (b0 < b1 && !done()) {
      iovec& e = v_[i_];
      size_t k = std::min(e.iov_len, b1 - b0);
      std::memcpy(e.iov_base, buf + b0, k);
      b0 += k;
      advance(k);
    }
  }

 private:
  std::vector<iovec> v_;
  size_t i_ = 0;
};

}  // namespace kvp::tcp
