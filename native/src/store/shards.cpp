#include "shards.h"

#include <algorithm>

#include "frames.h"
#include "one_op.h"

namespace kvp::store {
namespace {

// Per shard, the indices of the keys it owns (caller's order).
std::vector<std::vector<uint32_t>> split(size_t nkeys, size_t shards, const uint32_t* owner) {
  std::vector<std::vector<uint32_t>> mine(shards);
  for (size_t k = 0; k < nkeys; ++k) mine[owner[k]].push_back(uint32_t(k));
  return mine;
}

// `op` with each shard's keys sent on its connection and every reply read; answers[s] holds the reply body
// (kAsPython), what failed (kIoError / kTimeout), or kNotSent.
std::vector<ShardAnswer> fan(const std::vector<int>& fds, const std::vector<uint64_t>& rids, const char* op,
                             const std::vector<std::string_view>& keys, const std::vector<std::vector<uint32_t>>& mine,
                             double timeout_ms) {
  std::vector<ShardAnswer> answers(fds.size(), ShardAnswer{kNotSent, {}});
  std::vector<Conn> conns;
  std::vector<size_t> shard_of;
  for (size_t s = 0; s < fds.size(); ++s) {
    if (mine[s].empty()) continue;
    conns.push_back(Conn{fds[s], request(rids[s], op, [&](tcp::MpWriter& w) {
                           w.array(uint32_t(mine[s].size()));
                           for (uint32_t k : mine[s]) w.str(keys[k]);
                           w.map(0);
                         })});
    shard_of.push_back(s);
  }
  exchange(conns, deadline_in(timeout_ms));
  for (size_t c = 0; c < conns.size(); ++c) {
    ShardAnswer& a = answers[shard_of[c]];
    a.status = conns[c].status == kReplied ? kAsPython : conns[c].status;
    a.text = std::move(conns[c].body);
  }
  return answers;
}

// The exists flags of shard s's reply into `out`; false (out untouched) for a refusal or a malformed reply.
bool merge_flags(const std::string& body, uint64_t rid, const std::vector<uint32_t>& mine, uint8_t* out) {
  tcp::MpReader r(reinterpret_cast<const uint8_t*>(body.data()), body.size());
  uint32_t n;
  if (!accepted(r, rid) || !r.array(n, "payload") || n != mine.size()) return false;
  std::vector<uint8_t> got(n);
  bool b = false;
  for (uint32_t j = 0; j < n; ++j) {
    if (!r.boolean(b, "exists")) return false;
    got[j] = b ? 1 : 0;
  }
  if (!r.done()) return false;
  for (uint32_t j = 0; j < n; ++j) out[mine[j]] = got[j];
  return true;
}

}  // namespace

void ring_owners(const std::vector<std::string_view>& keys, const Ring& ring, const HashOps* ops, uint32_t* owner) {
  for (size_t k = 0; k < keys.size(); ++k) {
    const uint64_t addr = reinterpret_cast<uint64_t>(keys[k].data()), len = keys[k].size();
    const uint64_t h = ops->hash_spans(&addr, &len, 1);
    const size_t i = size_t(std::lower_bound(ring.points, ring.points + ring.npoints, h) - ring.points);
    owner[k] = ring.point_shard[i == ring.npoints ? 0 : i];
  }
}

std::vector<ShardAnswer> shard_exists(const std::vector<int>& fds, const std::vector<uint64_t>& rids,
                                      const std::vector<std::string_view>& keys, const uint32_t* owner, double timeout_ms,
                                      uint8_t* out) {
  const auto mine = split(keys.size(), fds.size(), owner);
  std::fill(out, out + keys.size(), uint8_t(2));
  auto answers = fan(fds, rids, "exists", keys, mine, timeout_ms);
  for (size_t s = 0; s < answers.size(); ++s) {
    if (answers[s].status == kAsPython && merge_flags(answers[s].text, rids[s], mine[s], out)) {
      answers[s].status = kDone;
      answers[s].text.clear();
    }
  }
  return answers;
}

std::vector<ShardAnswer> shard_call(const std::vector<int>& fds, const std::vector<uint64_t>& rids,
                                    const std::string& op, const std::vector<std::string_view>& keys,
                                    const uint32_t* owner, double timeout_ms) {
  return fan(fds, rids, op.c_str(), keys, split(keys.size(), fds.size(), owner), timeout_ms);
}

}  // namespace kvp::store
