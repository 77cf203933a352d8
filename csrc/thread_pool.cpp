#include "thread_pool.h"

#include <immintrin.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kt {
namespace {

thread_local bool tl_in_pool_task = false;

constexpr uint64_t pack(uint32_t gen, uint32_t end, uint32_t next) {
  return (static_cast<uint64_t>(gen & 0xffff) << 48) | (static_cast<uint64_t>(end & 0xffffff) << 24) | (next & 0xffffff);
}
inline uint32_t t_gen(uint64_t v) { return static_cast<uint32_t>(v >> 48); }
inline uint32_t t_end(uint64_t v) { return static_cast<uint32_t>((v >> 24) & 0xffffff); }
inline uint32_t t_next(uint64_t v) { return static_cast<uint32_t>(v & 0xffffff); }

long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

bool ThreadPool::in_pool_task() { return tl_in_pool_task; }

ThreadPool::ThreadPool(int threads) : nthreads_(threads) {
  if (threads < 1 || threads > 1024) throw std::invalid_argument("threads must be in [1, 1024], got " + std::to_string(threads));
  ranges_.reset(new Range[threads]);
  const char* s = std::getenv("KT_SPIN_US");
  spin_ns_ = (s && *s) ? std::atol(s) * 1000L : 50000L;
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    std::lock_guard<std::mutex> lk(sleep_mu_);
    epoch_.fetch_add(1);
  }
  sleep_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

bool ThreadPool::run_tasks(uint32_t gen, int tid) {
  int ran = 0;  // counted into done_ once, when this thread finds no task left
  for (int j = 0; j < nthreads_; ++j) {
    const bool own = j == 0;  // own range from the front, the others' from the back
    std::atomic<uint64_t>& r = ranges_[(tid + j) % nthreads_].v;
    uint64_t v = r.load(std::memory_order_acquire);
    for (;;) {
      if (t_gen(v) != (gen & 0xffff) || t_next(v) >= t_end(v)) break;
      const uint64_t claimed = own ? v + 1 : v - (uint64_t{1} << 24);
      if (!r.compare_exchange_weak(v, claimed, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      ++ran;
      const int task = static_cast<int>(own ? t_next(v) : t_end(v) - 1);
      try {
        (*fn_)(task, tid);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu_);
        if (!err_) err_ = std::current_exception();
      }
      v = r.load(std::memory_order_acquire);
    }
  }
  if (ran) done_.fetch_add(ran, std::memory_order_acq_rel);
  return ran > 0;
}

void ThreadPool::worker_loop(int tid) {
  uint32_t seen = 0;  // the epoch the pool was made with, not the one when this thread started:
                      // a pool destroyed before its threads ran would otherwise never wake them
  tl_in_pool_task = true;
  for (;;) {
    uint32_t e = epoch_.load(std::memory_order_acquire);
    if (e == seen) {
      const long t0 = now_ns();
      int spins = 0;
      while ((e = epoch_.load(std::memory_order_acquire)) == seen) {
        _mm_pause();
        if ((++spins & 63) == 0 && now_ns() - t0 > spin_ns_) {
          std::unique_lock<std::mutex> lk(sleep_mu_);
          sleepers_.fetch_add(1);
          sleep_cv_.wait(lk, [&] { return stop_.load() || epoch_.load() != seen; });
          sleepers_.fetch_sub(1);
          e = epoch_.load();
          break;
        }
      }
    }
    if (stop_.load()) return;
    seen = e;
    run_tasks(e, tid);
  }
}

void ThreadPool::parallel_for(int ntasks, const std::function<void(int, int)>& fn) {
  if (ntasks <= 0) return;
  if (tl_in_pool_task || nthreads_ == 1 || ntasks == 1) {  // inline: nested call or nothing to share
    for (int i = 0; i < ntasks; ++i) fn(i, 0);
    return;
  }
  if (ntasks > 0xffffff) throw std::invalid_argument("parallel_for: too many tasks");
  std::lock_guard<std::mutex> run_lk(run_mu_);
  fn_ = &fn;
  done_.store(0, std::memory_order_relaxed);
  err_ = nullptr;
  const uint32_t gen = epoch_.load() + 1;
  for (int i = 0; i < nthreads_; ++i) {
    const auto b = static_cast<uint32_t>(static_cast<int64_t>(ntasks) * i / nthreads_);
    const auto e = static_cast<uint32_t>(static_cast<int64_t>(ntasks) * (i + 1) / nthreads_);
    ranges_[i].v.store(pack(gen, e, b), std::memory_order_release);
  }
  epoch_.store(gen, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lk(sleep_mu_);
    sleep_cv_.notify_all();
  }
  tl_in_pool_task = true;
  run_tasks(gen, 0);
  tl_in_pool_task = false;
  while (done_.load(std::memory_order_acquire) < ntasks) _mm_pause();
  fn_ = nullptr;
  if (err_) {
    std::exception_ptr e = err_;
    err_ = nullptr;
    std::rethrow_exception(e);
  }
}

// ---------------------------------------------------------------------------------------------

CPUInfer::CPUInfer(int threads) : pool_(threads) { qthread_ = std::thread([this] { queue_loop(); }); }

CPUInfer::~CPUInfer() {
  try {
    sync();
  } catch (...) {
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  qthread_.join();
}

void CPUInfer::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    q_.push_back(std::move(task));
  }
  cv_.notify_one();
}

bool CPUInfer::run_one() {
  std::lock_guard<std::mutex> ex(exec_mu_);
  std::function<void()> task;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (q_.empty()) return false;
    task = std::move(q_.front());
    q_.pop_front();
    ++running_;
  }
  std::exception_ptr e;
  try {
    task();
  } catch (...) {
    e = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    --running_;
    if (e && !err_) err_ = e;
    if (q_.empty() && running_ == 0) idle_cv_.notify_all();
  }
  return true;
}

void CPUInfer::queue_loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
      if (stop_ && q_.empty()) return;
    }
    while (run_one()) {
    }
  }
}

void CPUInfer::sync() {
  while (run_one()) {  // steal pending work instead of waiting for the queue thread
  }
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [&] { return q_.empty() && running_ == 0; });
  if (err_) {
    std::exception_ptr e = err_;
    err_ = nullptr;
    std::rethrow_exception(e);
  }
}

void CPUInfer::run_now(const std::function<void()>& fn) {
  sync();
  std::lock_guard<std::mutex> ex(exec_mu_);
  fn();
}

}  // namespace kt
