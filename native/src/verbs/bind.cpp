// Raw nanobind module kvplugins._verbs. Python code never imports it directly: kvplugins/transfer/rdma_verbs.py
// wraps it (VerbsError becomes a kvplugins exception there).
#include "kvp_gil.h"
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <set>
#include <stdexcept>

#include "verbs.h"

namespace nb = nanobind;
using namespace kvp::verbs;
// One row per work request: laddr, lkey, raddr, rkey, length.
using Rows = nb::ndarray<const uint64_t, nb::ndim<2>, nb::shape<-1, 5>, nb::c_contig, nb::device::cpu>;

namespace {

// Returns (work requests posted, [(done, posted, finished_at, error) per QP]).
std::tuple<size_t, std::vector<std::tuple<size_t, size_t, double, std::string>>> py_run(
    bool read, std::vector<QueuePair*> qps, std::vector<Rows> chunks, double deadline_at, size_t signal_every) {
  if (qps.size() != chunks.size()) throw std::invalid_argument("run: one chunk array per queue pair");
  if (std::set<QueuePair*>(qps.begin(), qps.end()).size() != qps.size())
    throw std::invalid_argument("run: a queue pair appears twice");
  std::vector<Work> works(qps.size());
  for (size_t j = 0; j < qps.size(); ++j) {
    if (!qps[j]) throw std::invalid_argument("run: a queue pair is None");
    works[j].qp = qps[j];
    const uint64_t* r = chunks[j].data();
    works[j].chunks.resize(chunks[j].shape(0));
    for (size_t k = 0; k < works[j].chunks.size(); ++k, r += 5) {
      if (r[1] >> 32 || r[3] >> 32 || r[4] > (uint64_t(1) << 30))
        throw std::invalid_argument("run: a chunk's keys must fit 32 bits and its length 1 GiB");
      works[j].chunks[k] = Chunk{r[0], r[2], uint32_t(r[1]), uint32_t(r[3]), uint32_t(r[4])};
    }
  }
  size_t posted;
  {
    kvp::GilRelease rel;
    posted = run(read, works, deadline_at, signal_every);
  }
  std::vector<std::tuple<size_t, size_t, double, std::string>> out;
  for (Work& w : works) out.emplace_back(w.done, w.posted, w.finished_at, std::move(w.error));
  return {posted, std::move(out)};
}

}  // namespace

NB_MODULE(_verbs, m) {
  kvp::gil_init();
  m.doc() = "kvplugins RDMA verbs layer (libibverbs loaded at run time); see kvplugins/transfer/rdma_verbs.py";
  nb::exception<VerbsError>(m, "VerbsError");
  m.def("load_error", [] { return load_error(); });
  m.def("monotonic", &monotonic_s);
  nb::class_<Context>(m, "Context")
      .def(nb::init<const std::string&>(), nb::arg("name"))
      .def("query_port", [](Context& c, int port) {
        PortAttr a = c.query_port(port);
        return std::make_tuple(a.state, a.active_mtu, a.lid, a.link_layer);
      });
  nb::class_<MemoryRegion>(m, "MemoryRegion")
      .def(nb::init<std::shared_ptr<Context>, uint64_t, uint64_t, int>(), nb::arg("context"), nb::arg("addr"),
           nb::arg("length"), nb::arg("access"))
      .def_prop_ro("lkey", &MemoryRegion::lkey)
      .def_prop_ro("rkey", &MemoryRegion::rkey)
      .def("close", &MemoryRegion::close);
  nb::class_<QueuePair>(m, "QueuePair")
      .def(nb::init<std::shared_ptr<Context>, int, int>(), nb::arg("context"), nb::arg("depth"), nb::arg("port"))
      .def_prop_ro("qpn", &QueuePair::qpn)
      .def_prop_ro("dead", &QueuePair::dead)
      .def("connect",
           [](QueuePair& q, int path_mtu, uint32_t dest_qpn, uint32_t rq_psn, uint32_t sq_psn, nb::bytes dgid,
              int dlid, int sgid_index, int port) {
             q.connect(Connect{path_mtu, dest_qpn, rq_psn, sq_psn, std::string(dgid.c_str(), dgid.size()), dlid,
                               sgid_index, port});
           })
      .def("kill", &QueuePair::kill)
      .def("close", [](QueuePair& q) {
        kvp::GilRelease rel;  // may wait for a batch on another thread
        q.close();
      });
  m.def("run", &py_run, nb::arg("read"), nb::arg("qps"), nb::arg("chunks"), nb::arg("deadline_at"),
        nb::arg("signal_every"));
}
