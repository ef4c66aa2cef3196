// nanobind module kvplugins._moe: the CPU MoE kernels, layer and pool. Python wraps it in
// kvplugins/kt_expert_backend/native.py; arrays (numpy or torch via DLPack) are read in place, never copied.
#include "kvp_gil.h"
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

#include "kvp_moe_layer.h"
#include "moe_internal.h"

namespace nb = nanobind;
using namespace kvp::moe;

namespace {

using AnyArr = nb::ndarray<nb::c_contig, nb::device::cpu>;

constexpr nb::dlpack::dtype kBf16{uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};

// bf16 (torch bfloat16, or uint16 bits from numpy) -> true; float32 -> false; anything else raises.
bool is_bf16(const AnyArr& a, const char* name) {
  if (a.dtype() == kBf16 || a.dtype() == nb::dtype<uint16_t>()) return true;
  if (a.dtype() == nb::dtype<float>()) return false;
  throw std::invalid_argument(std::string(name) + " must be bfloat16 (or uint16 bf16 bits) or float32");
}

void need(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

std::string shape_of(const AnyArr& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

void check_2d(const AnyArr& a, const char* name, size_t r, size_t c) {
  need(a.ndim() == 2 && a.shape(0) == r && a.shape(1) == c,
       std::string(name) + " has shape " + shape_of(a) + ", expected [" + std::to_string(r) + ", " + std::to_string(c) + "]");
}

int proj_rows(const Layer& l, Proj p) { return p == Proj::Down ? l.hidden() : l.inter(); }
int proj_cols(const Layer& l, Proj p) { return p == Proj::Down ? l.inter() : l.hidden(); }

void set_float(Layer& l, Pool& pool, int e, int p, AnyArr src) {
  const Proj pr = Proj(p);
  check_2d(src, "weight", proj_rows(l, pr), proj_cols(l, pr));
  const bool bf16 = is_bf16(src, "weight");
  kvp::GilRelease rel;  // through the job queue: Pool::run must never run on two threads at once
  pool.wait(pool.submit([&] { l.set_float(pool, e, pr, src.data(), bf16); }));
}

void set_quantized(Layer& l, Pool& pool, int e, int p, AnyArr q, AnyArr scale) {
  const Proj pr = Proj(p);
  const size_t rows = proj_rows(l, pr), cols = proj_cols(l, pr);
  check_2d(q, "quantized weight", rows, row_bytes(l.format(), int(cols)) / (l.format() == Format::BF16 ? 2 : 1));
  const float* sp = nullptr;
  if (l.format() != Format::BF16) {
    need(scale.dtype() == nb::dtype<float>(), "scale must be float32");
    check_2d(scale, "scale", rows, l.format() == Format::INT8 ? 1 : cols / l.group());
    sp = static_cast<const float*>(scale.data());
  }
  kvp::GilRelease rel;
  pool.wait(pool.submit([&] { l.set_quantized(pool, e, pr, static_cast<const uint8_t*>(q.data()), sp); }));
}

ForwardArgs make_args(const Layer& l, AnyArr x, AnyArr ids, AnyArr w, nb::object skip, AnyArr out, bool acc) {
  ForwardArgs a;
  need(x.ndim() == 2 && x.shape(1) == size_t(l.hidden()), "hidden_states has shape " + shape_of(x) +
       ", expected [T, " + std::to_string(l.hidden()) + "]");
  a.T = int(x.shape(0));
  need(ids.ndim() == 2 && ids.shape(0) == size_t(a.T) && ids.dtype() == nb::dtype<int64_t>(),
       "topk_ids must be int64 [T, K] with T = " + std::to_string(a.T) + " (got " + shape_of(ids) + ")");
  a.K = int(ids.shape(1));
  need(w.dtype() == nb::dtype<float>(), "topk_weights must be float32");
  check_2d(w, "topk_weights", a.T, a.K);
  need(out.dtype() == nb::dtype<float>(), "out must be float32");
  check_2d(out, "out", a.T, l.hidden());
  a.x_bf16 = is_bf16(x, "hidden_states");
  a.x = x.data(), a.ids = static_cast<const int64_t*>(ids.data()), a.weights = static_cast<const float*>(w.data());
  a.out = static_cast<float*>(out.data()), a.accumulate = acc;
  if (!skip.is_none()) {
    AnyArr m;
    need(nb::try_cast<AnyArr>(skip, m, false), "skip mask must be a C-contiguous 1-byte CPU array");
    need(m.ndim() == 1 && m.shape(0) == size_t(l.experts()) && m.itemsize() == 1, "skip mask must be 1-byte [E]");
    a.skip = static_cast<const uint8_t*>(m.data());
  }
  return a;
}

void forward(Layer& l, Pool& pool, AnyArr x, AnyArr ids, AnyArr w, nb::object skip, AnyArr out, bool acc) {
  ForwardArgs a = make_args(l, x, ids, w, skip, out, acc);
  kvp::GilRelease rel;
  pool.wait(pool.submit([&] { l.forward(pool, a); }));
}

// Asynchronous: the caller keeps every array alive until pool.wait(ticket) returns.
uint64_t submit(Layer& l, Pool& pool, AnyArr x, AnyArr ids, AnyArr w, nb::object skip, AnyArr out, bool acc) {
  ForwardArgs a = make_args(l, x, ids, w, skip, out, acc);
  // the routing arrays are read inside the job: validate now so a bad id raises here, not at wait()
  Layer* lp = &l;
  Pool* pp = &pool;
  return pool.submit([lp, pp, a] { lp->forward(*pp, a); });
}

// A forward bound to fixed (pinned) arrays, started and awaited by host functions that a CUDA stream or a
// replayed CUDA graph calls (cudaLaunchHostFunc: kvp_moe_host_submit, then kvp_moe_host_wait), or that the CPU
// ordering shim calls in program order. They run on the driver's callback thread without the GIL and must not
// throw: a failure is kept in `error` and raised by the next HostJob.check() (kvplugins/kt_expert_backend/
// stream.py). The arrays' contents may change between calls (the stream copies new inputs in first); their
// addresses may not, which is what a captured graph needs.
struct HostJob {
  Layer* layer;
  Pool* pool;
  ForwardArgs args;
  std::atomic<uint64_t> ticket{0};
  std::mutex mu;
  std::string error;
  nb::object keep;  // the arrays, alive as long as the job

  void fail(const char* stage, const std::exception* e) noexcept {
    try {
      std::lock_guard<std::mutex> lk(mu);
      if (error.empty()) error = std::string(stage) + ": " + (e ? e->what() : "unknown error");
    } catch (...) {
    }
  }
};

extern "C" void kvp_moe_host_submit(void* p) noexcept {
  auto* j = static_cast<HostJob*>(p);
  try {
    j->ticket.store(j->pool->submit([j] { j->layer->forward(*j->pool, j->args); }), std::memory_order_release);
  } catch (const std::exception& e) {
    j->fail("submit", &e);
  } catch (...) {
    j->fail("submit", nullptr);
  }
}

extern "C" void kvp_moe_host_wait(void* p) noexcept {
  auto* j = static_cast<HostJob*>(p);
  try {
    const uint64_t t = j->ticket.exchange(0, std::memory_order_acq_rel);
    if (t == 0) throw std::logic_error("wait without a submitted job");
    j->pool->wait(t);
  } catch (const std::exception& e) {
    j->fail("forward", &e);
  } catch (...) {
    j->fail("forward", nullptr);
  }
}

nb::tuple quantize(int fmt, AnyArr src, int group) {
  need(src.ndim() == 2, "quantize: src must be 2-D [N, K]");
  const Format f = Format(fmt);
  const int N = int(src.shape(0)), K = int(src.shape(1));
  need(K % 64 == 0, "quantize: K must be a multiple of 64 (got " + std::to_string(K) + ")");
  need(f != Format::INT4 || (group >= 64 && group % 64 == 0 && K % group == 0),
       "quantize: int4 group must be a multiple of 64 dividing K (got " + std::to_string(group) + ")");
  const bool bf16 = is_bf16(src, "src");
  const size_t rb = row_bytes(f, K), spr = f == Format::INT8 ? 1 : f == Format::INT4 ? size_t(K / group) : 1;
  uint8_t* q = new uint8_t[size_t(N) * rb];
  float* s = new float[size_t(N) * spr]();
  {
    kvp::GilRelease rel;
    const size_t esz = bf16 ? 2 : 4;
    for (int r = 0; r < N; ++r)
      quantize_row(f, static_cast<const uint8_t*>(src.data()) + size_t(r) * K * esz, bf16, K, group, q + r * rb,
                   f == Format::BF16 ? nullptr : s + r * spr);
  }
  nb::capsule qo(q, [](void* p) noexcept { delete[] static_cast<uint8_t*>(p); });
  nb::capsule so(s, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  nb::object qa;
  if (f == Format::BF16)
    qa = nb::cast(nb::ndarray<nb::numpy, uint16_t, nb::ndim<2>>(q, {size_t(N), size_t(K)}, qo));
  else if (f == Format::INT8)
    qa = nb::cast(nb::ndarray<nb::numpy, int8_t, nb::ndim<2>>(q, {size_t(N), size_t(K)}, qo));
  else
    qa = nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>(q, {size_t(N), rb}, qo));
  auto sa = nb::ndarray<nb::numpy, float, nb::ndim<2>>(s, {size_t(N), spr}, so);
  return nb::make_tuple(qa, sa);
}

}  // namespace

NB_MODULE(_moe, m) {
  kvp::gil_init();
  m.doc() = "kvplugins CPU MoE kernels (see kvplugins/kt_expert_backend/native.py)";
  m.def("best_isa", [] { return std::string(isa_name(best_isa())); });
  m.def("isa_supported", [](int i) { return i >= 0 && i <= int(Isa::AmxEmulated) && isa_supported(Isa(i)); });
  m.def("best_isa_reason", [] { return std::string(best_isa_reason()); });
  m.def("quantize", &quantize, nb::arg("format"), nb::arg("src"), nb::arg("group") = 128);
  nb::class_<Pool>(m, "Pool")
      .def(nb::init<int, int, std::vector<int>, int, int, const std::string&>(), nb::arg("threads"),
           nb::arg("subpools"), nb::arg("nodes"), nb::arg("spin_us"), nb::arg("wait_spin_us"),
           nb::arg("node_root") = "/sys/devices/system/node")
      .def("wait", [](Pool& p, uint64_t t) { kvp::GilRelease rel; p.wait(t); })
      .def_prop_ro("threads", &Pool::threads)
      .def_prop_ro("subpools", &Pool::subpools)
      .def("describe", &Pool::describe);
  nb::class_<Layer>(m, "Layer")
      .def(nb::init<Format, int, int, int, int, Isa>(), nb::arg("format"), nb::arg("experts"), nb::arg("hidden"),
           nb::arg("inter"), nb::arg("group"), nb::arg("isa"))
      .def("set_float", &set_float)
      .def("set_quantized", &set_quantized)
      // No implicit conversion where a converted copy would be lost: forward's `out` (the result would land in a
      // temporary) and every array of submit (the queued job would read a temporary freed when submit returns).
      .def("forward", &forward, nb::arg("pool"), nb::arg("x"), nb::arg("ids"), nb::arg("weights"),
           nb::arg("skip").none(), nb::arg("out").noconvert(), nb::arg("accumulate"))
      .def("submit", &submit, nb::arg("pool"), nb::arg("x").noconvert(), nb::arg("ids").noconvert(),
           nb::arg("weights").noconvert(), nb::arg("skip").none(), nb::arg("out").noconvert(), nb::arg("accumulate"))
      .def("loaded", [](const Layer& l, int e) { return e >= 0 && e < l.experts() && l.loaded(e); })
      .def_prop_ro("isa", [](const Layer& l) { return std::string(isa_name(l.isa())); });
  nb::class_<HostJob>(m, "HostJob")
      .def("__init__",
           [](HostJob* self, Layer& l, Pool& pool, AnyArr x, AnyArr ids, AnyArr w, nb::object skip, AnyArr out,
              bool acc, nb::object keep) {
             const ForwardArgs a = make_args(l, x, ids, w, skip, out, acc);  // raises before anything is built
             HostJob* j = new (self) HostJob();
             j->layer = &l, j->pool = &pool, j->args = a, j->keep = keep;
           },
           nb::arg("layer"), nb::arg("pool"), nb::arg("x").noconvert(), nb::arg("ids").noconvert(),
           nb::arg("weights").noconvert(), nb::arg("skip").none(), nb::arg("out").noconvert(), nb::arg("accumulate"),
           nb::arg("keep").none(), nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>())
      .def_prop_ro("handle", [](HostJob& j) { return reinterpret_cast<uintptr_t>(&j); })
      .def("take_error", [](HostJob& j) {
        std::lock_guard<std::mutex> lk(j.mu);
        std::string e;
        e.swap(j.error);
        return e;
      });
  m.attr("host_submit_fn") = reinterpret_cast<uintptr_t>(&kvp_moe_host_submit);
  m.attr("host_wait_fn") = reinterpret_cast<uintptr_t>(&kvp_moe_host_wait);
  nb::enum_<Format>(m, "Format").value("BF16", Format::BF16).value("INT8", Format::INT8).value("INT4", Format::INT4);
  nb::enum_<Isa>(m, "Isa").value("SCALAR", Isa::Scalar).value("AVX2", Isa::Avx2)
      .value("AVX512_BASE", Isa::Avx512Base).value("AVX512", Isa::Avx512)
      .value("AVX512_BF16", Isa::Avx512Bf16).value("AMX", Isa::Amx).value("AMX_EMULATED", Isa::AmxEmulated);
}
