// kvplugins._native.CmaFastRoutes: cma/fast.h for Python (kvplugins/transfer/cma_fast.py wraps it). Read / write
// take every argument as the caller gave it (as TcpFastRoutes: the timeout is accepted, a copy never waits): what
// is not a batch the table takes returns 0.
#include "kvp_gil.h"
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "fast.h"
#include "kvp_fastargs.h"

namespace nb = nanobind;
using kvp::cma::FastRoute;
using kvp::cma::FastRouteList;
using kvp::cma::FastRoutePtr;
using kvp::cma::FastRoutes;

namespace {

template <bool read>
long run(FastRoutes& t, nb::handle remote, nb::handle region_id, nb::handle la, nb::handle ro, nb::handle len,
         nb::handle timeout, nb::handle digests) {
  double ms = 0;
  kvp::FastArgs x;
  if (!kvp::fast_timeout(timeout, ms) || !x.take(region_id, la, ro, len, digests)) return 0;
  FastRoutePtr keep;  // released after the GIL is back (owner_of)
  kvp::GilRelease rel;
  return t.run(read, remote.ptr(), x.region, x.addr.p, x.roff.p, x.len.p, x.len.n, x.digests.p, keep);
}

}  // namespace

#define CMA_FAST_ARGS                                                                                      \
  nb::arg("remote").none(), nb::arg("region").none(), nb::arg("laddr").none(), nb::arg("roff").none(),     \
      nb::arg("length").none(), nb::arg("timeout_ms").none() = nb::none(), nb::arg("digests").none() = nb::none()

void bind_cma_fast(nb::module_& m) {
  nb::class_<FastRoutes>(m, "CmaFastRoutes")
      .def(nb::init<size_t, size_t>(), nb::arg("max_spans"), nb::arg("max_routes"))
      .def("read", &run<true>, CMA_FAST_ARGS)
      .def("write", &run<false>, CMA_FAST_ARGS)
      .def("add_local",
           [](FastRoutes& f, uint64_t id, uint64_t addr, uint64_t length, bool readonly) {
             f.locals.add(kvp::Local{id, addr, length, readonly, {}});
           })
      .def("drop_local",
           [](FastRoutes& f, uint64_t id) {
             kvp::GilRelease rel;  // waits for the batches in flight into or out of it
             f.locals.drop(id);
           })
      .def("put_route",
           [](FastRoutes& f, nb::handle remote, uint64_t region, std::string segment, int pid, int pidfd,
              uint64_t raddr, uint64_t rlength, bool readonly) {
             auto fd = kvp::cma::own_pidfd(pidfd);
             if (!fd) throw std::invalid_argument("put_route: the pidfd cannot be duplicated");
             FastRoute r{{remote.ptr(), region, std::move(segment), readonly, kvp::owner_of({remote})}, pid,
                         std::move(fd), raddr, rlength};
             FastRouteList gone = f.put_route(std::move(r));  // released here, the GIL held
           })
      .def("drop_routes",
           [](FastRoutes& f, const std::string& segment) { FastRouteList gone = f.drop_routes(segment); })
      .def("clear", [](FastRoutes& f) { FastRouteList gone = f.clear(); })
      .def("counts", [](FastRoutes& f) {
        kvp::Counts c = f.counts();
        return std::make_tuple(c.reads, c.writes, c.entries, c.bytes);
      });
}
