#include "kvp_moe_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace kvp::moe {
namespace {

// "0-3,8-11" (the /sys cpulist format) -> cpu ids; empty when the node does not exist.
std::vector<int> node_cpus(const std::string& root, int node) {
  std::ifstream f(root + "/node" + std::to_string(node) + "/cpulist");
  std::string text, part;
  std::vector<int> cpus;
  if (!std::getline(f, text)) return cpus;
  std::stringstream ss(text);
  while (std::getline(ss, part, ',')) {
    const size_t dash = part.find('-');
    const int lo = std::stoi(part.substr(0, dash)), hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
  }
  return cpus;
}

bool pin(std::thread::native_handle_type h, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  return pthread_setaffinity_np(h, sizeof(set), &set) == 0;
}

int sub_of(int thread, int threads, int subpools) { return int(int64_t(thread) * subpools / threads); }

}  // namespace

Pool::Pool(int threads, int subpools, std::vector<int> nodes, int spin_us, int wait_spin_us,
           const std::string& node_root)
    : subpools_(subpools), spin_us_(spin_us), wait_spin_us_(wait_spin_us) {
  if (threads < 1) throw std::invalid_argument("threads must be >= 1 (got " + std::to_string(threads) + ")");
  if (subpools < 1 || subpools > threads)
    throw std::invalid_argument("threadpool_count must be in [1, threads=" + std::to_string(threads) + "] (got " +
                                std::to_string(subpools) + ")");
  next_.reset(new std::atomic<int>[subpools]);
  for (int i = 1; i < threads; ++i) workers_.emplace_back(&Pool::worker_main, this, sub_of(i, threads, subpools), 0);
  job_thread_ = std::thread(&Pool::job_main, this);
  std::vector<std::vector<int>> cpus;
  for (int s = 0; s < subpools && int(nodes.size()) == subpools; ++s) cpus.push_back(node_cpus(node_root, nodes[s]));
  bool ok = !cpus.empty();
  for (auto& c : cpus) ok = ok && !c.empty();
  if (!ok) {
    pinning_ = nodes.empty() ? "not pinned (single NUMA node)" : "not pinned (a requested NUMA node does not exist)";
    return;
  }
  ok = pin(job_thread_.native_handle(), cpus[0]);
  for (int i = 1; i < threads; ++i) ok = pin(workers_[i - 1].native_handle(), cpus[sub_of(i, threads, subpools)]) && ok;
  pinning_ = ok ? "pinned to NUMA nodes" : "pinning failed (affinity refused)";
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lk(job_mu_);
    stop_ = true;
  }
  job_cv_.notify_all();
  job_thread_.join();
  {
    std::lock_guard<std::mutex> lk(mu_);
    gen_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

std::string Pool::describe() const {
  return std::to_string(threads()) + " threads in " + std::to_string(subpools_) + " subpool(s), " + pinning_ +
         ", idle spin " + std::to_string(spin_us_) + " us, wait spin " + std::to_string(wait_spin_us_) + " us";
}

bool Pool::spin_until(const std::function<bool()>& ready, int us) const {
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (int i = 0;; ++i) {
    if (ready()) return true;
    _mm_pause();
    if ((i & 255) == 255) {
      if (std::chrono::steady_clock::now() >= end) return false;
      std::this_thread::yield();  // an oversubscribed machine: let the thread we wait for run
    }
  }
}

void Pool::work(int sub) {
  for (int k = 0; k < subpools_; ++k) {
    const int s = (sub + k) % subpools_;
    for (int i; (i = next_[s].fetch_add(1)) < counts_[s];) {
      try {
        (*fn_)(s, i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu_);
        if (!err_) err_ = std::current_exception();
      }
    }
  }
}

void Pool::run(const std::vector<int>& counts, const TaskFn& fn) {
  if (int(counts.size()) != subpools_) throw std::invalid_argument("Pool::run: one count per subpool");
  fn_ = &fn;
  counts_ = counts;
  for (int s = 0; s < subpools_; ++s) next_[s].store(0);
  err_ = nullptr;
  pending_.store(int(workers_.size()));
  gen_.fetch_add(1);
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lk(mu_);
    cv_.notify_all();
  }
  work(0);
  for (int i = 1; pending_.load(std::memory_order_acquire) != 0; ++i) {
    _mm_pause();
    if ((i & 255) == 0) std::this_thread::yield();
  }
  fn_ = nullptr;
  if (err_) std::rethrow_exception(err_);
}

void Pool::worker_main(int sub, uint64_t seen) {
  for (;;) {
    if (!spin_until([&] { return gen_.load(std::memory_order_acquire) != seen; }, spin_us_)) {
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_.fetch_add(1);
      cv_.wait(lk, [&] { return gen_.load() != seen; });
      sleepers_.fetch_sub(1);
    }
    seen = gen_.load();
    if (stop_) return;
    work(sub);
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

uint64_t Pool::submit(std::function<void()> job) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lk(job_mu_);
    ticket = ++next_ticket_;
    jobs_.emplace_back(ticket, std::move(job));
    queued_.fetch_add(1, std::memory_order_release);
  }
  job_cv_.notify_one();
  return ticket;
}

void Pool::wait(uint64_t ticket) {
  if (wait_spin_us_ > 0) spin_until([&] { return done_polled_.load(std::memory_order_acquire) >= ticket; }, wait_spin_us_);
  std::unique_lock<std::mutex> lk(job_mu_);
  if (ticket == 0 || ticket > next_ticket_) throw std::invalid_argument("unknown ticket " + std::to_string(ticket));
  done_cv_.wait(lk, [&] { return done_ticket_ >= ticket; });
  auto it = job_errors_.find(ticket);
  if (it != job_errors_.end()) {
    std::exception_ptr e = it->second;
    job_errors_.erase(it);
    std::rethrow_exception(e);
  }
}

void Pool::job_main() {
  for (;;) {
    std::unique_lock<std::mutex> lk(job_mu_);
    if (jobs_.empty() && !stop_) {
      lk.unlock();
      // polls an atomic, not the mutex: a locked poll contends with submit() and burns CPU in lock/unlock
      spin_until([&] { return queued_.load(std::memory_order_acquire) != 0 || stop_.load(); }, spin_us_);
      lk.lock();
    }
    job_cv_.wait(lk, [&] { return !jobs_.empty() || stop_; });
    if (jobs_.empty()) return;
    auto [ticket, job] = std::move(jobs_.front());
    jobs_.pop_front();
    queued_.fetch_sub(1, std::memory_order_relaxed);
    lk.unlock();
    std::exception_ptr err;
    try {
      job();
    } catch (...) {
      err = std::current_exception();
    }
    lk.lock();
    if (err) job_errors_[ticket] = err;
    done_ticket_ = ticket;
    done_polled_.store(ticket, std::memory_order_release);
    lk.unlock();
    done_cv_.notify_all();
  }
}

}  // namespace kvp::moe
