// Raw nanobind module. Python code never imports this directly: kvplugins/native.py wraps it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <stdexcept>

#include "kvp_copy.h"

namespace nb = nanobind;
using U64Vec = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

static void copy_batch(U64Vec dst, U64Vec src, U64Vec len, int threads) {
  const size_t n = dst.shape(0);
  if (src.shape(0) != n || len.shape(0) != n) throw std::invalid_argument("copy_batch: dst, src, len differ in length");
  const uint64_t *d = dst.data(), *s = src.data(), *l = len.data();
  nb::gil_scoped_release release;
  kvp::copy_batch(d, s, l, n, threads);
}

static void copy(uint64_t dst, uint64_t src, uint64_t len) {
  nb::gil_scoped_release release;
  kvp::copy_batch(&dst, &src, &len, 1, 1);
}

NB_MODULE(_native, m) {
  m.doc() = "kvplugins native core (hot copy paths); see kvplugins/native.py";
  m.def("copy_batch", &copy_batch, nb::arg("dst"), nb::arg("src"), nb::arg("len"), nb::arg("threads") = 1);
  m.def("copy", &copy, nb::arg("dst"), nb::arg("src"), nb::arg("len"));
}
