// The verbs layer (see verbs.h): libibverbs loaded at run time, devices, MRs, RC QPs, and the batch loop.
#include "verbs.h"

#include <atomic>

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

namespace kvp::verbs {
namespace {

// The exported libibverbs functions this layer calls (verbs.h's inline data-path calls need none of them).
struct Api {
  ibv_device** (*get_device_list)(int*);
  void (*free_device_list)(ibv_device**);
  const char* (*get_device_name)(ibv_device*);
  ibv_context* (*open_device)(ibv_device*);
  int (*close_device)(ibv_context*);
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*);
  ibv_pd* (*alloc_pd)(ibv_context*);
  int (*dealloc_pd)(ibv_pd*);
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int);
  int (*dereg_mr)(ibv_mr*);
  ibv_comp_channel* (*create_comp_channel)(ibv_context*);
  int (*destroy_comp_channel)(ibv_comp_channel*);
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int);
  int (*destroy_cq)(ibv_cq*);
  int (*get_cq_event)(ibv_comp_channel*, ibv_cq**, void**);
  void (*ack_cq_events)(ibv_cq*, unsigned);
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*);
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int);
  int (*destroy_qp)(ibv_qp*);
  std::string error;
};

template <class F>
void sym(void* lib, const char* name, F& fn, std::string& error) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!fn && error.empty()) error = std::string("libibverbs.so.1 lacks ") + name + " (rdma-core too old: install 28 or newer)";
}

Api load() {
  Api a{};
  void* lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    a.error = std::string("libibverbs.so.1 cannot be loaded (") + dlerror() +
              "): apt-get install libibverbs1 ibverbs-providers (rdma-core)";
    return a;
  }
  sym(lib, "ibv_get_device_list", a.get_device_list, a.error);
  sym(lib, "ibv_free_device_list", a.free_device_list, a.error);
  sym(lib, "ibv_get_device_name", a.get_device_name, a.error);
  sym(lib, "ibv_open_device", a.open_device, a.error);
  sym(lib, "ibv_close_device", a.close_device, a.error);
  sym(lib, "ibv_query_port", a.query_port, a.error);
  sym(lib, "ibv_alloc_pd", a.alloc_pd, a.error);
  sym(lib, "ibv_dealloc_pd", a.dealloc_pd, a.error);
  sym(lib, "ibv_reg_mr", a.reg_mr, a.error);
  sym(lib, "ibv_dereg_mr", a.dereg_mr, a.error);
  sym(lib, "ibv_create_comp_channel", a.create_comp_channel, a.error);
  sym(lib, "ibv_destroy_comp_channel", a.destroy_comp_channel, a.error);
  sym(lib, "ibv_create_cq", a.create_cq, a.error);
  sym(lib, "ibv_destroy_cq", a.destroy_cq, a.error);
  sym(lib, "ibv_get_cq_event", a.get_cq_event, a.error);
  sym(lib, "ibv_ack_cq_events", a.ack_cq_events, a.error);
  sym(lib, "ibv_create_qp", a.create_qp, a.error);
  sym(lib, "ibv_modify_qp", a.modify_qp, a.error);
  sym(lib, "ibv_destroy_qp", a.destroy_qp, a.error);
  return a;
}

const Api& api() {
  static const Api a = load();
  return a;
}

const Api& need() {
  const Api& a = api();
  if (!a.error.empty()) throw VerbsError(a.error);
  return a;
}

std::string failed(const std::string& what, int err) { return what + " failed: " + std::strerror(err); }

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
constexpr uint8_t kTimeout = 14, kRetry = 7, kRnrRetry = 7, kRdAtomic = 16;  // 4.096 us * 2^14 = 67 ms a try
// Adaptive spin: after the last completion a batch spins this long before it waits on the channels: twice the
// process's recent completion gap (an EWMA of the time from a post, or the previous completion, to the next
// completion), within [kSpinMinS, kSpinMaxS]. On a real NIC the gap is microseconds and the spin its floor; on a
// slow device (soft-RoCE under emulation: ~150 us a 4 KiB READ) it covers one completion, so a small read does
// not pay a sleep and a wake-up on top of it; an idle process spins not at all.
constexpr double kSpinMinS = 100e-6, kSpinMaxS = 2e-3;
std::atomic<double> g_gap_s{0};

double spin_s() { return std::clamp(2 * g_gap_s.load(std::memory_order_relaxed), kSpinMinS, kSpinMaxS); }

void gap_seen(double s) {
  const double old = g_gap_s.load(std::memory_order_relaxed);
  g_gap_s.store(old == 0 ? s : 0.875 * old + 0.125 * s, std::memory_order_relaxed);
}
// One wait on the channels at most: the deadline is checked between, and a batch whose event another batch on
// the same device took (between its last poll and its wait) re-polls within this.
constexpr double kWaitMaxS = 0.005;

const char* wc_name(int status) {
  switch (status) {
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "local QP operation error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "flushed";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    default: return "error";
  }
}

}  // namespace

const std::string& load_error() { return api().error; }

double monotonic_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// ---- Context ------------------------------------------------------------------------------------------------
Context::Context(const std::string& name) {
  const Api& a = need();
  int n = 0;
  ibv_device** list = a.get_device_list(&n);
  if (!list) throw VerbsError(failed("ibv_get_device_list", errno));
  ibv_device* dev = nullptr;
  for (int i = 0; i < n && !dev; ++i)
    if (name == a.get_device_name(list[i])) dev = list[i];
  if (!dev) {
    a.free_device_list(list);
    throw VerbsError("no RDMA device named " + name + " (ibv_devices lists them)");
  }
  ctx_ = a.open_device(dev);
  const int err = errno;
  a.free_device_list(list);
  if (!ctx_) throw VerbsError(failed("ibv_open_device(" + name + ")", err));
  try {
    pd_ = a.alloc_pd(ctx_);
    if (!pd_) throw VerbsError(failed("ibv_alloc_pd(" + name + ")", errno));
    ch_ = a.create_comp_channel(ctx_);
    if (!ch_) throw VerbsError(failed("ibv_create_comp_channel(" + name + ")", errno));
    const int fl = fcntl(ch_->fd, F_GETFL);  // non-blocking: several batches may wait on it, one takes an event
    if (fl < 0 || fcntl(ch_->fd, F_SETFL, fl | O_NONBLOCK) < 0) throw VerbsError(failed("fcntl(O_NONBLOCK)", errno));
  } catch (...) {
    release();
    throw;
  }
}

Context::~Context() { release(); }

void Context::release() {
  const Api& a = api();
  if (ch_) a.destroy_comp_channel(ch_);
  if (pd_) a.dealloc_pd(pd_);
  if (ctx_) a.close_device(ctx_);
  ch_ = nullptr, pd_ = nullptr, ctx_ = nullptr;
}

PortAttr Context::query_port(int port) {
  ibv_port_attr at{};
  const int rc = api().query_port(ctx_, uint8_t(port), &at);
  if (rc) throw VerbsError(failed("ibv_query_port(port " + std::to_string(port) + ")", rc));
  return {int(at.state), int(at.active_mtu), int(at.lid), int(at.link_layer)};
}

// ---- MemoryRegion -------------------------------------------------------------------------------------------
MemoryRegion::MemoryRegion(std::shared_ptr<Context> ctx, uint64_t addr, uint64_t length, int access)
    : ctx_(std::move(ctx)) {
  mr_ = need().reg_mr(ctx_->pd(), reinterpret_cast<void*>(addr), length, access);
  if (!mr_)
    throw VerbsError(failed("ibv_reg_mr of " + std::to_string(length) + " bytes", errno) +
                     (errno == ENOMEM ? " (RLIMIT_MEMLOCK too low? kvplugins doctor)" : ""));
}

MemoryRegion::~MemoryRegion() { close(); }

void MemoryRegion::close() {
  if (mr_) api().dereg_mr(mr_);
  mr_ = nullptr;
  ctx_.reset();
}

// ---- QueuePair ----------------------------------------------------------------------------------------------
QueuePair::QueuePair(std::shared_ptr<Context> ctx, int depth, int port) : ctx_(std::move(ctx)), depth_(depth) {
  if (depth < 1) throw std::invalid_argument("queue depth must be >= 1, got " + std::to_string(depth));
  const Api& a = need();
  try {
    cq_ = a.create_cq(ctx_->ctx(), depth + 1, nullptr, ctx_->channel(), 0);
    if (!cq_) throw VerbsError(failed("ibv_create_cq", errno));
    ibv_qp_init_attr ia{};
    ia.send_cq = ia.recv_cq = cq_;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = uint32_t(depth);
    ia.cap.max_recv_wr = ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
    qp_ = a.create_qp(ctx_->pd(), &ia);
    if (!qp_) throw VerbsError(failed("ibv_create_qp (RC, depth " + std::to_string(depth) + ")", errno));
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_INIT;
    at.port_num = uint8_t(port);
    at.qp_access_flags = kAccess;
    const int rc = a.modify_qp(qp_, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc) throw VerbsError(failed("ibv_modify_qp(INIT)", rc));
  } catch (...) {
    close();
    throw;
  }
}

QueuePair::~QueuePair() { close(); }

void QueuePair::connect(const Connect& c) {
  const Api& a = need();
  if (!qp_) throw VerbsError("connect on a closed queue pair");
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_RTR;
  at.path_mtu = ibv_mtu(c.path_mtu);
  at.dest_qp_num = c.dest_qpn;
  at.rq_psn = c.rq_psn;
  at.max_dest_rd_atomic = kRdAtomic;
  at.min_rnr_timer = 12;
  at.ah_attr.port_num = uint8_t(c.port);
  at.ah_attr.dlid = uint16_t(c.dlid);
  if (!c.dgid.empty()) {
    if (c.dgid.size() != 16) throw std::invalid_argument("a GID is 16 bytes, got " + std::to_string(c.dgid.size()));
    at.ah_attr.is_global = 1;
    std::memcpy(at.ah_attr.grh.dgid.raw, c.dgid.data(), 16);
    at.ah_attr.grh.sgid_index = uint8_t(c.sgid_index);
    at.ah_attr.grh.hop_limit = 64;
  }
  int rc = a.modify_qp(qp_, &at,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc) throw VerbsError(failed("ibv_modify_qp(RTR)", rc));
  ibv_qp_attr rts{};
  rts.qp_state = IBV_QPS_RTS;
  rts.timeout = kTimeout;
  rts.retry_cnt = kRetry;
  rts.rnr_retry = kRnrRetry;
  rts.sq_psn = c.sq_psn;
  rts.max_rd_atomic = kRdAtomic;
  rc = a.modify_qp(qp_, &rts,
                   IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                       IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc) throw VerbsError(failed("ibv_modify_qp(RTS)", rc));
}

void QueuePair::kill() {
  dead_ = true;
  if (!qp_) return;
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_ERR;
  api().modify_qp(qp_, &at, IBV_QP_STATE);  // a QP already in error, or a device gone: nothing more to do
}

void QueuePair::close() {
  std::lock_guard<std::mutex> hold(busy_);  // a batch running on this QP ends (by its deadline) first
  const Api& a = api();
  if (qp_) a.destroy_qp(qp_);
  if (cq_) a.destroy_cq(cq_);
  qp_ = nullptr, cq_ = nullptr;
  dead_ = true;
  ctx_.reset();
}

// ---- the batch loop -----------------------------------------------------------------------------------------
namespace {

void fail(Work& w, const std::string& why) {
  if (w.error.empty()) w.error = why;
  w.qp->kill();
}

// Post the next chain of w's chunks that fits its send queue; returns how many were posted.
size_t post(Work& w, ibv_wr_opcode op, size_t every, std::vector<ibv_send_wr>& wrs, std::vector<ibv_sge>& sges) {
  const size_t depth = size_t(w.qp->depth()), n = w.chunks.size();
  const size_t end = std::min(n, w.done + depth);
  if (end <= w.posted || !w.error.empty()) return 0;
  const size_t m = end - w.posted;
  wrs.assign(m, ibv_send_wr{});
  sges.resize(m);
  for (size_t i = 0; i < m; ++i) {
    const size_t k = w.posted + i;
    const Chunk& c = w.chunks[k];
    sges[i] = ibv_sge{c.laddr, c.length, c.lkey};
    ibv_send_wr& wr = wrs[i];
    wr.wr_id = k;
    wr.sg_list = &sges[i];
    wr.num_sge = 1;
    wr.opcode = op;
    // signalled: every `every`-th, the last, and the one that fills the queue (so a completion frees it)
    const bool signal = (k + 1) % every == 0 || k == n - 1 || k + 1 == w.done + depth;
    wr.send_flags = signal ? IBV_SEND_SIGNALED : 0;
    wr.wr.rdma.remote_addr = c.raddr;
    wr.wr.rdma.rkey = c.rkey;
    wr.next = i + 1 < m ? &wrs[i + 1] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(w.qp->qp(), wrs.data(), &bad);
  if (rc) {
    fail(w, failed("ibv_post_send", rc));
    return 0;
  }
  w.posted = end;
  return m;
}

// Take w's completions; true if any arrived (or it failed).
bool poll(Work& w, std::vector<ibv_wc>& wcs) {
  if (!w.error.empty() || w.done == w.posted) return false;
  wcs.resize(size_t(w.qp->depth()) + 1);
  const int n = ibv_poll_cq(w.qp->cq(), int(wcs.size()), wcs.data());
  if (n < 0) {
    fail(w, "ibv_poll_cq failed");
    return true;
  }
  for (int j = 0; j < n; ++j) {
    if (wcs[j].status != IBV_WC_SUCCESS) {
      fail(w, "work completion status " + std::to_string(int(wcs[j].status)) + " (" + wc_name(wcs[j].status) + ")");
      return true;
    }
    w.done = std::max(w.done, size_t(wcs[j].wr_id) + 1);
  }
  if (w.done == w.chunks.size()) w.finished_at = monotonic_s();
  return n > 0;
}

// Arm every live CQ for its next completion event.
void arm(const std::vector<Work*>& live) {
  for (Work* w : live) ibv_req_notify_cq(w->qp->cq(), 0);
}

// Sleep until a completion event on the live QPs' devices' channels or `seconds` pass; consume the events (any
// batch's: each re-polls its own CQs after waking).
void wait(const std::vector<Work*>& live, double seconds) {
  std::vector<ibv_comp_channel*> chans;
  std::vector<pollfd> fds;
  for (Work* w : live) {
    ibv_comp_channel* ch = w->qp->channel();
    if (std::find(chans.begin(), chans.end(), ch) != chans.end()) continue;
    chans.push_back(ch);
    fds.push_back(pollfd{ch->fd, POLLIN, 0});
  }
  const double s = std::clamp(seconds, 0.0, kWaitMaxS);
  timespec ts{time_t(s), long((s - std::floor(s)) * 1e9)};
  if (ppoll(fds.data(), fds.size(), &ts, nullptr) <= 0) return;
  const Api& a = api();
  for (size_t j = 0; j < fds.size(); ++j) {
    if (!(fds[j].revents & POLLIN)) continue;
    ibv_cq* cq = nullptr;
    void* unused = nullptr;
    while (a.get_cq_event(chans[j], &cq, &unused) == 0) a.ack_cq_events(cq, 1);
  }
}

}  // namespace

size_t run(bool read, std::vector<Work>& works, double deadline_at, size_t signal_every) {
  std::vector<std::unique_lock<std::mutex>> held;
  for (Work& w : works) held.emplace_back(w.qp->busy_);
  return run_held(read, works, deadline_at, signal_every);
}

size_t run_held(bool read, std::vector<Work>& works, double deadline_at, size_t signal_every) {
  const ibv_wr_opcode op = read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
  const size_t every = std::max<size_t>(signal_every, 1);
  std::vector<Work*> live;
  for (Work& w : works) {
    if (!w.qp->qp()) w.error = "the queue pair is closed";
    else if (!w.chunks.empty()) live.push_back(&w);
  }
  std::vector<ibv_send_wr> wrs;
  std::vector<ibv_sge> sges;
  std::vector<ibv_wc> wcs;
  size_t posted = 0;
  double last = monotonic_s();
  const double spin = spin_s();
  bool armed = false;
  while (!live.empty()) {
    bool progress = false;
    for (Work* w : live) {
      posted += post(*w, op, every, wrs, sges);
      progress |= poll(*w, wcs);
    }
    live.erase(std::remove_if(live.begin(), live.end(),
                              [](Work* w) { return !w->error.empty() || w->done == w->chunks.size(); }),
               live.end());
    const double now = monotonic_s();
    if (progress) {
      gap_seen(now - last);
      last = now, armed = false;
      continue;
    }
    if (now > deadline_at) {
      for (Work* w : live) fail(*w, "no completion before the deadline");
      break;
    }
    if (now - last < spin) continue;
    if (!armed) {  // armed, then polled once more before sleeping: a completion in between is not missed
      arm(live);
      armed = true;
      continue;
    }
    wait(live, deadline_at - now);
    armed = false;
  }
  return posted;
}

}  // namespace kvp::verbs
