// Raw nanobind module. Python code never imports this directly: kvplugins/native.py wraps it.
#include "kvp_gil.h"
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "kvp_copy.h"

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

NB_MODULE(_native, m) {
  kvp::gil_init();
  m.doc() = "kvplugins native core (hot copy paths, xxh3 checksums); see kvplugins/native.py";
  m.def("copy_batch", &copy_batch, nb::arg("dst"), nb::arg("src"), nb::arg("len"), nb::arg("threads") = 1,
        nb::arg("digests").none() = nb::none(), nb::arg("isa") = "auto");
  m.def("hash_keys", &hash_keys, nb::arg("addr"), nb::arg("len"), nb::arg("owner"), nb::arg("digests"),
        nb::arg("threads") = 1, nb::arg("isa") = "auto");
  m.def("hash_tiers", [] { return std::string(kvp::hash_tiers()); });
  m.def("copy", &copy, nb::arg("dst"), nb::arg("src"), nb::arg("len"));
}
