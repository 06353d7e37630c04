#include "linattn/core/threading.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/core/error.h"

namespace linattn {
namespace {

thread_local bool t_in_region = false;

// Persistent workers that sleep on a condition variable between regions. A region costs
// one wake-up (tens of microseconds); kernels run one region per call.
class ThreadPool {
 public:
  explicit ThreadPool(int workers) : workers_(workers) {
    for (int w = 1; w < workers_; ++w) threads_.emplace_back([this, w] { worker_loop(w); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int workers() const { return workers_; }

  void run(int64_t num_tasks, const std::function<void(int64_t, int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      num_tasks_ = num_tasks;
      next_.store(0);
      error_ = nullptr;
      busy_ = workers_ - 1;
      ++generation_;
    }
    wake_.notify_all();
    work(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return busy_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work(int worker) {
    t_in_region = true;
    for (;;) {
      const int64_t task = next_.fetch_add(1);
      if (task >= num_tasks_) break;
      try {
        (*fn_)(task, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(num_tasks_);  // stop handing out tasks
      }
    }
    t_in_region = false;
  }

  void worker_loop(int worker) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work(worker);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (--busy_ == 0) done_.notify_one();
      }
    }
  }

  const int workers_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  int busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

int default_threads() {
  if (const char* env = std::getenv("LINATTN_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n >= 1) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

std::mutex g_pool_mu;  // one region at a time; guards g_pool
std::unique_ptr<ThreadPool> g_pool;
// The configured count, readable without the lock: a kernel called from inside a region
// (whose caller holds g_pool_mu) must still be able to size its scratch.
std::atomic<int> g_threads{0};  // 0: not chosen yet

ThreadPool& pool_locked() {
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(num_threads());
  return *g_pool;
}

}  // namespace

int num_threads() {
  int n = g_threads.load();
  if (n == 0) {
    int expected = 0;
    g_threads.compare_exchange_strong(expected, default_threads());
    n = g_threads.load();
  }
  return n;
}

void set_num_threads(int n) {
  require(n >= 1, "set_num_threads: n must be >= 1, got ", n);
  require(!t_in_region, "set_num_threads: cannot be called from inside parallel_for");
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_threads.store(n);
  if (g_pool && g_pool->workers() == n) return;
  g_pool = std::make_unique<ThreadPool>(n);
}

void parallel_for(int64_t num_tasks, const std::function<void(int64_t, int)>& fn) {
  if (num_tasks <= 0) return;
  if (t_in_region) {  // nested: run here, as this worker's own work
    for (int64_t t = 0; t < num_tasks; ++t) fn(t, 0);
    return;
  }
  std::lock_guard<std::mutex> lock(g_pool_mu);
  ThreadPool& pool = pool_locked();
  BlasSingleThreaded blas_scope;
  if (pool.workers() == 1 || num_tasks == 1) {
    t_in_region = true;
    try {
      for (int64_t t = 0; t < num_tasks; ++t) fn(t, 0);
    } catch (...) {
      t_in_region = false;
      throw;
    }
    t_in_region = false;
    return;
  }
  pool.run(num_tasks, fn);
}

}  // namespace linattn
