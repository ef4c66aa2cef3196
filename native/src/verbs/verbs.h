// The RDMA transport's verbs layer (kvplugins._verbs): devices, memory regions, RC queue pairs, and batches of
// one-sided READ/WRITE work requests posted and completed in C++ with the GIL released.
//
// libibverbs is loaded at run time (dlopen of libibverbs.so.1), so the module imports on a host without it;
// the first call that needs it raises VerbsError naming what is missing. Only verbs.h's structures and its
// inline data-path calls (ibv_post_send, ibv_poll_cq, ibv_req_notify_cq: calls through the context's ops
// table) are compiled in; every exported libibverbs function is called through the loaded table.
// Sources: ibv_post_send(3), ibv_poll_cq(3), ibv_modify_qp(3), ibv_create_comp_channel(3), ibv_get_cq_event(3)
// (RC INIT -> RTR -> RTS as in rdma-core's libibverbs/examples/rc_pingpong.c).
#pragma once
#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvp::verbs {

struct VerbsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// "" when libibverbs is loaded, else why not (and the fix).
const std::string& load_error();

struct PortAttr {
  int state, active_mtu, lid, link_layer;  // ibv_port_state, ibv_mtu, LID, IBV_LINK_LAYER_*
};

class Context;
struct Work;

class MemoryRegion {
 public:
  MemoryRegion(std::shared_ptr<Context> ctx, uint64_t addr, uint64_t length, int access);
  ~MemoryRegion();
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }
  void close();

 private:
  std::shared_ptr<Context> ctx_;
  ibv_mr* mr_;
};

// One opened device, its protection domain and one completion channel that every CQ on it reports to (one file
// descriptor per device, not per queue pair). Closed when the last MR and QP holding it are.
class Context {
 public:
  explicit Context(const std::string& name);
  ~Context();
  PortAttr query_port(int port);
  ibv_context* ctx() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }
  ibv_comp_channel* channel() const { return ch_; }

 private:
  void release();
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* ch_ = nullptr;
};

struct Connect {
  int path_mtu;  // enum ibv_mtu
  uint32_t dest_qpn, rq_psn, sq_psn;
  std::string dgid;  // 16 bytes, or "" for an InfiniBand LID route
  int dlid, sgid_index, port;
};

// One RC QP with its own CQ (reporting to its device's completion channel); created in INIT.
class QueuePair {
 public:
  QueuePair(std::shared_ptr<Context> ctx, int depth, int port);
  ~QueuePair();
  uint32_t qpn() const { return qp_->qp_num; }
  int depth() const { return depth_; }
  void connect(const Connect& c);
  void kill();   // to the error state: outstanding work is flushed, the NIC stops touching its memory
  void close();  // waits for a batch running on it (bounded by that batch's deadline)
  bool dead() const { return dead_.load(std::memory_order_relaxed); }
  ibv_qp* qp() const { return qp_; }
  ibv_cq* cq() const { return cq_; }
  ibv_comp_channel* channel() const { return ctx_ ? ctx_->channel() : nullptr; }

 private:
  std::shared_ptr<Context> ctx_;
  int depth_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  std::atomic<bool> dead_{false};  // read by FastRoutes::run without the busy_ lock
  std::mutex busy_;  // held by run() for the batch
  friend size_t run(bool, std::vector<Work>&, double, size_t);
  friend class FastRoutes;
};

// One work request: length bytes between local (laddr, lkey) and remote (raddr, rkey).
struct Chunk {
  uint64_t laddr, raddr;
  uint32_t lkey, rkey, length;
};

// The chunks one QP runs in a batch and how far it got: done confirmed, posted posted; error "" if none.
struct Work {
  QueuePair* qp;
  std::vector<Chunk> chunks;
  size_t done = 0, posted = 0;
  double finished_at = 0;  // CLOCK_MONOTONIC seconds (Python's time.monotonic())
  std::string error;
};

// Posts and completes every work's chunks by deadline_at (CLOCK_MONOTONIC s): spins while completions come,
// then waits on the CQs' completion channels (an idle wait burns no core). A QP that fails (error completion,
// post refused, deadline) is moved to the error state with work.error set. Returns work requests posted.
size_t run(bool read, std::vector<Work>& works, double deadline_at, size_t signal_every);
// run() for a caller that holds every work's queue pair (FastRoutes: its try_lock).
size_t run_held(bool read, std::vector<Work>& works, double deadline_at, size_t signal_every);

double monotonic_s();

}  // namespace kvp::verbs
