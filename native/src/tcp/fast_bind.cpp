// kvplugins._native.TcpFastRoutes: tcp/fast.h for Python (kvplugins/transfer/tcp_fast.py wraps it). Read / write
// take every argument as the caller gave it: what is not a batch the table takes returns 0.
#include "kvp_gil.h"
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <ctime>
#include <string>
#include <tuple>
#include <utility>

#include "fast.h"
#include "kvp_fastargs.h"

namespace nb = nanobind;
using kvp::tcp::FastRoute;
using kvp::tcp::FastRouteList;
using kvp::tcp::FastRoutePtr;
using kvp::tcp::FastRoutes;
using kvp::tcp::Peers;

namespace {

double monotonic_now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// FastRoutes over a TcpPeers object (kept alive by the binding) with the engine's default timeout.
struct PyTcpFast {
  FastRoutes t;
  double timeout_ms;
  PyTcpFast(Peers& peers, size_t max_spans, double timeout, size_t max_routes)
      : t(peers, max_spans, max_routes), timeout_ms(timeout) {}

  template <bool read>
  long run(nb::handle remote, nb::handle region_id, nb::handle la, nb::handle ro, nb::handle len, nb::handle timeout,
           nb::handle digests) {
    double ms = timeout_ms;
    kvp::FastArgs x;
    if (!kvp::fast_timeout(timeout, ms) || !x.take(region_id, la, ro, len, digests)) return 0;
    FastRoutePtr keep;  // released after the GIL is back (owner_of)
    kvp::GilRelease rel;
    const double deadline_at = monotonic_now() + ms / 1000;
    return t.run(read, remote.ptr(), x.region, x.addr.p, x.roff.p, x.len.p, x.len.n, deadline_at, x.digests.p, keep);
  }
};

}  // namespace

#define TCP_FAST_ARGS                                                                                      \
  nb::arg("remote").none(), nb::arg("region").none(), nb::arg("laddr").none(), nb::arg("roff").none(),     \
      nb::arg("length").none(), nb::arg("timeout_ms").none() = nb::none(), nb::arg("digests").none() = nb::none()

void bind_tcp_fast(nb::module_& m) {
  nb::class_<PyTcpFast>(m, "TcpFastRoutes")
      .def(nb::init<Peers&, size_t, double, size_t>(), nb::arg("peers"), nb::arg("max_spans"), nb::arg("timeout_ms"),
           nb::arg("max_routes"), nb::keep_alive<1, 2>())
      .def("read", &PyTcpFast::run<true>, TCP_FAST_ARGS)
      .def("write", &PyTcpFast::run<false>, TCP_FAST_ARGS)
      .def("add_local",
           [](PyTcpFast& f, uint64_t id, uint64_t addr, uint64_t length, bool readonly) {
             f.t.locals.add(kvp::Local{id, addr, length, readonly, {}});
           })
      .def("drop_local",
           [](PyTcpFast& f, uint64_t id) {
             kvp::GilRelease rel;  // waits for the batches in flight into or out of it
             f.t.locals.drop(id);
           })
      .def("put_route",
           [](PyTcpFast& f, nb::handle remote, uint64_t region, std::string segment, std::string peer,
              uint64_t rlength, uint64_t limit, bool readonly) {
             FastRoute r{{remote.ptr(), region, std::move(segment), readonly, kvp::owner_of({remote})},
                         std::move(peer), rlength, limit};
             FastRouteList gone = f.t.put_route(std::move(r));  // released here, the GIL held
           })
      .def("drop_routes",
           [](PyTcpFast& f, const std::string& segment) { FastRouteList gone = f.t.drop_routes(segment); })
      .def("clear", [](PyTcpFast& f) { FastRouteList gone = f.t.clear(); })
      .def("counts", [](PyTcpFast& f) {
        kvp::Counts c = f.t.counts();
        return std::make_tuple(c.reads, c.writes, c.entries, c.bytes);
      });
}
