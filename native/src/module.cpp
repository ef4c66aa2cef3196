// Raw nanobind module. Python code never imports this directly: kvplugins/native.py wraps it.
#include "kvp_gil.h"
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "kvp_copy.h"
#include "store/one_op.h"

namespace nb = nanobind;
using U64Vec = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U64Out = nb::ndarray<uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

static const kvp::HashOps* tier(const std::string& isa) {
  const kvp::HashOps* ops = kvp::hash_ops(isa.c_str());
  if (!ops) throw std::invalid_argument("xxh3 tier '" + isa + "' is not supported here; use auto or one of " + kvp::hash_tiers());
  return ops;
}

static void copy_batch(U64Vec dst, U64Vec src, U64Vec len, int threads, std::optional<U64Out> digests,
                       const std::string& isa) {
  const size_t n = dst.shape(0);
  if (src.shape(0) != n || len.shape(0) != n) throw std::invalid_argument("copy_batch: dst, src, len differ in length");
  if (digests && digests->shape(0) != n) throw std::invalid_argument("copy_batch: digests must hold one per span");
  const uint64_t *d = dst.data(), *s = src.data(), *l = len.data();
  uint64_t* out = digests ? digests->data() : nullptr;
  const kvp::HashOps* ops = tier(isa);
  kvp::GilRelease release;
  kvp::copy_batch(d, s, l, n, threads, out, ops);
}

static void hash_keys(U64Vec addr, U64Vec len, U64Vec owner, U64Out digests, int threads, const std::string& isa) {
  const size_t n = addr.shape(0);
  if (len.shape(0) != n || owner.shape(0) != n) throw std::invalid_argument("hash_keys: addr, len, owner differ in length");
  const kvp::HashOps* ops = tier(isa);
  bool ok;
  {
    kvp::GilRelease release;
    ok = kvp::hash_keys(addr.data(), len.data(), owner.data(), n, digests.data(), digests.shape(0), threads, ops);
  }
  if (!ok) throw std::invalid_argument("hash_keys: an owner is >= the number of digests, or a key's spans are not consecutive");
}

static void copy(uint64_t dst, uint64_t src, uint64_t len) {
  kvp::GilRelease release;
  kvp::copy_batch(&dst, &src, &len, 1, 1);
}

using kvp::store::ShmMaps;

// A kvp::store::OpResult as (status, value): (0, size or code), (1, None), (2, reply body bytes), (3|4, why),
// (5, None).
static nb::tuple op_result(const kvp::store::OpResult& r) {
  switch (r.status) {
    case kvp::store::kDone: return nb::make_tuple(r.status, r.size);
    case kvp::store::kMiss: case kvp::store::kNotSent: return nb::make_tuple(r.status, nb::none());
    case kvp::store::kAsPython: return nb::make_tuple(r.status, nb::bytes(r.text.data(), r.text.size()));
    default: return nb::make_tuple(r.status, r.text);
  }
}

static nb::tuple get_one(int fd, uint64_t rid, const std::string& key, const std::vector<uint64_t>& addrs,
                         const std::vector<uint64_t>& lens, double timeout_ms, ShmMaps& maps, bool verify,
                         const std::string& isa) {
  if (addrs.size() != lens.size()) throw std::invalid_argument("get_one: addrs and lens differ in length");
  const kvp::HashOps* ops = tier(isa);
  kvp::store::OpResult r{0};
  {
    kvp::GilRelease release;
    r = kvp::store::get_one(fd, rid, key, addrs.data(), lens.data(), addrs.size(), timeout_ms, maps, verify, ops);
  }
  return op_result(r);
}

static nb::tuple put_one(int fd, uint64_t rid, const std::string& key, const std::vector<uint64_t>& addrs,
                         const std::vector<uint64_t>& lens, const std::string& segment, uint32_t region,
                         uint64_t offset, uint64_t slab, double write_ms, double timeout_ms, ShmMaps& maps,
                         const std::string& isa) {
  if (addrs.size() != lens.size()) throw std::invalid_argument("put_one: addrs and lens differ in length");
  const kvp::HashOps* ops = tier(isa);
  kvp::store::OpResult r{0};
  {
    kvp::GilRelease release;
    r = kvp::store::put_one(fd, rid, key, addrs.data(), lens.data(), addrs.size(), segment, region, offset, slab,
                            write_ms, timeout_ms, maps, ops);
  }
  return op_result(r);
}

static void bind_store(nb::module_& m) {
  nb::class_<ShmMaps>(m, "ShmMaps")
      .def(nb::init<>())
      .def("add", &ShmMaps::add, nb::arg("segment"), nb::arg("region"), nb::arg("base"), nb::arg("length"),
           nb::arg("pidfd"))
      .def("alias", &ShmMaps::alias, nb::arg("name"), nb::arg("segment"))
      .def("forget", [](ShmMaps& s, const std::string& segment) { kvp::GilRelease r; s.forget(segment); })
      .def("clear", [](ShmMaps& s) { kvp::GilRelease r; s.clear(); })
      .def("counts", [](const ShmMaps& s) { return std::make_pair(s.entries(), s.bytes()); });
  m.def("get_one", &get_one, nb::arg("fd"), nb::arg("rid"), nb::arg("key"), nb::arg("addrs"), nb::arg("lens"),
        nb::arg("timeout_ms"), nb::arg("maps"), nb::arg("verify"), nb::arg("isa") = "auto");
  m.def("put_one", &put_one, nb::arg("fd"), nb::arg("rid"), nb::arg("key"), nb::arg("addrs"), nb::arg("lens"),
        nb::arg("segment"), nb::arg("region"), nb::arg("offset"), nb::arg("slab"), nb::arg("write_ms"),
        nb::arg("timeout_ms"), nb::arg("maps"), nb::arg("isa") = "auto");
}

NB_MODULE(_native, m) {
  kvp::gil_init();
  m.doc() = "kvplugins native core (hot copy paths, xxh3 checksums); see kvplugins/native.py";
  m.def("copy_batch", &copy_batch, nb::arg("dst"), nb::arg("src"), nb::arg("len"), nb::arg("threads") = 1,
        nb::arg("digests").none() = nb::none(), nb::arg("isa") = "auto");
  m.def("hash_keys", &hash_keys, nb::arg("addr"), nb::arg("len"), nb::arg("owner"), nb::arg("digests"),
        nb::arg("threads") = 1, nb::arg("isa") = "auto");
  m.def("hash_tiers", [] { return std::string(kvp::hash_tiers()); });
  m.def("copy", &copy, nb::arg("dst"), nb::arg("src"), nb::arg("len"));
  bind_store(m);
}
