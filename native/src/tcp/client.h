// The TCP transport's client side (kvplugins/transfer/tcp.py wraps it): one batch of one-sided reads or
// writes to one peer, cut into frames spread over the given connections (already connected and
// authenticated by Python), all driven by one poll loop in the calling thread with the GIL released.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace kvp::tcp {

// kAuth: the peer answered with an authentication handshake message (it has a shared secret); the text is
// the hex of the 16 bytes it sent, which Python decodes (security/handshake.py check_refused).
// kTimeout: the batch's deadline passed (Python names the timeout it was given).
enum SpanCode : uint8_t { kOk = 0, kServer = 1, kFailed = 2, kRetry = 3, kAuth = 4, kTimeout = 5 };

struct Batch {
  int op;                                   // kWrite or kRead
  const uint64_t *addrs, *regions, *offs, *lens;
  size_t n;
  uint64_t limit;                           // payload bytes per frame (peer's and our max_frame, less header)
  uint64_t max_frame;                       // our max_frame (a response frame over it is a protocol error)
  double timeout_s;
  uint64_t land_by_ms;                      // writes: unix ms the peer drops this batch's bytes after (0: none)
};

struct Result {
  std::vector<uint8_t> code;                // per span: SpanCode
  std::vector<std::string> text;            // per span: the server's error or the connection's failure
  std::vector<uint8_t> broken;              // per connection: 1 = close it (failed mid-use)
};

// kRetry: the connection was an idle pooled one (`reused`) that failed before any byte of its first
// response (the server had closed it): the span is worth one retry on a fresh connection.
Result transfer(const Batch& b, const std::vector<int>& fds, const std::vector<uint8_t>& reused,
                std::atomic<uint64_t>& ids);

// Baseline for the benchmark: seconds to move `nbytes` once over a plain loopback TCP connection between two
// threads (send / recv of one buffer, TCP_NODELAY), per round.
std::vector<double> loopback_baseline(uint64_t nbytes, int rounds);

}  // namespace kvp::tcp
