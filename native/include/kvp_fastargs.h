// The Python-facing arguments of the native fast paths' read / write (issue #35; verbs/bind.cpp, tcp/fast_bind.cpp,
// cma/fast_bind.cpp): columns and the digests array taken from whatever the caller passed, without numpy, and the
// owner that keeps a route's Python objects alive. Anything a fast path cannot take makes it return 0 (the general
// path then runs the batch and names what is wrong with it).
#pragma once
#include <Python.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <vector>

namespace kvp {

namespace nb = nanobind;

// A fast-path column, copied: a list of at most kFastCols non-negative ints, or a 1-D C-contiguous array of 64-bit
// integers (the buffer protocol: no DLPack capsule, which costs more than the read in the TCG guest); false for
// anything else (the general path then takes the batch and names what is wrong with it).
constexpr size_t kFastCols = 64;
struct FastCol {
  uint64_t own[kFastCols];
  const uint64_t* p = own;
  size_t n = 0;
  bool take(nb::handle h) {
    PyObject* o = h.ptr();
    if (PyList_CheckExact(o)) {
      n = size_t(PyList_GET_SIZE(o));
      if (n > kFastCols) return false;
      for (size_t i = 0; i < n; ++i) {
        PyObject* v = PyList_GET_ITEM(o, Py_ssize_t(i));
        if (!PyLong_CheckExact(v)) return false;
        own[i] = PyLong_AsUnsignedLongLong(v);
        if (own[i] == uint64_t(-1) && PyErr_Occurred()) {
          PyErr_Clear();
          return false;
        }
      }
      return true;
    }
    return PyObject_CheckBuffer(o) && take_buffer(o);
  }
  bool take_buffer(PyObject* o) {
    Py_buffer v;
    if (PyObject_GetBuffer(o, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      return false;
    }
    const char* f = v.format ? v.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    const bool is_signed = (f[0] == 'q' || f[0] == 'l') && !f[1];
    const bool ok = v.ndim == 1 && v.itemsize == 8 && (is_signed || ((f[0] == 'Q' || f[0] == 'L') && !f[1])) &&
                    size_t(v.shape[0]) <= kFastCols;
    if (ok) {
      n = size_t(v.shape[0]);
      std::memcpy(own, v.buf, n * 8);
    }
    PyBuffer_Release(&v);
    if (ok && is_signed)
      for (size_t i = 0; i < n; ++i)
        if (int64_t(own[i]) < 0) return false;
    return ok;
  }
};

// The caller's digests array for a fast batch, held while the GIL is released: None, or a writable 1-D
// C-contiguous uint64 array of exactly n entries (anything else: the batch is not taken, and the general path
// raises ValueError naming it).
struct FastDigests {
  Py_buffer v{};
  bool held = false;
  uint64_t* p = nullptr;
  bool take(nb::handle h, size_t n) {
    if (h.is_none()) return true;
    if (!PyObject_CheckBuffer(h.ptr()) ||
        PyObject_GetBuffer(h.ptr(), &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      return false;
    }
    held = true;
    const char* f = v.format ? v.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    if (v.ndim != 1 || v.itemsize != 8 || size_t(v.shape[0]) != n || (f[0] != 'Q' && f[0] != 'L') || f[1])
      return false;
    p = static_cast<uint64_t*>(v.buf);
    return true;
  }
  ~FastDigests() {
    if (held) PyBuffer_Release(&v);  // with the GIL held again: declared before the GilRelease in run_at
  }
};

// One read / write's arguments: the region id, the three columns (local addresses, remote offsets, lengths) and the
// digests array, which stays held until this is destroyed (declare it before the GilRelease).
struct FastArgs {
  uint64_t region = 0;
  FastCol addr, roff, len;
  FastDigests digests;
  bool take(nb::handle region_id, nb::handle la, nb::handle ro, nb::handle ln, nb::handle dg) {
    if (!PyLong_CheckExact(region_id.ptr())) return false;
    region = PyLong_AsUnsignedLongLong(region_id.ptr());
    if (region == uint64_t(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return addr.take(la) && roff.take(ro) && len.take(ln) && addr.n == len.n && roff.n == len.n &&
           digests.take(dg, len.n);
  }
};

// A route's owner: strong references to the caller's objects (its descriptor, a queue pair). Released only with
// the GIL held: every route pointer a table hands back is declared before the GilRelease that covers the call,
// so it goes after the GIL is taken back (a daemon thread parked at exit never releases it).
inline std::shared_ptr<void> owner_of(std::initializer_list<nb::handle> objs) {
  auto* refs = new std::vector<PyObject*>();
  for (nb::handle h : objs) {
    Py_INCREF(h.ptr());
    refs->push_back(h.ptr());
  }
  return std::shared_ptr<void>(refs, [](void* p) {
    auto* r = static_cast<std::vector<PyObject*>*>(p);
    for (PyObject* o : *r) Py_DECREF(o);
    delete r;
  });
}

// A read / write's timeout: `ms` keeps the table's default for None; false for anything but a finite positive
// number of ms (the general path raises ValueError naming it).
inline bool fast_timeout(nb::handle timeout, double& ms) {
  if (timeout.is_none()) return true;
  if (!PyFloat_CheckExact(timeout.ptr()) && !PyLong_CheckExact(timeout.ptr())) return false;
  ms = PyFloat_AsDouble(timeout.ptr());
  if (!(ms > 0 && ms < 1e12)) {  // NaN, <= 0, an error
    PyErr_Clear();
    return false;
  }
  return true;
}

}  // namespace kvp
