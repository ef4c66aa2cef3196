// Raw nanobind module kvplugins._verbs. Python code never imports it directly: kvplugins/transfer/rdma_verbs.py
// wraps it (VerbsError becomes a kvplugins exception there).
#include "kvp_gil.h"
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <stdexcept>

#include "fast.h"
#include "kvp_fastargs.h"
#include "verbs.h"

namespace nb = nanobind;
using namespace kvp::verbs;

namespace {

using U64 = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using QpResult = std::tuple<size_t, size_t, double, std::string, uint64_t>;

// A column of run_spans: a 1-D uint64 array (not copied) or a list of ints (a small batch: no numpy call at all
// on the Python side, each of which costs more than the verbs in the TCG guest).
struct Col {
  U64 arr;
  std::vector<uint64_t> own;
  const uint64_t* p = nullptr;
  size_t n = 0;
  Col(nb::handle h, const char* what) {
    if (nb::try_cast(h, arr)) {
      p = arr.data(), n = arr.shape(0);
      return;
    }
    if (!nb::try_cast(h, own))
      throw std::invalid_argument(std::string("run_spans: ") + what + " must be a uint64 array or a list of ints");
    p = own.data(), n = own.size();
  }
};

// Spans of one NIC path: span j moves length[j] bytes between (laddr[j], lkey) and (raddr[j], rkey), cut into work
// requests of at most `limit` bytes dealt round robin over `qps` (request i to qps[i % n]); lkey and rkey hold one
// value per span, or one for all. Returns (work requests posted, [(done, posted, finished_at, error, bytes
// confirmed) per QP], one byte per span: 1 when a request of it was not confirmed).
std::tuple<size_t, std::vector<QpResult>, nb::bytes> py_run_spans(bool read, std::vector<QueuePair*> qps,
                                                                  nb::handle laddr, nb::handle lkey, nb::handle raddr,
                                                                  nb::handle rkey, nb::handle length, uint64_t limit,
                                                                  double deadline_at, size_t signal_every) {
  const Col cla(laddr, "laddr"), clk(lkey, "lkey"), cra(raddr, "raddr"), crk(rkey, "rkey"), clen(length, "length");
  const size_t n = clen.n, nq = qps.size();
  if (cla.n != n || cra.n != n) throw std::invalid_argument("run_spans: laddr, raddr and length differ in length");
  if ((clk.n != n && clk.n != 1) || (crk.n != n && crk.n != 1))
    throw std::invalid_argument("run_spans: lkey and rkey need one value per span, or one");
  if (limit == 0 || limit > (uint64_t(1) << 30)) throw std::invalid_argument("run_spans: limit must be 1 .. 1 GiB");
  if (nq == 0 || std::set<QueuePair*>(qps.begin(), qps.end()).size() != nq)
    throw std::invalid_argument("run_spans: give one or more distinct queue pairs");
  const uint64_t *la = cla.p, *lk = clk.p, *ra = cra.p, *rk = crk.p, *len = clen.p;
  const bool lk_all = clk.n == 1, rk_all = crk.n == 1;
  std::vector<Work> works(nq);
  std::vector<std::vector<uint32_t>> span_of(nq);  // per QP: the span of each of its requests
  for (size_t q = 0; q < nq; ++q) {
    if (!qps[q]) throw std::invalid_argument("run_spans: a queue pair is None");
    works[q].qp = qps[q];
  }
  size_t i = 0;
  for (size_t j = 0; j < n; ++j) {
    const uint64_t l = lk[lk_all ? 0 : j], r = rk[rk_all ? 0 : j];
    if (l >> 32 || r >> 32) throw std::invalid_argument("run_spans: an lkey or rkey over 32 bits");
    for (uint64_t off = 0; off < len[j]; off += limit, ++i) {
      works[i % nq].chunks.push_back(
          Chunk{la[j] + off, ra[j] + off, uint32_t(l), uint32_t(r), uint32_t(std::min(limit, len[j] - off))});
      span_of[i % nq].push_back(uint32_t(j));
    }
  }
  size_t posted;
  {
    kvp::GilRelease rel;
    posted = run(read, works, deadline_at, signal_every);
  }
  std::string failed(n, '\0');
  std::vector<QpResult> out;
  for (size_t q = 0; q < nq; ++q) {
    Work& w = works[q];
    uint64_t moved = 0;
    for (size_t k = 0; k < w.chunks.size(); ++k) {
      if (k < w.done) moved += w.chunks[k].length;
      else failed[span_of[q][k]] = 1;
    }
    out.emplace_back(w.done, w.posted, w.finished_at, std::move(w.error), moved);
  }
  return {posted, std::move(out), nb::bytes(failed.data(), n)};
}

// (local NIC, peer NIC) of each route taken out.
std::vector<std::pair<size_t, size_t>> paths_of(const Routes& gone) {
  std::vector<std::pair<size_t, size_t>> out;
  for (const auto& r : gone) out.emplace_back(r->nic, r->rnic);
  return out;
}

// FastRoutes with the engine's default timeout (read/write from TransferEngine's entry) for Python.
struct PyFast {
  FastRoutes t;
  double timeout_ms;
  PyFast(uint64_t max_bytes, size_t max_spans, size_t signal_every, double timeout, size_t max_routes)
      : t(max_bytes, max_spans, signal_every, max_routes), timeout_ms(timeout) {}

  // Every argument as the caller gave it (any object: what is not a batch this table takes returns 0, and the
  // general path names what is wrong with it).
  long run_at(bool read, nb::handle remote, nb::handle region_id, nb::handle la, nb::handle ro, nb::handle len,
              double deadline_at, nb::handle digests) {
    kvp::FastArgs x;
    if (!x.take(region_id, la, ro, len, digests)) return 0;
    std::shared_ptr<const FastRoute> keep;  // released after the GIL is back (owner_of)
    kvp::GilRelease rel;
    return t.run(read, remote.ptr(), x.region, x.addr.p, x.roff.p, x.len.p, x.len.n, deadline_at, x.digests.p, keep);
  }

  template <bool read>
  long run_in(nb::handle remote, nb::handle region, nb::handle la, nb::handle ro, nb::handle len,
              nb::handle timeout, nb::handle digests) {
    double ms = timeout_ms;
    if (!kvp::fast_timeout(timeout, ms)) return 0;
    return run_at(read, remote, region, la, ro, len, monotonic_s() + ms / 1000, digests);
  }
};

}  // namespace

// FastRoutes.read / write: every argument any object (what the table cannot take returns 0).
#define FAST_IN_ARGS                                                                                       \
  nb::arg("remote").none(), nb::arg("region").none(), nb::arg("laddr").none(), nb::arg("roff").none(),     \
      nb::arg("length").none(), nb::arg("timeout_ms").none() = nb::none(), nb::arg("digests").none() = nb::none()

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
  nb::class_<PyFast>(m, "FastRoutes")
      .def(nb::init<uint64_t, size_t, size_t, double, size_t>(), nb::arg("max_bytes"), nb::arg("max_spans"),
           nb::arg("signal_every"), nb::arg("timeout_ms"), nb::arg("max_routes"))
      .def("read", &PyFast::run_in<true>, FAST_IN_ARGS)
      .def("write", &PyFast::run_in<false>, FAST_IN_ARGS)
      .def("run", &PyFast::run_at, nb::arg("read"), nb::arg("remote").none(), nb::arg("region").none(),
           nb::arg("laddr").none(), nb::arg("roff").none(), nb::arg("length").none(), nb::arg("deadline_at"),
           nb::arg("digests").none() = nb::none())
      .def("add_local",
           [](PyFast& f, uint64_t id, uint64_t addr, uint64_t length, bool readonly, std::vector<uint32_t> lkeys) {
             kvp::GilRelease rel;
             f.t.locals.add(kvp::Local{id, addr, length, readonly, std::move(lkeys)});
           })
      .def("drop_local",
           [](PyFast& f, uint64_t id) {
             kvp::GilRelease rel;
             f.t.locals.drop(id);
           })
      .def("put_route",
           [](PyFast& f, nb::handle remote, uint64_t region, std::string segment, nb::handle qp_obj, size_t nic,
              size_t rnic, uint64_t raddr, uint64_t rlength, uint32_t rkey) {
             QueuePair* qp = nb::cast<QueuePair*>(qp_obj);
             if (!qp) throw std::invalid_argument("put_route: the queue pair is None");
             FastRoute r{remote.ptr(), region, std::move(segment), qp, nic, rnic, raddr, rlength, rkey,
                         kvp::owner_of({remote, qp_obj})};
             Routes gone;  // released after the GIL is back
             kvp::GilRelease rel;
             gone = f.t.put_route(std::move(r));
           })
      .def("drop_routes",
           [](PyFast& f, std::string segment) {
             Routes gone;
             {
               kvp::GilRelease rel;
               gone = f.t.drop_routes(segment);
             }
             return paths_of(gone);
           })
      .def("clear",
           [](PyFast& f) {
             Routes gone;
             kvp::GilRelease rel;
             gone = f.t.clear();
           })
      .def("counts", [](PyFast& f) {
        FastCounts c = f.t.counts();
        return std::make_tuple(c.reads, c.writes, c.entries, c.bytes, c.wrs);
      });
  m.def("run_spans", &py_run_spans, nb::arg("read"), nb::arg("qps"), nb::arg("laddr"), nb::arg("lkey"),
        nb::arg("raddr"), nb::arg("rkey"), nb::arg("length"), nb::arg("limit"), nb::arg("deadline_at"),
        nb::arg("signal_every"));
}
