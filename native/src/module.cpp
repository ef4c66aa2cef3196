// Raw nanobind module. Python code never imports this directly: kvplugins/native.py wraps it.
#include "kvp_gil.h"
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kvp_copy.h"
#include "store/one_op.h"
#include "store/shards.h"

namespace nb = nanobind;
using U64Vec = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
void bind_tcp_fast(nb::module_& m);  // tcp/fast_bind.cpp
void bind_cma_fast(nb::module_& m);  // cma/fast_bind.cpp
using U64Out = nb::ndarray<uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U32Vec = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

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

// The spans of a batch's keys, checked: key k's are [starts[k], starts[k+1]) of (addrs, lens).
static kvp::store::KeySpans key_spans(size_t keys, const uint64_t* addrs, size_t na, const uint64_t* lens, size_t nl,
                                      const uint64_t* starts, size_t ns) {
  if (nl != na || ns != keys + 1 || starts[0] != 0 || starts[keys] != na)
    throw std::invalid_argument("key spans: addrs and lens differ in length, or starts is not keys + 1 offsets from 0 to the span count");
  for (size_t k = 0; k < keys; ++k)
    if (starts[k] > starts[k + 1]) throw std::invalid_argument("key spans: starts must not decrease");
  return {addrs, lens, starts, keys};
}

// A BatchResult as (status, per-key codes bytes, reply body bytes or None, planned TCP reads or None); a failure
// as (status, b"", why, None).
static nb::tuple batch_result(kvp::store::BatchResult& r) {
  if (r.status == kvp::store::kIoError || r.status == kvp::store::kTimeout)
    return nb::make_tuple(r.status, nb::bytes("", 0), r.body, nb::none());
  nb::object body = r.body.empty() ? nb::none() : nb::object(nb::bytes(r.body.data(), r.body.size()));
  nb::object tcp = r.tcp ? nb::cast(r.tcp.release(), nb::rv_policy::take_ownership) : nb::none();
  return nb::make_tuple(r.status, nb::bytes(r.codes.data(), r.codes.size()), body, tcp);
}

// Runs a get's planned TCP reads (GIL released): the per-key codes with each kTcp key now kDone or kAsPython.
static nb::bytes run_tcp_reads(kvp::store::TcpReads& reads, nb::bytes codes) {
  std::string c(codes.c_str(), codes.size());
  {
    kvp::GilRelease release;
    reads.run(c);
  }
  return nb::bytes(c.data(), c.size());
}

// get_many and put_many take their span columns as uint64 arrays (a big batch); get_many_lists and put_many_lists
// as int lists (a small one: no numpy on the caller's side, no failed array conversion first). Cols is either.
template <class Cols>
static std::pair<const uint64_t*, size_t> col(const Cols& c) {
  if constexpr (std::is_same_v<Cols, U64Vec>) return {c.data(), c.shape(0)};
  else return {c.data(), c.size()};
}

// A batch's keys as UTF-8 views into its str objects, no copies; `hold` keeps each str alive (and its views valid)
// while the GIL is released. Raises TypeError for a key that is not a str or has no UTF-8 form (a lone surrogate).
struct KeyViews {
  nb::tuple hold;
  std::vector<std::string_view> views;
};

static KeyViews key_views(nb::handle keys) {
  KeyViews kv{nb::steal<nb::tuple>(PySequence_Tuple(keys.ptr())), {}};
  if (!kv.hold.is_valid()) throw nb::python_error();
  kv.views.reserve(kv.hold.size());
  for (nb::handle k : kv.hold) {
    Py_ssize_t n;
    const char* p = PyUnicode_Check(k.ptr()) ? PyUnicode_AsUTF8AndSize(k.ptr(), &n) : nullptr;
    if (p == nullptr) {
      PyErr_Clear();
      throw nb::type_error("every key must be a str with a UTF-8 form");
    }
    kv.views.emplace_back(p, size_t(n));
  }
  return kv;
}

template <class Cols>
static nb::tuple get_many(int fd, uint64_t rid, nb::handle key_objs, const Cols& addrs,
                          const Cols& lens, const Cols& starts, double timeout_ms, ShmMaps& maps, bool verify,
                          kvp::tcp::Peers* peers, double transfer_timeout_ms, const std::string& isa) {
  const KeyViews held = key_views(key_objs);
  const std::vector<std::string_view>& keys = held.views;
  auto [a, na] = col(addrs);
  auto [l, nl] = col(lens);
  auto [s, ns] = col(starts);
  const kvp::store::KeySpans spans = key_spans(keys.size(), a, na, l, nl, s, ns);
  const kvp::HashOps* ops = tier(isa);
  kvp::store::BatchResult r;
  {
    kvp::GilRelease release;
    r = kvp::store::get_many(fd, rid, keys, spans, timeout_ms, maps, verify, ops, peers, transfer_timeout_ms);
  }
  return batch_result(r);
}

template <class Cols>
static nb::tuple put_many(int fd, uint64_t rid, nb::handle key_objs, const Cols& addrs,
                          const Cols& lens, const Cols& starts, const std::string& segment, uint32_t region,
                          const Cols& offsets, uint64_t slab, double write_ms, double timeout_ms, ShmMaps& maps,
                          const std::optional<std::vector<uint64_t>>& written, const std::string& isa) {
  const KeyViews held = key_views(key_objs);
  const std::vector<std::string_view>& keys = held.views;
  auto [a, na] = col(addrs);
  auto [l, nl] = col(lens);
  auto [s, ns] = col(starts);
  auto [o, no] = col(offsets);
  const kvp::store::KeySpans spans = key_spans(keys.size(), a, na, l, nl, s, ns);
  if (no != keys.size()) throw std::invalid_argument("put_many: one offset per key");
  if (written && written->size() != keys.size()) throw std::invalid_argument("put_many: one written digest per key");
  const kvp::HashOps* ops = tier(isa);
  const uint64_t* w = written ? written->data() : nullptr;
  kvp::store::BatchResult r;
  {
    kvp::GilRelease release;
    r = kvp::store::put_many(fd, rid, keys, spans, segment, region, o, slab, write_ms, timeout_ms, maps, ops, w);
  }
  return batch_result(r);
}

// write_tcp's digests (a list, one per key), an empty list where a frame failed, None where nothing was sent.
template <class Cols>
static std::optional<std::vector<uint64_t>> write_tcp(kvp::tcp::Peers& peers, const Cols& addrs, const Cols& lens,
                                                      const Cols& starts, const std::string& segment, uint32_t region,
                                                      const Cols& offsets, double timeout_ms, uint64_t land_by_ms,
                                                      const std::string& isa) {
  auto [a, na] = col(addrs);
  auto [l, nl] = col(lens);
  auto [s, ns] = col(starts);
  auto [o, no] = col(offsets);
  const kvp::store::KeySpans spans = key_spans(no, a, na, l, nl, s, ns);
  const kvp::HashOps* ops = tier(isa);
  std::vector<uint64_t> digests;
  kvp::store::WriteStatus st;
  {
    kvp::GilRelease release;
    st = kvp::store::write_tcp(peers, spans, segment, region, o, timeout_ms, land_by_ms, ops, digests);
  }
  if (st == kvp::store::kWriteNotSent) return std::nullopt;
  return digests;   // empty: kWriteFailed
}

// Each key's shard on the ring (points ascending, point_shard[i] < shards) as uint32 bytes.
static nb::bytes ring_owners(nb::handle key_objs, U64Vec points, U32Vec point_shard, uint32_t shards,
                             const std::string& isa) {
  const KeyViews held = key_views(key_objs);
  const std::vector<std::string_view>& keys = held.views;
  const size_t np = points.shape(0);
  if (np == 0 || point_shard.shape(0) != np) throw std::invalid_argument("ring_owners: the ring is empty or its arrays differ in length");
  for (size_t i = 0; i < np; ++i)
    if (point_shard.data()[i] >= shards) throw std::invalid_argument("ring_owners: a ring point names no given shard");
  const kvp::HashOps* ops = tier(isa);
  std::vector<uint32_t> owner(keys.size());
  {
    kvp::GilRelease release;
    kvp::store::ring_owners(keys, kvp::store::Ring{points.data(), point_shard.data(), np}, ops, owner.data());
  }
  return nb::bytes(owner.data(), owner.size() * sizeof(uint32_t));
}

// The owner array of a fan-out, checked against the shards and keys.
static const uint32_t* owner_of(const char* fn, const std::vector<int>& fds, const std::vector<uint64_t>& rids,
                                size_t nkeys, const U32Vec& owner) {
  if (fds.size() != rids.size()) throw std::invalid_argument(std::string(fn) + ": fds and rids differ in length");
  if (owner.shape(0) != nkeys) throw std::invalid_argument(std::string(fn) + ": owner and keys differ in length");
  for (size_t k = 0; k < nkeys; ++k)
    if (owner.data()[k] >= fds.size()) throw std::invalid_argument(std::string(fn) + ": an owner names no given shard");
  return owner.data();
}

// Per shard (status, value): (0|5, None), (2, reply body), (3|4, why).
static nb::list shard_answers(const std::vector<kvp::store::ShardAnswer>& answers) {
  nb::list per_shard;
  for (const auto& a : answers) {
    if (a.status == kvp::store::kAsPython) per_shard.append(nb::make_tuple(a.status, nb::bytes(a.text.data(), a.text.size())));
    else if (a.status == kvp::store::kIoError || a.status == kvp::store::kTimeout) per_shard.append(nb::make_tuple(a.status, a.text));
    else per_shard.append(nb::make_tuple(a.status, nb::none()));
  }
  return per_shard;
}

// (key flags as bytes: 1 stored, 0 not, 2 unanswered; per shard as shard_answers).
static nb::tuple shard_exists(const std::vector<int>& fds, const std::vector<uint64_t>& rids,
                              nb::handle key_objs, U32Vec owner, double timeout_ms) {
  const KeyViews held = key_views(key_objs);
  const std::vector<std::string_view>& keys = held.views;
  const uint32_t* own = owner_of("shard_exists", fds, rids, keys.size(), owner);
  std::string out(keys.size(), '\2');
  std::vector<kvp::store::ShardAnswer> answers;
  {
    kvp::GilRelease release;
    answers = kvp::store::shard_exists(fds, rids, keys, own, timeout_ms, reinterpret_cast<uint8_t*>(out.data()));
  }
  return nb::make_tuple(nb::bytes(out.data(), out.size()), shard_answers(answers));
}

// Per shard as shard_answers.
static nb::list shard_call(const std::vector<int>& fds, const std::vector<uint64_t>& rids, const std::string& op,
                           nb::handle key_objs, U32Vec owner, double timeout_ms) {
  const KeyViews held = key_views(key_objs);
  const std::vector<std::string_view>& keys = held.views;
  const uint32_t* own = owner_of("shard_call", fds, rids, keys.size(), owner);
  std::vector<kvp::store::ShardAnswer> answers;
  {
    kvp::GilRelease release;
    answers = kvp::store::shard_call(fds, rids, op, keys, own, timeout_ms);
  }
  return shard_answers(answers);
}

using BoolVec = nb::ndarray<const bool, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// One (address, bytes) pair of a span list: a 2-item tuple or list of non-negative ints.
static bool span_of(PyObject* pair, uint64_t& addr, uint64_t& len) {
  if (!(PyTuple_CheckExact(pair) || PyList_CheckExact(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) return false;
  PyObject** items = PySequence_Fast_ITEMS(pair);
  if (!PyLong_Check(items[0]) || !PyLong_Check(items[1])) return false;
  addr = PyLong_AsUnsignedLongLong(items[0]);
  len = PyLong_AsUnsignedLongLong(items[1]);
  if (PyErr_Occurred()) {   // negative, or over 64 bits
    PyErr_Clear();
    return false;
  }
  return true;
}

// A batch's spans (per key a list or tuple of (address, bytes) pairs) as uint64 columns, when every span lies in
// one writable registered region by memory._Index.locate's rule (the last-starting region that starts at or
// before the span must hold it whole) over the index columns (starts, ends, writable); else None. Returns
// (addrs, lens, per-key starts, bytes per key) as bytes of native uint64 (int lists where the batch has at most
// `small` spans), and the batch's total bytes.
static nb::object writable_spans(nb::handle spans_per_key, U64Vec rstarts, U64Vec rends, BoolVec writable,
                                 size_t small) {
  PyObject* keys = spans_per_key.ptr();
  const size_t nr = rstarts.shape(0);
  if (!PyList_CheckExact(keys) || rends.shape(0) != nr || writable.shape(0) != nr) return nb::none();
  const Py_ssize_t nk = PyList_GET_SIZE(keys);
  const uint64_t *rs = rstarts.data(), *re = rends.data();
  std::vector<uint64_t> addrs, lens, starts{0}, sizes;
  addrs.reserve(size_t(nk));
  lens.reserve(size_t(nk));
  sizes.reserve(size_t(nk));
  uint64_t total = 0;
  for (Py_ssize_t k = 0; k < nk; ++k) {
    PyObject* spans = PyList_GET_ITEM(keys, k);
    if (!PyList_CheckExact(spans) && !PyTuple_CheckExact(spans)) return nb::none();
    const Py_ssize_t ns = PySequence_Fast_GET_SIZE(spans);
    PyObject** items = PySequence_Fast_ITEMS(spans);
    uint64_t size = 0;
    for (Py_ssize_t j = 0; j < ns; ++j) {
      uint64_t a, n;
      if (!span_of(items[j], a, n)) return nb::none();
      const size_t i = size_t(std::upper_bound(rs, rs + nr, a) - rs);
      if (i == 0 || a > re[i - 1] || n > re[i - 1] - a || !writable.data()[i - 1]) return nb::none();
      addrs.push_back(a);
      lens.push_back(n);
      size += n;
    }
    starts.push_back(addrs.size());
    sizes.push_back(size);
    total += size;
  }
  if (addrs.size() <= small) {   // a few spans: int lists (a numpy array costs more than the batch)
    auto as_list = [](const std::vector<uint64_t>& v) {
      nb::list out;
      for (uint64_t x : v) out.append(x);
      return out;
    };
    return nb::make_tuple(as_list(addrs), as_list(lens), as_list(starts), as_list(sizes), total);
  }
  auto as_bytes = [](const std::vector<uint64_t>& v) {
    return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(uint64_t));
  };
  return nb::make_tuple(as_bytes(addrs), as_bytes(lens), as_bytes(starts), as_bytes(sizes), total);
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
  nb::class_<kvp::store::TcpReads>(m, "TcpReads").def("run", &run_tcp_reads, nb::arg("codes"));
  using kvp::tcp::Peers;
  nb::class_<Peers>(m, "TcpPeers")
      .def(nb::init<size_t, uint64_t>(), nb::arg("per_peer"), nb::arg("max_frame"))
      .def("take", &Peers::take, nb::arg("peer"))
      .def("give", &Peers::give, nb::arg("peer"), nb::arg("fd"))
      .def("drop", &Peers::drop, nb::arg("peer"))
      .def("clear", &Peers::clear)
      .def("route", &Peers::route, nb::arg("name"), nb::arg("region"), nb::arg("length"), nb::arg("peer"),
           nb::arg("limit"))
      .def("unroute", &Peers::unroute, nb::arg("name"))
      .def("counts", [](const Peers& p) { return std::make_pair(p.entries(), p.bytes()); });
  using List = std::vector<uint64_t>;
  m.def("get_many", &get_many<U64Vec>, nb::arg("fd"), nb::arg("rid"), nb::arg("keys"), nb::arg("addrs"),
        nb::arg("lens"), nb::arg("starts"), nb::arg("timeout_ms"), nb::arg("maps"), nb::arg("verify"),
        nb::arg("peers").none(), nb::arg("transfer_timeout_ms"), nb::arg("isa") = "auto");
  m.def("get_many_lists", &get_many<List>, nb::arg("fd"), nb::arg("rid"), nb::arg("keys"), nb::arg("addrs"),
        nb::arg("lens"), nb::arg("starts"), nb::arg("timeout_ms"), nb::arg("maps"), nb::arg("verify"),
        nb::arg("peers").none(), nb::arg("transfer_timeout_ms"), nb::arg("isa") = "auto");
  m.def("put_many", &put_many<U64Vec>, nb::arg("fd"), nb::arg("rid"), nb::arg("keys"), nb::arg("addrs"),
        nb::arg("lens"), nb::arg("starts"), nb::arg("segment"), nb::arg("region"), nb::arg("offsets"),
        nb::arg("slab"), nb::arg("write_ms"), nb::arg("timeout_ms"), nb::arg("maps"),
        nb::arg("written").none() = nb::none(), nb::arg("isa") = "auto");
  m.def("put_many_lists", &put_many<List>, nb::arg("fd"), nb::arg("rid"), nb::arg("keys"), nb::arg("addrs"),
        nb::arg("lens"), nb::arg("starts"), nb::arg("segment"), nb::arg("region"), nb::arg("offsets"),
        nb::arg("slab"), nb::arg("write_ms"), nb::arg("timeout_ms"), nb::arg("maps"),
        nb::arg("written").none() = nb::none(), nb::arg("isa") = "auto");
  m.def("write_tcp", &write_tcp<U64Vec>, nb::arg("peers"), nb::arg("addrs"), nb::arg("lens"), nb::arg("starts"),
        nb::arg("segment"), nb::arg("region"), nb::arg("offsets"), nb::arg("timeout_ms"), nb::arg("land_by_ms"),
        nb::arg("isa") = "auto");
  m.def("write_tcp_lists", &write_tcp<List>, nb::arg("peers"), nb::arg("addrs"), nb::arg("lens"), nb::arg("starts"),
        nb::arg("segment"), nb::arg("region"), nb::arg("offsets"), nb::arg("timeout_ms"), nb::arg("land_by_ms"),
        nb::arg("isa") = "auto");
  m.def("writable_spans", &writable_spans, nb::arg("spans_per_key"), nb::arg("starts"), nb::arg("ends"),
        nb::arg("writable"), nb::arg("small"));
  m.def("ring_owners", &ring_owners, nb::arg("keys"), nb::arg("points"), nb::arg("point_shard"), nb::arg("shards"),
        nb::arg("isa") = "auto");
  m.def("shard_exists", &shard_exists, nb::arg("fds"), nb::arg("rids"), nb::arg("keys"), nb::arg("owner"),
        nb::arg("timeout_ms"));
  m.def("shard_call", &shard_call, nb::arg("fds"), nb::arg("rids"), nb::arg("op"), nb::arg("keys"), nb::arg("owner"),
        nb::arg("timeout_ms"));
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
  bind_tcp_fast(m);
  bind_cma_fast(m);
}
