// The TCP transport's idle connections, per peer, and the peer regions a store client reads over them in one
// native call (issue #35). Python (kvplugins/transfer/tcp.py) connects and authenticates every connection and
// lends the idle ones here (give); a transport batch or a native store get takes one (take) and gives it back
// unless it broke (then it is closed with a reset). Routes name, per (segment as the master calls it, region),
// the peer serving it over TCP, the region's length and the frame payload limit; the store client adds them
// once the transfer engine's first transport for that region is TCP. Never connects: no idle connection, no
// native read (the caller's Python path connects).
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvp::tcp {

class Peers {
 public:
  Peers(size_t per_peer, uint64_t max_frame) : per_peer_(per_peer), max_frame_(max_frame) {}
  Peers(const Peers&) = delete;
  Peers& operator=(const Peers&) = delete;
  ~Peers();

  int take(const std::string& peer);              // an idle connection's fd (the caller owns it), or -1
  bool give(const std::string& peer, int fd);     // false: the pool is full, the caller closes fd
  std::vector<int> drop(const std::string& peer); // the idle fds of `peer`, removed (the caller closes them)
  std::vector<int> clear();                       // every idle fd, and every route, removed

  struct Route { std::string peer; uint64_t length, limit; };
  void route(const std::string& name, uint32_t region, uint64_t length, const std::string& peer, uint64_t limit);
  void unroute(const std::string& name);          // every region of segment `name`
  std::optional<Route> find(std::string_view name, uint32_t region) const;

  uint64_t max_frame() const { return max_frame_; }
  std::atomic<uint64_t>& ids() { return ids_; }   // frame request ids of native batches
  void count(uint64_t nbytes) { entries_ += 1; bytes_ += nbytes; }
  uint64_t entries() const { return entries_.load(); }   // objects read natively, and their bytes
  uint64_t bytes() const { return bytes_.load(); }

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::vector<int>, std::less<>> idle_;
  std::map<std::pair<std::string, uint32_t>, Route, std::less<>> routes_;
  const size_t per_peer_;
  const uint64_t max_frame_;
  std::atomic<uint64_t> ids_{1 << 30}, entries_{0}, bytes_{0};
};

// Closes a connection that failed mid-batch with a reset (SO_LINGER 0): bytes not sent yet are dropped, not
// delivered once the peer wakes up (transfer/tcp.py _abort).
void abort_fd(int fd);

}  // namespace kvp::tcp
