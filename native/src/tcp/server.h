// The TCP transport's serving side (kvplugins/transfer/tcp_server.py wraps it): worker threads, each an epoll
// loop over non-blocking connections that Python accepted and authenticated, serving reads and writes of the
// exported regions with readv/sendmsg straight between region memory and the socket. No Python per frame; the
// GIL is only taken for a control request (op 4), which a Python handler answers.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <condition_variable>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace kvp::tcp {

// Opaque owner references (Python pins) whose release must happen under the GIL: regions dropped by a worker
// are "buried" here and released by Python (Server::take_released).
struct Graveyard {
  std::mutex m;
  std::vector<void*> pins;
  void bury(void* p) { if (p) { std::lock_guard<std::mutex> g(m); pins.push_back(p); } }
};

// Device memory (a GPU's) the workers cannot touch: each frame is staged through the connection's host buffer
// with these C functions (cudaSetDevice's and cudaMemcpy's signatures; kvplugins/transfer/device.py).
// memcpy_fn 0: host memory, served straight from and into the socket.
struct DeviceCopy {
  int index = 0;
  uintptr_t set_device_fn = 0, memcpy_fn = 0;
  bool on() const { return memcpy_fn != 0; }
  // kind 1 host to device, 2 device to host; "" or why it failed
  std::string copy(void* dst, const void* src, uint64_t n, int kind) const;
};

struct Region {
  uint64_t addr, length;
  bool readonly;
  void* pin;
  std::shared_ptr<Graveyard> grave;
  DeviceCopy device;
  ~Region() { grave->bury(pin); }
};

enum class EventKind : int { kClosed = 0, kProtocol = 1, kSlow = 2, kIdle = 3, kError = 4 };
struct Event { uint64_t conn; EventKind kind; std::string reason; };

struct ServerConfig { uint64_t max_frame; double frame_timeout_s, idle_timeout_s; int threads; };

// control(conn id, header bytes, payload length) -> response frame bytes; throws std::runtime_error(reason)
// to close the connection (a malformed control request).
using ControlFn = std::function<std::string(uint64_t, const std::string&, uint64_t)>;

class Worker;

class Server {
 public:
  Server(const ServerConfig& cfg, ControlFn control);
  ~Server();
  void add_region(uint32_t id, uint64_t addr, uint64_t length, bool readonly, void* pin, DeviceCopy device = {});
  void remove_region(uint32_t id);
  uint64_t adopt(int fd);                                   // takes ownership of fd
  std::vector<Event> wait_events(double timeout_s);         // blocks (call with the GIL released)
  std::vector<void*> take_released();
  void close();                                             // joins the workers (call with the GIL released)
  uint64_t closed_idle() const { return closed_idle_; }
  uint64_t closed_slow() const { return closed_slow_; }
  uint64_t staged_bytes() const { return staged_bytes_; }

  // used by workers
  std::shared_ptr<Region> region(uint32_t id);
  void emit(Event e);
  const ServerConfig cfg;
  const ControlFn control;
  std::atomic<uint64_t> closed_idle_{0}, closed_slow_{0}, staged_bytes_{0};

 private:
  std::shared_ptr<Graveyard> grave_ = std::make_shared<Graveyard>();
  std::shared_mutex regions_m_;
  std::unordered_map<uint32_t, std::shared_ptr<Region>> regions_;
  std::mutex ev_m_;
  std::condition_variable ev_cv_;
  std::vector<Event> events_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<uint64_t> next_conn_{1};
  std::atomic<bool> closed_{false};
};

}  // namespace kvp::tcp
