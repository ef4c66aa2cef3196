#include "peers.h"

#include <sys/socket.h>
#include <unistd.h>

namespace kvp::tcp {

Peers::~Peers() {
  for (int fd : clear()) ::close(fd);
}

int Peers::take(const std::string& peer) {
  std::lock_guard l(mu_);
  auto it = idle_.find(peer);
  if (it == idle_.end() || it->second.empty()) return -1;
  const int fd = it->second.back();
  it->second.pop_back();
  return fd;
}

bool Peers::give(const std::string& peer, int fd) {
  std::lock_guard l(mu_);
  auto& idle = idle_[peer];
  if (idle.size() >= per_peer_) return false;
  idle.push_back(fd);
  return true;
}

std::vector<int> Peers::drop(const std::string& peer) {
  std::lock_guard l(mu_);
  auto it = idle_.find(peer);
  if (it == idle_.end()) return {};
  std::vector<int> out = std::move(it->second);
  idle_.erase(it);
  return out;
}

std::vector<int> Peers::clear() {
  std::lock_guard l(mu_);
  std::vector<int> out;
  for (auto& [peer, fds] : idle_) out.insert(out.end(), fds.begin(), fds.end());
  idle_.clear();
  routes_.clear();
  return out;
}

void Peers::route(const std::string& name, uint32_t region, uint64_t length, const std::string& peer,
                  uint64_t limit) {
  std::lock_guard l(mu_);
  routes_[{name, region}] = Route{peer, length, limit};
}

void Peers::unroute(const std::string& name) {
  std::lock_guard l(mu_);
  for (auto it = routes_.lower_bound(std::make_pair(name, uint32_t(0))); it != routes_.end() && it->first.first == name;)
    it = routes_.erase(it);
}

std::optional<Peers::Route> Peers::find(std::string_view name, uint32_t region) const {
  std::lock_guard l(mu_);
  auto it = routes_.find(std::make_pair(std::string(name), region));
  if (it == routes_.end()) return std::nullopt;
  return it->second;
}

void abort_fd(int fd) {
  linger lg{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  ::close(fd);
}

}  // namespace kvp::tcp
