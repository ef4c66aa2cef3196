// The transfer wire, version 1 (kvplugins/transfer/wire.py is the specification): frame prefix, request and
// response headers. Decoders are strict (unknown, missing or duplicate fields, wrong types and out-of-range
// values are errors naming the field) and never read past the bytes given.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kvp::tcp {

constexpr uint32_t kVersion = 1;
constexpr size_t kPrefix = 16;
constexpr uint32_t kMaxHeader = 256u << 10;
constexpr uint32_t kMaxEntries = 4096;
constexpr size_t kMaxStatus = 4096;
constexpr uint64_t kU63 = (1ull << 63) - 1;
enum Op : int { kWrite = 1, kRead = 2, kResp = 3, kControl = 4 };

struct WireEntry { uint64_t region, offset, length; };

// How many bytes a frame's head read may take into `room` bytes of buffer, `have` of the frame already there
// (`sized`: its prefix, hlen and plen among them). The rest of the header, and of a payload of at most
// kInlinePayload bytes the payload too (a small frame in one recv); of a larger payload nothing, since it is
// received straight into its destination and bytes read here would be copied once more (a 512 KiB write
// frame read with 64 KiB heads spent ~12% of its receiving CPU on that copy). Before the prefix: kFirstRead.
constexpr size_t kFirstRead = 8u << 10, kInlinePayload = 8u << 10;
inline size_t head_read(size_t have, bool sized, uint32_t hlen, uint64_t plen, size_t room) {
  size_t want = kFirstRead;
  if (sized) want = kPrefix + hlen + (plen <= kInlinePayload ? plen : 0);
  return want > have ? (want - have < room ? want - have : room) : room;
}

// (header_len, payload_len) of a prefix; false with `err` on bad magic or sizes.
bool parse_prefix(const uint8_t* p, uint64_t max_frame, uint32_t& hlen, uint64_t& plen, std::string& err);

enum class Decoded { kData, kControl, kError };
// A data request (op 1/2) into op/id/entries/land_by_ms (its "dl": unix ms a write's bytes must land by, 0
// when absent), with the payload checks; kControl for an op-4 request (decoded by Python,
// wire.decode_request); kError with `err`.
Decoded decode_request(const uint8_t* h, size_t n, uint64_t plen, uint64_t max_frame, int& op, uint64_t& id,
                       std::vector<WireEntry>& entries, uint64_t& land_by_ms, std::string& err);

// Prefix + header of a request frame (the write payload follows on the socket); "dl" only when land_by_ms.
void encode_request(std::string& out, int op, uint64_t id, const WireEntry* e, size_t n, uint64_t payload,
                    uint64_t land_by_ms = 0);

// Prefix + header of a response; status[i] empty (ok[i]) means None.
void encode_response(std::string& out, uint64_t id, const std::vector<std::string>& errs,
                     const std::vector<bool>& ok, uint64_t payload);

// A response header for request `id` with `n` entries: per-entry ok flags and error texts. A refusal (id 0,
// one status) sets `refused` and `err` to its reason.
bool decode_response(const uint8_t* h, size_t n, uint64_t id, size_t entries, std::vector<bool>& ok,
                     std::vector<std::string>& errs, bool& refused, std::string& err);

}  // namespace kvp::tcp
