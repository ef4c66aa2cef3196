#include "shards.h"

#include <algorithm>

#include "frames.h"
#include "one_op.h"

namespace kvp::store {

std::vector<ShardAnswer> shard_exists(const std::vector<int>& fds, const std::vector<uint64_t>& rids,
                                      const std::vector<std::string>& keys, const uint64_t* points,
                                      const uint32_t* point_shard, size_t npoints, double timeout_ms,
                                      const HashOps* ops, uint8_t* out) {
  const size_t shards = fds.size();
  std::vector<std::vector<uint32_t>> mine(shards);
  for (size_t k = 0; k < keys.size(); ++k) {
    const uint64_t addr = reinterpret_cast<uint64_t>(keys[k].data()), len = keys[k].size();
    const uint64_t h = ops->hash_spans(&addr, &len, 1);
    size_t i = size_t(std::lower_bound(points, points + npoints, h) - points);
    mine[point_shard[i == npoints ? 0 : i]].push_back(uint32_t(k));
    out[k] = 2;
  }
  std::vector<ShardAnswer> answers(shards, ShardAnswer{kNotSent, {}});
  std::vector<Conn> conns;
  std::vector<size_t> shard_of;
  for (size_t s = 0; s < shards; ++s) {
    if (mine[s].empty()) continue;
    conns.push_back(Conn{fds[s], request(rids[s], "exists", [&](tcp::MpWriter& w) {
                           w.array(uint32_t(mine[s].size()));
                           for (uint32_t k : mine[s]) w.str(keys[k]);
                           w.map(0);
                         })});
    shard_of.push_back(s);
  }
  exchange(conns, deadline_in(timeout_ms));
  for (size_t c = 0; c < conns.size(); ++c) {
    const size_t s = shard_of[c];
    ShardAnswer& a = answers[s];
    a.text = std::move(conns[c].body);
    if (conns[c].status != kReplied) { a.status = conns[c].status; continue; }
    a.status = kAsPython;
    tcp::MpReader r(reinterpret_cast<const uint8_t*>(a.text.data()), a.text.size());
    uint32_t n;
    if (!accepted(r, rids[s]) || !r.array(n, "payload") || n != mine[s].size()) continue;
    std::vector<uint8_t> got(n);
    bool b = false, ok = true;
    for (uint32_t j = 0; j < n && ok; ++j) {
      ok = r.boolean(b, "exists");
      got[j] = b ? 1 : 0;
    }
    if (!ok || !r.done()) continue;
    for (uint32_t j = 0; j < n; ++j) out[mine[s][j]] = got[j];
    a.status = kDone;
    a.text.clear();
  }
  return answers;
}

}  // namespace kvp::store
