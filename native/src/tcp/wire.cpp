#include "wire.h"

#include <cstring>

#include "mp.h"

namespace kvp::tcp {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'P', 'T'};

uint64_t le(const uint8_t* p, int n) { uint64_t v = 0; for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i]; return v; }
void put_le(std::string& o, uint64_t v, int n) { for (int i = 0; i < n; ++i) o.push_back(char((v >> (8 * i)) & 0xff)); }

void frame(std::string& out, const std::string& head, uint64_t payload) {
  out.clear();
  out.reserve(kPrefix + head.size());
  out.append(kMagic, 4);
  put_le(out, head.size(), 4);
  put_le(out, payload, 8);
  out += head;
}

// Reads the fields of one map: calls f(key) for each, which consumes the value; rejects duplicates and
// keys not in `names` (bit i of `seen` = names[i] present).
template <typename F>
bool fields(MpReader& r, const char* const* names, int count, uint32_t& seen, F&& f) {
  uint32_t n;
  if (!r.map(n, "`$`")) return false;
  seen = 0;
  for (uint32_t i = 0; i < n; ++i) {
    std::string_view key;
    if (!r.str(key, "a key of `$`")) return false;
    int k = 0;
    while (k < count && key != names[k]) ++k;
    if (k == count) return r.fail("Object contains unknown field `" + std::string(key) + "` - at `$`");
    if (seen & (1u << k)) return r.fail("duplicate field `" + std::string(key) + "` - at `$`");
    seen |= 1u << k;
    if (!f(k)) return false;
  }
  return true;
}

// Entry i, [region, offset, length]. `named`: the error names its place (`$.e[i][j]`); those strings are built
// only then: entries_of reads every entry without them and reads a failing one again with them.
bool entry_of(MpReader& r, WireEntry& e, uint32_t i, bool named) {
  const std::string at = named ? "`$.e[" + std::to_string(i) + "]`" : std::string();
  uint32_t three;
  if (!r.array(three, at.c_str())) return false;
  if (three != 3) return r.fail("Expected `array` of length 3 - at " + at);
  uint64_t* v[3] = {&e.region, &e.offset, &e.length};
  for (int j = 0; j < 3; ++j) {
    const std::string f = named ? "`$.e[" + std::to_string(i) + "][" + std::to_string(j) + "]`" : std::string();
    if (!r.uint(*v[j], f.c_str())) return false;
    if (*v[j] > (j == 0 ? 0xffffffffull : kU63)) return r.fail("Expected `int` out of range - at " + f);
  }
  return true;
}

bool entries_of(MpReader& r, std::vector<WireEntry>& out) {
  uint32_t n;
  if (!r.array(n, "`$.e`")) return false;
  if (n < 1 || n > kMaxEntries)
    return r.fail("Expected `array` of length >= 1 and <= " + std::to_string(kMaxEntries) + " - at `$.e`");
  out.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    const MpReader before = r;
    if (entry_of(r, out[i], i, false)) continue;
    r = before;                     // again, for the error that names the entry
    return entry_of(r, out[i], i, true);
  }
  return true;
}

}  // namespace

bool parse_prefix(const uint8_t* p, uint64_t max_frame, uint32_t& hlen, uint64_t& plen, std::string& err) {
  if (std::memcmp(p, kMagic, 4) != 0) {
    err = "bad frame magic (expected b'KVPT')";
    if (std::memcmp(p, "KVPA", 4) == 0) err += " (an authentication handshake: the peer has a shared secret, this process has none)";
    return false;
  }
  hlen = uint32_t(le(p + 4, 4));
  plen = le(p + 8, 8);
  if (hlen == 0 || hlen > kMaxHeader) {
    err = "header length " + std::to_string(hlen) + " outside 1.." + std::to_string(kMaxHeader);
    return false;
  }
  if (plen > max_frame || hlen + plen > max_frame) {
    err = "frame of " + std::to_string(hlen + plen) + " bytes exceeds max_frame " + std::to_string(max_frame);
    return false;
  }
  return true;
}

Decoded decode_request(const uint8_t* h, size_t n, uint64_t plen, uint64_t max_frame, int& op, uint64_t& id,
                       std::vector<WireEntry>& entries, uint64_t& land_by_ms, std::string& err) {
  static const char* const kNames[] = {"v", "op", "id", "e", "c", "dl"};
  MpReader r(h, n);
  uint64_t v = 0, o = 0;
  uint32_t seen = 0;
  land_by_ms = 0;
  bool ok = fields(r, kNames, 6, seen, [&](int k) {
    switch (k) {
      case 0: return r.uint(v, "`$.v`");
      case 1: return r.uint(o, "`$.op`");
      case 2: return r.uint(id, "`$.id`") && (id <= kU63 || r.fail("Expected `int` <= " + std::to_string(kU63) + " - at `$.id`"));
      case 3: return entries_of(r, entries);
      case 5:
        return r.uint(land_by_ms, "`$.dl`") &&
               (land_by_ms <= kU63 || r.fail("Expected `int` <= " + std::to_string(kU63) + " - at `$.dl`"));
      default: return r.fail("control body");   // "c": only an op-4 request has one (Python decodes those)
    }
  });
  if (!ok && r.err() == "control body") return Decoded::kControl;
  if (ok && o == kControl) return Decoded::kControl;
  if (ok && !r.done()) ok = r.fail("trailing bytes after the header");
  if (ok && (seen & 0xf) != 0xf) {
    static const char* const kField[] = {"v", "op", "id", "e"};
    for (int k = 0; k < 4; ++k)
      if (!(seen & (1u << k))) { ok = r.fail(std::string("Object missing required field `") + kField[k] + "`"); break; }
  }
  if (!ok) { err = "malformed request header: " + r.err(); return Decoded::kError; }
  if (v != kVersion) { err = "unknown wire version " + std::to_string(v) + " (this build speaks 1)"; return Decoded::kError; }
  if (o != kWrite && o != kRead) { err = "malformed request header: Expected `int` >= 1 and <= 2 - at `$.op`"; return Decoded::kError; }
  op = int(o);
  uint64_t total = 0;
  for (const auto& e : entries) total = (total + e.length < total) ? ~0ull : total + e.length;
  uint64_t want = op == kWrite ? total : 0;
  if (plen != want) {
    err = "payload of " + std::to_string(plen) + " bytes, entries need " + std::to_string(want);
    return Decoded::kError;
  }
  if (op == kRead && total > max_frame - kMaxHeader) {
    err = "read of " + std::to_string(total) + " bytes exceeds the frame limit " + std::to_string(max_frame - kMaxHeader);
    return Decoded::kError;
  }
  return Decoded::kData;
}

void encode_request(std::string& out, int op, uint64_t id, const WireEntry* e, size_t n, uint64_t payload,
                    uint64_t land_by_ms) {
  std::string head;
  head.reserve(36 + 12 * n);
  MpWriter w(head);
  w.map(land_by_ms ? 5 : 4);
  w.str("v"); w.uint(kVersion);
  w.str("op"); w.uint(uint64_t(op));
  w.str("id"); w.uint(id);
  if (land_by_ms) { w.str("dl"); w.uint(land_by_ms); }
  w.str("e"); w.array(uint32_t(n));
  for (size_t i = 0; i < n; ++i) { w.array(3); w.uint(e[i].region); w.uint(e[i].offset); w.uint(e[i].length); }
  frame(out, head, payload);
}

void encode_response(std::string& out, uint64_t id, const std::vector<std::string>& errs,
                     const std::vector<bool>& ok, uint64_t payload) {
  std::string head;
  MpWriter w(head);
  w.map(4);
  w.str("v"); w.uint(kVersion);
  w.str("op"); w.uint(kResp);
  w.str("id"); w.uint(id);
  w.str("st"); w.array(uint32_t(ok.size()));
  for (size_t i = 0; i < ok.size(); ++i) {
    if (ok[i]) w.nil(); else w.str(errs[i]);
  }
  frame(out, head, payload);
}

bool decode_response(const uint8_t* h, size_t n, uint64_t id, size_t count, std::vector<bool>& ok,
                     std::vector<std::string>& errs, bool& refused, std::string& err) {
  static const char* const kNames[] = {"v", "op", "id", "st", "c"};
  MpReader r(h, n);
  uint64_t v = 0, o = 0, got = ~0ull;
  std::vector<bool> k_ok;
  std::vector<std::string> k_errs;
  uint32_t seen = 0;
  refused = false;
  bool fine = fields(r, kNames, 5, seen, [&](int k) {
    switch (k) {
      case 0: return r.uint(v, "`$.v`");
      case 1: return r.uint(o, "`$.op`");
      case 2: return r.uint(got, "`$.id`");
      case 3: {
        uint32_t m;
        if (!r.array(m, "`$.st`")) return false;
        if (m > kMaxEntries) return r.fail("too many statuses at `$.st`");
        k_ok.assign(m, true);
        k_errs.assign(m, std::string());
        for (uint32_t i = 0; i < m; ++i) {
          if (r.is_nil()) continue;
          std::string_view s;
          if (!r.str(s, "`$.st[]`")) return false;
          if (s.size() > 4 * kMaxStatus) return r.fail("status text too long at `$.st`");
          k_ok[i] = false;
          k_errs[i] = std::string(s);
        }
        return true;
      }
      default: return r.fail("a control reply where a data response was expected");
    }
  });
  if (fine && !r.done()) fine = r.fail("trailing bytes after the header");
  if (fine && (seen & 0xf) != 0xf) fine = r.fail("a required field is missing");
  if (!fine) { err = "malformed response header: " + r.err(); return false; }
  if (v != kVersion) { err = "unknown wire version " + std::to_string(v) + " (this build speaks 1)"; return false; }
  if (got == 0 && k_ok.size() == 1 && !k_ok[0] && id != 0) {
    refused = true;
    err = "refused the connection: " + k_errs[0];
    return false;
  }
  if (o != kResp || got != id) {
    err = "expected response to request " + std::to_string(id) + ", got op=" + std::to_string(o) + " id=" + std::to_string(got);
    return false;
  }
  if (k_ok.size() != count) {
    err = "status has " + std::to_string(k_ok.size()) + " items for " + std::to_string(count) + " entries";
    return false;
  }
  ok.swap(k_ok);
  errs.swap(k_errs);
  return true;
}

}  // namespace kvp::tcp
