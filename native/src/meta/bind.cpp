// Raw nanobind module kvplugins._meta: the master's object table (table.h) and the allocator's size map.
// Python never uses it directly: kvplugins/store/master/metadata.py (ObjectTable, Object) and allocator.py wrap it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "serve.h"
#include "table.h"

namespace nb = nanobind;
using namespace kvp::meta;

namespace {

std::string_view utf8(nb::handle s) {
  Py_ssize_t n;
  const char* p = PyUnicode_AsUTF8AndSize(s.ptr(), &n);
  if (!p) throw nb::python_error();
  return {p, size_t(n)};
}

// The table plus the segment names it interns (ids never reused, so a stale id never names a new segment).
struct PyTable {
  Table t;
  std::vector<std::string> names;
  std::vector<int64_t> regions;
  std::unordered_map<std::string, uint32_t> ids;

  uint32_t seg_id(const std::string& name) {
    auto it = ids.find(name);
    if (it != ids.end()) return it->second;
    names.push_back(name), regions.push_back(-1);
    return ids[name] = uint32_t(names.size() - 1);
  }
  std::optional<uint32_t> known(const std::string& name) const {
    auto it = ids.find(name);
    return it == ids.end() ? std::nullopt : std::optional<uint32_t>(it->second);
  }
};

struct Obj {
  nb::object owner;   // the PyTable
  PyTable* pt;
  uint32_t i, gen;

  Rec& r() const {
    if (!pt->t.live(i, gen)) throw std::runtime_error("stale object view: its key left the table (read fields before removing it)");
    return pt->t.rec(i);
  }
};

Obj view(PyTable& pt, uint32_t i, nb::object owner) { return Obj{std::move(owner), &pt, i, pt.t.rec(i).gen}; }
Obj view(PyTable& pt, uint32_t i) { return view(pt, i, nb::find(&pt)); }

// A batch's keys as UTF-8 views (the list holds the str objects), and each one's record (NONE: absent), looked up
// with prefetching (Table::find_many).
std::vector<std::string_view> views_of(nb::handle keys) {
  std::vector<std::string_view> ks;
  for (nb::handle k : keys) ks.push_back(utf8(k));
  return ks;
}
std::vector<uint32_t> find_all(const PyTable& pt, const std::vector<std::string_view>& ks) {
  std::vector<uint32_t> found(ks.size());
  pt.t.find_many(ks.data(), ks.size(), found.data());
  return found;
}

nb::list views(PyTable& pt, const std::vector<uint32_t>& recs) {
  nb::object owner = nb::find(&pt);
  nb::list out;
  for (uint32_t i : recs) out.append(nb::cast(view(pt, i, owner)));
  return out;
}

nb::object maybe(PyTable& pt, uint32_t i) { return i == NONE ? nb::none() : nb::cast(view(pt, i)); }

nb::list replicas_of(const Obj& o) {
  o.r();
  nb::list out;
  for (const Replica& x : o.pt->t.replicas(o.i)) out.append(nb::make_tuple(o.pt->names[x.seg], x.off));
  return out;
}

void set_replicas(const Obj& o, nb::iterable rs) {
  o.r();
  std::vector<Replica> v;
  for (nb::handle x : rs) {
    nb::tuple t = nb::cast<nb::tuple>(x);
    v.push_back({o.pt->seg_id(nb::cast<std::string>(t[0])), nb::cast<uint64_t>(t[1])});
  }
  o.pt->t.set_replicas(o.i, v);
}

nb::list locations_of(const Obj& o) {
  o.r();
  nb::list out;
  for (const Replica& x : o.pt->t.replicas(o.i))
    { nb::list loc; loc.append(o.pt->names[x.seg]), loc.append(o.pt->regions[x.seg]), loc.append(x.off); out.append(loc); }
  return out;
}

struct ListIter {
  nb::object owner;
  PyTable* pt;
  uint32_t cur;
  bool reverse;
  Obj next() {
    if (cur == NONE) throw nb::stop_iteration();
    const uint32_t i = cur;
    cur = reverse ? pt->t.rec(i).prev : pt->t.rec(i).next;
    return view(*pt, i);
  }
};

// get with a lease: per key size (-1 miss/pending/disk-only), segment index into the reply's names, offset, checksum
nb::tuple get_cols(PyTable& pt, nb::list keys, double now, double lease) {
  const size_t n = nb::len(keys);
  nb::list sizes, seg_idx, offs, sums, names, regions, more, disk;
  std::unordered_map<uint32_t, long> index;
  long hits = 0;
  const std::vector<uint32_t> found = find_all(pt, views_of(keys));
  for (size_t j = 0; j < n; ++j) {
    const uint32_t i = found[j];
    Rec* r = i == NONE ? nullptr : &pt.t.rec(i);
    if (!r || !r->complete || r->seg == NONE) {
      if (r && r->complete) disk.append(nb::make_tuple(j, view(pt, i)));
      sizes.append(-1), seg_idx.append(-1), offs.append(0), sums.append(nb::none());
      continue;
    }
    if (r->lease_until < lease) r->lease_until = lease;
    r->last_access = now;
    pt.t.touch(i);
    auto it = index.find(r->seg);
    if (it == index.end()) {
      it = index.emplace(r->seg, long(nb::len(names))).first;
      names.append(pt.names[r->seg]), regions.append(pt.regions[r->seg]);
    }
    sizes.append(r->size), seg_idx.append(it->second), offs.append(r->off);
    sums.append(r->has_sum ? nb::cast(r->checksum) : nb::none());
    if (pt.t.more_replicas(i)) more.append(nb::make_tuple(j, view(pt, i)));
    ++hits;
  }
  return nb::make_tuple(hits, sizes, names, regions, seg_idx, offs, more, sums, disk);
}

// A slab put's new objects in one pass (kvplugins/store/master/slabs.py): when no key of `keys` is in the table
// and none repeats, each becomes a complete object of sizes[k] bytes at offs[k] on segment `seg`, born and last
// used `now`, with checksum sums[k] (`sums` None, or an element None: unknown), most recently used, and their views
// come back in order. Returns None, changing nothing, when a key is present or repeats (the caller goes key by key).
nb::object insert_new(PyTable& pt, nb::list keys, const std::vector<uint64_t>& sizes, const std::string& seg,
                      const std::vector<uint64_t>& offs, double now, nb::object sums) {
  const size_t n = nb::len(keys);
  if (sizes.size() != n || offs.size() != n || (!sums.is_none() && nb::len(sums) != n))
    throw std::invalid_argument("insert_new: keys, sizes, offsets and checksums differ in length");
  const std::vector<std::string_view> ks = views_of(keys);
  std::vector<uint64_t> digests(n, 0);
  std::vector<uint8_t> has(n, 0);
  if (!sums.is_none())
    for (size_t k = 0; k < n; ++k) {
      nb::handle d = sums[k];
      if (!d.is_none()) digests[k] = nb::cast<uint64_t>(d), has[k] = 1;
    }
  std::vector<uint32_t> recs(n);
  if (!pt.t.insert_committed(ks.data(), n, pt.seg_id(seg), sizes.data(), offs.data(), now, digests.data(),
                             has.data(), recs.data()))
    return nb::none();
  return views(pt, recs);
}

// The native front's parsed slab put (serve.h PutRequest), holding the request body its keys point into.
struct PutFront {
  nb::bytes body;
  PutRequest q;
};

// commit_put of `f` into a slab (slabs.py Slabs.serve_put): None, nothing changed, or (reply body, allocation
// sizes (a uint64 array; the objects lie back to back from `front`), the new objects' views if `objects` else None).
nb::object commit(PyTable& pt, const PutFront& f, const std::string& seg, uint64_t align, uint64_t front,
                  uint64_t end, double now, bool objects) {
  std::string reply;
  auto* rounded = new std::vector<uint64_t>();
  nb::capsule owner(rounded, [](void* p) noexcept { delete static_cast<std::vector<uint64_t>*>(p); });
  std::vector<uint32_t> recs;
  if (align == 0 || (align & (align - 1)))
    throw std::invalid_argument("commit_put: align must be a power of two, got " + std::to_string(align));
  if (!commit_put(pt.t, f.q, pt.seg_id(seg), align, front, end, now, reply, *rounded, recs)) return nb::none();
  nb::ndarray<nb::numpy, uint64_t, nb::ndim<1>> sizes(rounded->data(), {rounded->size()}, owner);
  return nb::make_tuple(nb::bytes(reply.data(), reply.size()), sizes,
                        objects ? nb::object(views(pt, recs)) : nb::none());
}

// SizeMap.set_run: allocations of sizes[k] bytes back to back from `front`; returns where they end. Raises
// ValueError, nothing set, when they would pass `limit`.
template <class Sizes>
uint64_t set_run(SizeMap& s, uint64_t front, const Sizes& sizes, size_t n, uint64_t limit) {
  uint64_t end = front;
  for (size_t k = 0; k < n; ++k) end += sizes[k];
  if (end > limit)
    throw std::invalid_argument("split_run to " + std::to_string(end) + ": past the allocation [" +
                                std::to_string(front) + ", " + std::to_string(limit) + ")");
  for (size_t k = 0, at = front; k < n; at += sizes[k++]) s.set(at, sizes[k]);
  return end;
}

using U64 = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

}  // namespace

NB_MODULE(_meta, m) {
  m.doc() = "kvplugins master object table (native/src/meta); see kvplugins/store/master/metadata.py";
  m.attr("FRONT_GET") = int(kGet), m.attr("FRONT_EXISTS") = int(kExists), m.attr("FRONT_PUT") = int(kPut);
  m.attr("UNPINNED") = int(UNPINNED), m.attr("PINNED") = int(PINNED), m.attr("PARKED") = int(PARKED);

  nb::class_<Obj>(m, "Object")
      .def_prop_ro("key", [](const Obj& o) { Rec& r = o.r(); return nb::str(r.key, r.keylen); })
      .def_prop_rw("size", [](const Obj& o) { return o.r().size; }, [](const Obj& o, uint64_t v) { o.r().size = v; })
      .def_prop_ro("complete", [](const Obj& o) { return bool(o.r().complete); })
      .def_prop_rw("deadline", [](const Obj& o) { Rec& r = o.r(); return r.complete ? 0.0 : r.t; },
                   [](const Obj& o, double v) { o.r().t = v; })
      .def_prop_rw("born", [](const Obj& o) { Rec& r = o.r(); return r.complete ? r.t : 0.0; },
                   [](const Obj& o, double v) { o.r().t = v; })
      .def_prop_rw("lease_until", [](const Obj& o) { return o.r().lease_until; },
                   [](const Obj& o, double v) { o.r().lease_until = v; })
      .def_prop_rw("last_access", [](const Obj& o) { return o.r().last_access; },
                   [](const Obj& o, double v) { o.r().last_access = v; })
      .def_prop_rw("checksum",
                   [](const Obj& o) -> std::optional<uint64_t> { Rec& r = o.r(); if (!r.has_sum) return std::nullopt; return r.checksum; },
                   [](const Obj& o, std::optional<uint64_t> v) { Rec& r = o.r(); r.has_sum = v.has_value(); r.checksum = v.value_or(0); })
      .def_prop_ro("pin", [](const Obj& o) { return int(o.r().pin); })
      .def_prop_rw("pin_until", [](const Obj& o) {
                     o.r(); auto& m = o.pt->t.pin_until(); auto it = m.find(o.i); return it == m.end() ? 0.0 : it->second; },
                   [](const Obj& o, double v) { o.r(); if (v) o.pt->t.pin_until()[o.i] = v; else o.pt->t.pin_until().erase(o.i); })
      .def_prop_rw("replicas", &replicas_of, &set_replicas)
      .def_prop_ro("locations", &locations_of)
      .def_prop_ro("list", [](const Obj& o) { return int(o.r().list); })
      .def("alive", [](const Obj& o) { return o.pt->t.live(o.i, o.gen); })
      .def("leased", [](const Obj& o, double now) { return o.r().lease_until > now; })
      .def("on_segment", [](const Obj& o, const std::string& name) {
             o.r(); auto id = o.pt->known(name); return id && o.pt->t.on_segment(o.i, *id); })
      .def("__eq__", [](const Obj& a, nb::handle b) {  // any other (None included: a key gone) is unequal
             if (!nb::isinstance<Obj>(b)) return false;
             const Obj& o = nb::cast<const Obj&>(b); return a.pt == o.pt && a.i == o.i && a.gen == o.gen; },
           nb::arg("other").none())
      .def("__hash__", [](const Obj& o) { return (size_t(o.i) << 20) ^ o.gen; })
      .def("__repr__", [](const Obj& o) {
             if (!o.pt->t.live(o.i, o.gen)) return std::string("<Object (removed)>");
             Rec& r = o.r(); return "<Object " + std::string(r.key, r.keylen) + " size=" + std::to_string(r.size) +
                                    (r.complete ? " complete>" : " pending>"); });

  nb::class_<PutFront>(m, "PutFront");

  nb::class_<ListIter>(m, "ListIter")
      .def("__iter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__next__", &ListIter::next);

  nb::class_<PyTable>(m, "Table")
      .def(nb::init<>())
      .def("__len__", [](const PyTable& pt) { return pt.t.size(); })
      .def("__contains__", [](const PyTable& pt, nb::handle k) { return pt.t.find(utf8(k)) != NONE; })
      .def("get", [](PyTable& pt, nb::handle k) { return maybe(pt, pt.t.find(utf8(k))); })
      .def("insert", [](PyTable& pt, nb::handle k, uint64_t size, nb::iterable replicas, bool complete, double t,
                        double last_access, int pin, double pin_until, std::optional<uint64_t> checksum) {
             if (pin < 0 || pin > 2) throw std::invalid_argument("pin must be 0, 1 or 2, got " + std::to_string(pin));
             const uint32_t i = pt.t.insert(utf8(k));
             if (i == NONE) throw nb::key_error("object table: key already present");
             Obj o = view(pt, i);
             Rec& r = pt.t.rec(i);
             r.size = size, r.t = t, r.last_access = last_access, r.pin = uint8_t(pin);
             r.has_sum = checksum.has_value(), r.checksum = checksum.value_or(0);
             if (pin_until) pt.t.pin_until()[i] = pin_until;
             pt.t.set_complete(i, complete);
             set_replicas(o, replicas);
             pt.t.link(i, pin ? PINNED : UNPINNED);
             return o; },
           nb::arg("key"), nb::arg("size"), nb::arg("replicas"), nb::arg("complete"), nb::arg("t"),
           nb::arg("last_access"), nb::arg("pin") = 0, nb::arg("pin_until") = 0.0, nb::arg("checksum").none() = nb::none())
      .def("erase", [](PyTable& pt, const Obj& o) { o.r(); pt.t.erase(o.i); })
      .def("link", [](PyTable& pt, const Obj& o, int l) {
             if (l < 0 || l > 2) throw std::invalid_argument("list must be 0, 1 or 2");
             o.r(); pt.t.link(o.i, List(l)); })
      .def("set_pin", [](PyTable& pt, const Obj& o, int pin) { o.r().pin = uint8_t(pin); (void)pt; })
      .def("commit", [](PyTable& pt, const Obj& o, double now) {
             Rec& r = o.r(); pt.t.set_complete(o.i, true); r.t = now; r.last_access = now; pt.t.touch(o.i); })
      .def("touch", [](PyTable& pt, const Obj& o, double now) { o.r().last_access = now; pt.t.touch(o.i); })
      .def("iter", [](PyTable& pt, int l, bool reverse) {
             return ListIter{nb::find(&pt), &pt, reverse ? pt.t.tail(List(l)) : pt.t.head(List(l)), reverse}; },
           nb::arg("list"), nb::arg("reverse") = false)
      .def("count", [](const PyTable& pt, int l) { return pt.t.count(List(l)); })
      .def("pending", [](PyTable& pt) {
             nb::list out; for (uint32_t i : pt.t.pending()) out.append(view(pt, i)); return out; })
      .def("pending_count", [](const PyTable& pt) { return pt.t.pending().size(); })
      .def("exists", [](const PyTable& pt, nb::list keys) {
             nb::list out;
             for (uint32_t i : find_all(pt, views_of(keys))) out.append(i != NONE && pt.t.rec(i).complete);
             return out; })
      .def("exists_prefix", [](const PyTable& pt, nb::list keys) {
             size_t n = 0;
             for (nb::handle k : keys) { const uint32_t i = pt.t.find(utf8(k)); if (i == NONE || !pt.t.rec(i).complete) break; ++n; }
             return n; })
      .def("get_cols", &get_cols)
      .def("serve", [](PyTable& pt, nb::bytes body, double now, uint32_t ops, uint64_t max_keys,
                       uint64_t max_key_bytes, uint64_t ttl_ms) -> nb::object {
             auto s = serve(pt.t, pt.names, pt.regions, std::string_view(body.c_str(), body.size()), now,
                            Limits{ops, max_keys, max_key_bytes, ttl_ms});
             if (!s) return nb::none();
             if (s->put) {
               const uint64_t slab = s->put->slab;
               return nb::make_tuple(PutFront{body, std::move(*s->put)}, uint32_t(s->op), s->keys, slab);
             }
             return nb::make_tuple(nb::bytes(s->reply.data(), s->reply.size()), uint32_t(s->op), s->keys, s->hits); },
           nb::arg("body"), nb::arg("now"), nb::arg("ops"), nb::arg("max_keys"), nb::arg("max_key_bytes"),
           nb::arg("ttl_ms"))
      .def("commit_put", &commit, nb::arg("put"), nb::arg("seg"), nb::arg("align"), nb::arg("front"),
           nb::arg("end"), nb::arg("now"), nb::arg("objects"))
      .def("insert_new", &insert_new, nb::arg("keys"), nb::arg("sizes"), nb::arg("seg"), nb::arg("offs"),
           nb::arg("now"), nb::arg("sums").none())
      .def("on_segment", [](PyTable& pt, const std::string& name, size_t limit) {
             nb::list out; auto id = pt.known(name);
             const uint64_t want = id ? pt.t.seg_count(*id) : 0;
             size_t n = 0;
             for (int l = 0; l < 3 && n < want && (!limit || n < limit); ++l)
               for (uint32_t i = pt.t.head(List(l)); i != NONE && n < want && (!limit || n < limit); i = pt.t.rec(i).next)
                 if (pt.t.on_segment(i, *id)) out.append(view(pt, i)), ++n;
             return out; }, nb::arg("name"), nb::arg("limit") = 0)
      .def("count_on", [](const PyTable& pt, const std::string& name) {
             auto id = pt.known(name); return id ? pt.t.seg_count(*id) : 0; })
      .def("set_region", [](PyTable& pt, const std::string& name, int64_t region) { pt.regions[pt.seg_id(name)] = region; })
      .def("nbytes", [](const PyTable& pt) { return pt.t.bytes(); });

  nb::class_<SizeMap>(m, "SizeMap")
      .def(nb::init<uint64_t>(), nb::arg("align"))
      .def("__len__", &SizeMap::size)
      .def("__contains__", [](const SizeMap& s, uint64_t off) { uint64_t v; return s.get(off, &v); })
      .def("__getitem__", [](const SizeMap& s, uint64_t off) {
             uint64_t v; if (!s.get(off, &v)) throw nb::key_error(std::to_string(off).c_str()); return v; })
      .def("__setitem__", &SizeMap::set)
      .def("set_run", [](SizeMap& s, uint64_t front, U64 sizes, uint64_t limit) {
             return set_run(s, front, sizes.data(), sizes.shape(0), limit); },
           nb::arg("front"), nb::arg("sizes"), nb::arg("limit"))
      .def("set_run", [](SizeMap& s, uint64_t front, const std::vector<uint64_t>& sizes, uint64_t limit) {
             return set_run(s, front, sizes, sizes.size(), limit); },
           nb::arg("front"), nb::arg("sizes"), nb::arg("limit"))
      .def("pop", [](SizeMap& s, uint64_t off) {
             uint64_t v; if (!s.pop(off, &v)) throw nb::key_error(std::to_string(off).c_str()); return v; })
      .def("nbytes", &SizeMap::bytes);
}
