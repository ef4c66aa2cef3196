// Worker pool for the CPU MoE: `threads` compute threads split into `subpools` groups (one per NUMA node when
// the machine has them), a FIFO job thread for submit()/wait(), and idle workers that sleep after a short spin.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvp::moe {

class Pool {
 public:
  using TaskFn = std::function<void(int sub, int idx)>;
  // threads >= 1 in all (the job thread computes too); nodes[s] = NUMA node of subpool s, or empty to pin
  // nothing; spin_us = how long an idle worker polls before it sleeps; wait_spin_us = how long wait() polls
  // for its job before it sleeps; node_root = the directory holding node<N>/cpulist (sysfs; tests point it
  // at a fake topology).
  Pool(int threads, int subpools, std::vector<int> nodes, int spin_us, int wait_spin_us,
       const std::string& node_root = "/sys/devices/system/node");
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Run fn(s, i) for every i < counts[s] of every subpool s; a subpool's workers take its own tasks first, then
  // help the others. Only call from inside a job (submit) or while no job runs. Rethrows the first task error.
  void run(const std::vector<int>& counts, const TaskFn& fn);
  uint64_t submit(std::function<void()> job);  // FIFO; returns a ticket
  // Blocks until that job ran; rethrows its error. Polls first, for up to wait_spin_us: a thread that sleeps on
  // the condition variable pays a wake-up (measured 25-70 us per decode forward in this VM) when the job ends.
  void wait(uint64_t ticket);
  int threads() const { return int(workers_.size()) + 1; }
  int subpools() const { return subpools_; }
  std::string describe() const;

 private:
  void worker_main(int sub, uint64_t seen);
  void job_main();
  void work(int sub);
  bool spin_until(const std::function<bool()>& ready, int us) const;

  int subpools_, spin_us_, wait_spin_us_;
  std::string pinning_;
  std::vector<std::thread> workers_;
  std::thread job_thread_;
  // current run()
  const TaskFn* fn_ = nullptr;
  std::vector<int> counts_;
  std::unique_ptr<std::atomic<int>[]> next_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0}, sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_, err_mu_;
  std::condition_variable cv_;
  std::exception_ptr err_;
  // jobs
  std::mutex job_mu_;
  std::condition_variable job_cv_, done_cv_;
  std::deque<std::pair<uint64_t, std::function<void()>>> jobs_;
  std::atomic<size_t> queued_{0};  // jobs_.size(), for the job thread's lock-free idle spin
  std::map<uint64_t, std::exception_ptr> job_errors_;
  uint64_t next_ticket_ = 0, done_ticket_ = 0;
  std::atomic<uint64_t> done_polled_{0};  // done_ticket_, for wait()'s lock-free poll
};

}  // namespace kvp::moe
