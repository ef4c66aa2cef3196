// Raw nanobind module kvplugins._tcp. Python code never imports it directly: kvplugins/transfer/native_tcp.py
// wraps it (errors become kvplugins exceptions there).
#include "kvp_gil.h"
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <stdexcept>

#include "client.h"
#include "server.h"
#include "wire.h"

namespace nb = nanobind;
using namespace kvp::tcp;
using U64 = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

namespace {

class PyServer {
 public:
  PyServer(uint64_t max_frame, double frame_timeout_s, double idle_timeout_s, int threads, nb::object control) {
    auto holder = std::make_shared<nb::object>(std::move(control));
    ControlFn fn = [holder](uint64_t conn, const std::string& header, uint64_t plen) -> std::string {
      nb::gil_scoped_acquire gil;
      try {
        nb::object r = (*holder)(conn, nb::bytes(header.data(), header.size()), plen);
        return std::string(nb::cast<nb::bytes>(r).c_str(), nb::len(r));
      } catch (nb::python_error& e) {
        std::string why = e.what();
        e.restore();
        PyErr_Clear();
        throw std::runtime_error(why);
      }
    };
    srv_ = std::make_unique<Server>(ServerConfig{max_frame, frame_timeout_s, idle_timeout_s, threads}, fn);
  }
  ~PyServer() {
    if (!srv_) return;
    { kvp::GilRelease r; srv_->close(); }
    drain();
    srv_.reset();
  }
  void add_region(uint32_t id, uint64_t addr, uint64_t length, bool readonly, nb::object pin, int device_index,
                  uintptr_t set_device_fn, uintptr_t memcpy_fn) {
    srv_->add_region(id, addr, length, readonly, pin.inc_ref().ptr(), DeviceCopy{device_index, set_device_fn, memcpy_fn});
  }
  uint64_t staged_bytes() { return srv_->staged_bytes(); }
  void remove_region(uint32_t id) { srv_->remove_region(id); drain(); }
  uint64_t adopt(int fd) { return srv_->adopt(fd); }
  std::vector<std::tuple<uint64_t, int, std::string>> wait_events(double timeout_s) {
    std::vector<Event> evs;
    { kvp::GilRelease r; evs = srv_->wait_events(timeout_s); }
    drain();
    std::vector<std::tuple<uint64_t, int, std::string>> out;
    for (auto& e : evs) out.emplace_back(e.conn, int(e.kind), std::move(e.reason));
    return out;
  }
  void close() {
    { kvp::GilRelease r; srv_->close(); }
    drain();
  }
  std::tuple<uint64_t, uint64_t> stats() { return {srv_->closed_idle(), srv_->closed_slow()}; }

 private:
  void drain() { for (void* p : srv_->take_released()) nb::handle(static_cast<PyObject*>(p)).dec_ref(); }
  std::unique_ptr<Server> srv_;
};

class PyClient {
 public:
  // Returns (codes bytes (one SpanCode per span), [(span, text) for failed spans], [broken flag per connection]).
  std::tuple<nb::bytes, std::vector<std::tuple<size_t, std::string>>, std::vector<uint8_t>> transfer(
      int op, std::vector<int> fds, std::vector<uint8_t> reused, U64 addrs, U64 regions, U64 offs, U64 lens,
      uint64_t limit, uint64_t max_frame, double timeout_s, uint64_t land_by_ms) {
    const size_t n = addrs.shape(0);
    if (regions.shape(0) != n || offs.shape(0) != n || lens.shape(0) != n || reused.size() != fds.size())
      throw std::invalid_argument("tcp transfer: span arrays (or fds and reused) differ in length");
    if (op != kWrite && op != kRead) throw std::invalid_argument("tcp transfer: op must be 1 (write) or 2 (read)");
    Batch b{op, addrs.data(), regions.data(), offs.data(), lens.data(), n, limit, max_frame, timeout_s, land_by_ms};
    Result r;
    { kvp::GilRelease rel; r = kvp::tcp::transfer(b, fds, reused, ids_); }
    std::vector<std::tuple<size_t, std::string>> bad;
    for (size_t j = 0; j < n; ++j) if (r.code[j]) bad.emplace_back(j, std::move(r.text[j]));
    return {nb::bytes(reinterpret_cast<const char*>(r.code.data()), n), std::move(bad), std::move(r.broken)};
  }

 private:
  std::atomic<uint64_t> ids_{1};
};

// ("data", op, id, [(region, offset, length)], land_by_ms) | ("control", 0, 0, [], 0); ValueError(reason) if
// malformed.
std::tuple<std::string, int, uint64_t, std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>, uint64_t>
py_decode_request(nb::bytes header, uint64_t plen, uint64_t max_frame) {
  int op = 0;
  uint64_t id = 0, land_by = 0;
  std::vector<WireEntry> ents;
  std::string err;
  Decoded d = decode_request(reinterpret_cast<const uint8_t*>(header.c_str()), header.size(), plen, max_frame, op, id,
                             ents, land_by, err);
  if (d == Decoded::kError) throw nb::value_error(err.c_str());
  std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> out;
  for (auto& e : ents) out.emplace_back(e.region, e.offset, e.length);
  if (d == Decoded::kControl) return {"control", 0, 0, {}, 0};
  return {"data", op, id, std::move(out), land_by};
}

// "Emulated" device memory (tests without a GPU): host memory copied by these, with cudaSetDevice's and
// cudaMemcpy's signatures.
int emulated_set_device(int) { return 0; }
int emulated_memcpy(void* dst, const void* src, size_t n, int) { std::memcpy(dst, src, n); return 0; }

std::vector<double> py_loopback(uint64_t nbytes, int rounds) {
  kvp::GilRelease r;
  return loopback_baseline(nbytes, rounds);
}

}  // namespace

NB_MODULE(_tcp, m) {
  kvp::gil_init();
  m.doc() = "kvplugins native TCP transport (frame loops, GIL released); see kvplugins/transfer/native_tcp.py";
  nb::class_<PyServer>(m, "Server")
      .def(nb::init<uint64_t, double, double, int, nb::object>(), nb::arg("max_frame"), nb::arg("frame_timeout_s"),
           nb::arg("idle_timeout_s"), nb::arg("threads"), nb::arg("control"))
      .def("add_region", &PyServer::add_region, nb::arg("id"), nb::arg("addr"), nb::arg("length"),
           nb::arg("readonly"), nb::arg("pin").none(),   // pin None: memory registered by address
           nb::arg("device_index") = 0, nb::arg("set_device_fn") = 0, nb::arg("memcpy_fn") = 0)
      .def("staged_bytes", &PyServer::staged_bytes)
      .def("remove_region", &PyServer::remove_region)
      .def("adopt", &PyServer::adopt)
      .def("wait_events", &PyServer::wait_events)
      .def("close", &PyServer::close)
      .def("stats", &PyServer::stats);
  nb::class_<PyClient>(m, "Client").def(nb::init<>()).def("transfer", &PyClient::transfer);
  m.def("decode_request", &py_decode_request);
  m.def("loopback_baseline", &py_loopback);
  m.def("emulated_device_fns", [] {
    return std::make_tuple(reinterpret_cast<uintptr_t>(&emulated_set_device), reinterpret_cast<uintptr_t>(&emulated_memcpy));
  });
}
