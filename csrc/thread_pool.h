// Persistent worker pool + asynchronous task queue (CPUInfer).
//
// ThreadPool(n): the thread that calls parallel_for() is worker 0, so n threads means n-1
// extra OS threads.  Idle workers spin briefly (KT_SPIN_US, default 50 us) and then block on a
// condition variable, so an idle pool costs no CPU and a busy decode loop does not pay a
// futex wake-up between the kernel phases of one layer.  The tasks of a call are split into one
// contiguous range per thread (generation | end | next packed in 64 bits, each on its own cache
// line): a thread takes its own range from the front, then steals from the back of the others',
// which balances skewed work (one expert receiving most tokens) while each thread walks
// adjacent rows, so the rows its kernels prefetch are the ones it reads next (handing tasks out
// round-robin from one counter gave every prefetch to the other core's cache).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace kt {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return nthreads_; }
  // Runs fn(task, thread_id) for every task in [0, ntasks); thread_id in [0, size()).
  // Blocks until all tasks are done; rethrows the first exception a task threw.
  // Calls from different threads are serialised; a call from inside a task runs inline.
  void parallel_for(int ntasks, const std::function<void(int, int)>& fn);
  // Same, but runs inline without building a std::function (no allocation) when there is
  // nothing to share: one thread, one task, or a nested call.
  template <class F, class = std::enable_if_t<!std::is_same<std::decay_t<F>, std::function<void(int, int)>>::value>>
  void parallel_for(int ntasks, F&& fn) {
    if (ntasks <= 0) return;
    if (nthreads_ == 1 || ntasks == 1 || in_pool_task()) {
      for (int i = 0; i < ntasks; ++i) fn(i, 0);
      return;
    }
    const std::function<void(int, int)> f(std::ref(fn));
    parallel_for(ntasks, f);
  }
  static bool in_pool_task();

 private:
  void worker_loop(int tid);
  bool run_tasks(uint32_t gen, int tid);

  int nthreads_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;                 // one parallel_for at a time
  // ranges_ (one per thread), done_ (added once per thread and call) and epoch_ (what idle
  // workers spin on) each on a cache line of its own: on one line every claim bounced the line
  // the other thread was reading (decode GEMVs run thousands of tasks per call)
  struct alignas(64) Range {
    std::atomic<uint64_t> v{0};  // gen:16 | end:24 | next:24
  };
  std::unique_ptr<Range[]> ranges_;
  alignas(64) std::atomic<int> done_{0};
  alignas(64) std::atomic<uint32_t> epoch_{0};
  alignas(64) const std::function<void(int, int)>* fn_ = nullptr;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::mutex err_mu_;
  std::exception_ptr err_;
  long spin_ns_;
};

// CPUInfer: a pool plus a FIFO of tasks.  submit() returns at once; a queue thread runs the
// tasks in order (it is worker 0 of the pool while it runs one).  sync() runs still-pending
// tasks on the calling thread (no wake-up latency), waits for the running one, and rethrows
// the first error a task raised since the last sync().
class CPUInfer {
 public:
  explicit CPUInfer(int threads);
  ~CPUInfer();
  ThreadPool& pool() { return pool_; }
  int threads() const { return pool_.size(); }
  void submit(std::function<void()> task);
  void sync();
  // sync(), then run fn on the calling thread (used by blocking forward calls).
  void run_now(const std::function<void()>& fn);

 private:
  void queue_loop();
  bool run_one();  // pops and runs one task if any; returns false when the queue was empty

  ThreadPool pool_;
  std::mutex mu_;
  std::condition_variable cv_;       // queue thread waits for work
  std::condition_variable idle_cv_;  // sync() waits for an empty, idle queue
  std::deque<std::function<void()>> q_;
  int running_ = 0;
  bool stop_ = false;
  std::exception_ptr err_;
  std::mutex exec_mu_;               // tasks run one at a time, in order
  std::thread qthread_;
};

}  // namespace kt
