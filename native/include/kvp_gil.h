// Releasing the GIL around a blocking native call, safely at interpreter exit.
//
// nanobind's gil_scoped_release takes the GIL back in its destructor. When a daemon thread's call returns
// while the interpreter is finalizing, CPython (3.11) ends that thread with pthread_exit instead, and the
// forced unwind through a (noexcept) destructor aborts the whole process: "terminate called without an active
// exception" after pytest had reported every test passed. GilRelease parks such a thread instead (the
// process is exiting; exit() ends it). The finalizing (main) thread itself takes the GIL back as usual.
#pragma once
#include <Python.h>

#include <chrono>
#include <thread>

namespace kvp {

inline unsigned long& main_thread_ident() {
  static unsigned long ident = 0;
  return ident;
}

// Call once from the module's init, with the GIL held: remembers Python's main thread.
inline void gil_init() {
  PyObject* threading = PyImport_ImportModule("threading");
  PyObject* main = threading ? PyObject_CallMethod(threading, "main_thread", nullptr) : nullptr;
  PyObject* ident = main ? PyObject_GetAttrString(main, "ident") : nullptr;
  if (ident) main_thread_ident() = PyLong_AsUnsignedLong(ident);
  Py_XDECREF(ident);
  Py_XDECREF(main);
  Py_XDECREF(threading);
  PyErr_Clear();
}

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

class GilRelease {
 public:
  GilRelease() : st_(PyEval_SaveThread()) {}
  ~GilRelease() {
    if (interpreter_finalizing() && PyThread_get_thread_ident() != main_thread_ident())
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    PyEval_RestoreThread(st_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* st_;
};

}  // namespace kvp
