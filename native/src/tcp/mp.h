// Minimal msgpack reader/writer for the transfer wire's headers (kvplugins/transfer/wire.py) and the master's
// native front (native/src/meta/serve.cpp): maps with str keys, ints, bools, arrays, nil and str. Anything
// else is an error naming the field; never reads past `end`.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace kvp::tcp {

class MpReader {
 public:
  MpReader(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}
  bool done() const { return p_ == end_; }
  // Each returns false (with err() set) on a type mismatch or truncation.
  bool map(uint32_t& n, const char* what) { return container(0x80, 0xde, 0xdf, n, what, "map"); }
  bool array(uint32_t& n, const char* what) { return container(0x90, 0xdc, 0xdd, n, what, "array"); }
  bool is_nil() { if (p_ < end_ && *p_ == 0xc0) { ++p_; return true; } return false; }
  bool str(std::string_view& s, const char* what);
  bool uint(uint64_t& v, const char* what);
  bool sint(int64_t& v, const char* what);   // any int encoding of a value in int64
  bool boolean(bool& v, const char* what);
  // Any one value (containers nested at most 32 deep), unchecked beyond its encoding.
  bool skip(const char* what, int depth = 0);
  const std::string& err() const { return err_; }
  bool fail(std::string msg) { if (err_.empty()) err_ = std::move(msg); return false; }

 private:
  bool need(size_t n) { return size_t(end_ - p_) >= n; }
  uint64_t be(int n) { uint64_t v = 0; for (int i = 0; i < n; ++i) v = (v << 8) | *p_++; return v; }
  bool container(uint8_t fix, uint8_t b16, uint8_t b32, uint32_t& n, const char* what, const char* kind);
  const uint8_t* p_;
  const uint8_t* end_;
  std::string err_;
};

inline bool MpReader::container(uint8_t fix, uint8_t b16, uint8_t b32, uint32_t& n, const char* what,
                                const char* kind) {
  if (!need(1)) return fail(std::string("truncated header at ") + what);
  uint8_t t = *p_;
  if ((t & 0xf0) == fix) { ++p_; n = t & 0x0f; return true; }
  if (t == b16 && need(3)) { ++p_; n = uint32_t(be(2)); return true; }
  if (t == b32 && need(5)) { ++p_; n = uint32_t(be(4)); return true; }
  return fail(std::string("expected ") + kind + " at " + what);
}

inline bool MpReader::str(std::string_view& s, const char* what) {
  if (!need(1)) return fail(std::string("truncated header at ") + what);
  uint8_t t = *p_;
  uint64_t n;
  if ((t & 0xe0) == 0xa0) { ++p_; n = t & 0x1f; }
  else if (t == 0xd9 && need(2)) { ++p_; n = be(1); }
  else if (t == 0xda && need(3)) { ++p_; n = be(2); }
  else if (t == 0xdb && need(5)) { ++p_; n = be(4); }
  else return fail(std::string("expected str at ") + what);
  if (!need(n)) return fail(std::string("truncated str at ") + what);
  s = std::string_view(reinterpret_cast<const char*>(p_), n);
  p_ += n;
  return true;
}

inline bool MpReader::uint(uint64_t& v, const char* what) {
  if (!need(1)) return fail(std::string("truncated header at ") + what);
  uint8_t t = *p_;
  if (t < 0x80) { ++p_; v = t; return true; }
  static const int kWidth[4] = {1, 2, 4, 8};
  if (t >= 0xcc && t <= 0xcf && need(1 + kWidth[t - 0xcc])) { ++p_; v = be(kWidth[t - 0xcc]); return true; }
  if (t >= 0xd0 && t <= 0xd3 && need(1 + kWidth[t - 0xd0])) {   // a signed encoding of a non-negative value
    int w = kWidth[t - 0xd0];
    ++p_;
    uint64_t raw = be(w);
    if (raw >> (8 * w - 1)) return fail(std::string("expected an int >= 0 at ") + what);
    v = raw;
    return true;
  }
  if (t >= 0xe0) return fail(std::string("expected an int >= 0 at ") + what);
  return fail(std::string("expected int at ") + what);
}

inline bool MpReader::sint(int64_t& v, const char* what) {
  if (need(1) && *p_ >= 0xe0) { v = int8_t(*p_++); return true; }
  if (need(1) && *p_ >= 0xd0 && *p_ <= 0xd3) {
    static const int kWidth[4] = {1, 2, 4, 8};
    const int w = kWidth[*p_ - 0xd0];
    if (!need(1 + w)) return fail(std::string("truncated int at ") + what);
    ++p_;
    const uint64_t raw = be(w);
    v = w == 8 ? int64_t(raw) : int64_t(raw << (64 - 8 * w)) >> (64 - 8 * w);   // sign-extend
    return true;
  }
  uint64_t u;
  if (!uint(u, what)) return false;
  if (u > uint64_t(INT64_MAX)) return fail(std::string("int out of range at ") + what);
  v = int64_t(u);
  return true;
}

inline bool MpReader::boolean(bool& v, const char* what) {
  if (need(1) && (*p_ == 0xc2 || *p_ == 0xc3)) { v = *p_++ == 0xc3; return true; }
  return fail(std::string("expected bool at ") + what);
}

inline bool MpReader::skip(const char* what, int depth) {
  if (depth > 32) return fail(std::string("values nested over 32 deep at ") + what);
  if (!need(1)) return fail(std::string("truncated value at ") + what);
  const uint8_t t = *p_;
  uint32_t n;
  std::string_view s;
  uint64_t v;
  if (t < 0x80 || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) { ++p_; return true; }
  if ((t & 0xf0) == 0x80 || t == 0xde || t == 0xdf) {
    if (!map(n, what)) return false;
    for (uint64_t i = 0; i < 2ull * n; ++i) if (!skip(what, depth + 1)) return false;
    return true;
  }
  if ((t & 0xf0) == 0x90 || t == 0xdc || t == 0xdd) {
    if (!array(n, what)) return false;
    for (uint32_t i = 0; i < n; ++i) if (!skip(what, depth + 1)) return false;
    return true;
  }
  if ((t & 0xe0) == 0xa0 || (t >= 0xd9 && t <= 0xdb)) return str(s, what);
  if ((t >= 0xcc && t <= 0xcf) || (t >= 0xd0 && t <= 0xd3)) {
    static const int kWidth[4] = {1, 2, 4, 8};
    const size_t w = kWidth[(t - 0xcc) & 3];
    if (!need(1 + w)) return fail(std::string("truncated int at ") + what);
    p_ += 1 + w;
    return true;
  }
  if (t == 0xca || t == 0xcb) {
    const size_t w = t == 0xca ? 4 : 8;
    if (!need(1 + w)) return fail(std::string("truncated float at ") + what);
    p_ += 1 + w;
    return true;
  }
  if (t >= 0xc4 && t <= 0xc6) {   // bin 8/16/32
    const int w = 1 << (t - 0xc4);
    if (!need(1 + w)) return fail(std::string("truncated bin at ") + what);
    ++p_;
    v = be(w);
    if (!need(v)) return fail(std::string("truncated bin at ") + what);
    p_ += v;
    return true;
  }
  return fail(std::string("unsupported msgpack type at ") + what);
}

class MpWriter {
 public:
  explicit MpWriter(std::string& out) : o_(out) {}
  void map(uint32_t n) { head(0x80, 0xde, 0xdf, n, 16); }
  void array(uint32_t n) { head(0x90, 0xdc, 0xdd, n, 16); }
  void nil() { o_.push_back(char(0xc0)); }
  void boolean(bool b) { o_.push_back(char(b ? 0xc3 : 0xc2)); }
  void sint(int64_t v) {   // the shortest encoding, as msgpack encoders write it
    if (v >= 0) return uint(uint64_t(v));
    if (v >= -32) { o_.push_back(char(int8_t(v))); return; }
    if (v >= INT8_MIN) { o_.push_back(char(0xd0)); be(uint64_t(v), 1); return; }
    if (v >= INT16_MIN) { o_.push_back(char(0xd1)); be(uint64_t(v), 2); return; }
    if (v >= INT32_MIN) { o_.push_back(char(0xd2)); be(uint64_t(v), 4); return; }
    o_.push_back(char(0xd3));
    be(uint64_t(v), 8);
  }
  void str(std::string_view s) {
    size_t n = s.size();
    if (n < 32) o_.push_back(char(0xa0 | n));
    else if (n < 256) { o_.push_back(char(0xd9)); be(n, 1); }
    else if (n < 65536) { o_.push_back(char(0xda)); be(n, 2); }
    else { o_.push_back(char(0xdb)); be(n, 4); }
    o_.append(s);
  }
  void uint(uint64_t v) {
    if (v < 0x80) o_.push_back(char(v));
    else if (v < 0x100) { o_.push_back(char(0xcc)); be(v, 1); }
    else if (v < 0x10000) { o_.push_back(char(0xcd)); be(v, 2); }
    else if (v < 0x100000000ull) { o_.push_back(char(0xce)); be(v, 4); }
    else { o_.push_back(char(0xcf)); be(v, 8); }
  }

 private:
  void be(uint64_t v, int n) { for (int i = n - 1; i >= 0; --i) o_.push_back(char((v >> (8 * i)) & 0xff)); }
  void head(uint8_t fix, uint8_t b16, uint8_t b32, uint32_t n, uint32_t small) {
    if (n < small) o_.push_back(char(fix | n));
    else if (n < 65536) { o_.push_back(char(b16)); be(n, 2); }
    else { o_.push_back(char(b32)); be(n, 4); }
  }
  std::string& o_;
};

}  // namespace kvp::tcp
