#include "linattn/core/error.h"
#include "linattn/core/parallel.h"

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace linattn {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollInterval = std::chrono::milliseconds(20);

std::atomic<InterruptPoll> g_poll{nullptr};

// One run of a loop. Lives on its caller's stack; the pool only hands out pointers to it while
// it is open, and the caller waits until no helper is inside before returning.
struct Job {
  const std::function<void(int64_t, int)>* fn = nullptr;
  int64_t num_tasks = 0;
  int slots = 1;  // worker ids 0..slots-1; 0 is the caller
  std::atomic<int64_t> next_task{0};
  std::atomic<bool> stop{false};
  std::mutex error_mu;
  std::exception_ptr error;
  // Caller thread only.
  bool interrupted = false;
  Clock::time_point last_poll = Clock::now();
  // Guarded by the pool's mutex.
  int next_slot = 1;
  int active = 0;  // helpers inside work()
};

thread_local Job* t_job = nullptr;  // the job whose task this thread is running
thread_local bool t_is_caller = false;

void record_error(Job& job) {
  {
    std::lock_guard<std::mutex> lock(job.error_mu);
    if (!job.error) job.error = std::current_exception();
  }
  job.stop.store(true);
}

// On the caller's thread: asks the installed poll, at most every kPollInterval.
bool poll_says_stop(Job& job) {
  const InterruptPoll poll = g_poll.load(std::memory_order_relaxed);
  if (!poll) return false;
  const auto now = Clock::now();
  if (now - job.last_poll < kPollInterval) return false;
  job.last_poll = now;
  if (!poll()) return false;
  job.interrupted = true;
  job.stop.store(true);
  return true;
}

void work(Job& job, int slot) {
  Job* const outer = t_job;
  const bool outer_caller = t_is_caller;
  t_job = &job;
  t_is_caller = slot == 0;
  for (;;) {
    if (job.stop.load(std::memory_order_relaxed)) break;
    if (slot == 0 && poll_says_stop(job)) break;
    const int64_t task = job.next_task.fetch_add(1);
    if (task >= job.num_tasks) break;
    try {
      (*job.fn)(task, slot);
    } catch (...) {
      record_error(job);
    }
  }
  t_job = outer;
  t_is_caller = outer_caller;
}

// On the caller, lock held: waits until `inside` (helpers still running `job`'s tasks, guarded by
// the lock's mutex and signalled on `done`) is 0, polling meanwhile so that Ctrl-C reaches long
// tasks through interruption_point(). Both pools end their loops here.
void wait_for_helpers(std::unique_lock<std::mutex>& lock, std::condition_variable& done, const int& inside, Job& job) {
  while (inside > 0) {
    if (g_poll.load(std::memory_order_relaxed) && !job.stop.load()) {
      done.wait_for(lock, kPollInterval);
      if (inside == 0) break;
      lock.unlock();
      poll_says_stop(job);
      lock.lock();
    } else {
      done.wait(lock, [&] { return inside == 0; });
    }
  }
}

// Helper threads, grown on demand up to the largest worker count asked for, never shrunk (idle
// helpers sleep on a condition variable and are not woken for jobs that do not need them).
class Pool {
 public:
  // Only a pool that lost the race to be the process's runs this (it has no threads yet).
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void run(Job& job) {
    const int wanted = job.slots - 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int>(threads_.size()) < wanted) threads_.emplace_back([this] { helper_loop(); });
      open_.push_back(&job);
    }
    if (wanted >= static_cast<int>(threads_.size())) {
      wake_.notify_all();
    } else {
      for (int i = 0; i < wanted; ++i) wake_.notify_one();
    }
    work(job, 0);
    std::unique_lock<std::mutex> lock(mu_);
    open_.erase(std::remove(open_.begin(), open_.end(), &job), open_.end());
    wait_for_helpers(lock, done_, job.active, job);
  }

 private:
  void helper_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || !open_.empty(); });
      if (stop_) return;
      Job* job = open_.front();
      const int slot = job->next_slot++;
      if (job->next_slot >= job->slots) open_.pop_front();
      ++job->active;
      lock.unlock();
      work(*job, slot);
      lock.lock();
      if (--job->active == 0) done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  std::deque<Job*> open_;  // jobs with worker ids left to hand out
  bool stop_ = false;
};

// Created on first use and never destroyed: its helpers sleep on a condition variable and end
// with the process. Joining them from a static destructor at exit would race with any thread
// still inside a loop then (a daemon thread of Python's, say), which would go on using a pool
// that is gone. A forked child (Python multiprocessing) has none of the parent's helper
// threads and maybe a mutex locked by one of them: it drops the parent's pool (its threads do
// not exist there) and makes its own.
std::atomic<Pool*> g_pool{nullptr};

void forget_pool_in_child() { g_pool.store(nullptr); }

Pool& pool() {
  Pool* p = g_pool.load();
  if (p) return *p;
  static std::once_flag atfork_once;
  std::call_once(atfork_once, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  auto* fresh = new Pool();
  if (g_pool.compare_exchange_strong(p, fresh)) return *fresh;
  delete fresh;  // another thread made one first
  return *p;
}

// LINATTN_NUM_THREADS, or 0 when it is unset (an Error when it is not a count).
int env_threads() {
  const char* env = std::getenv("LINATTN_NUM_THREADS");
  if (!env) return 0;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  require(end != env && *end == '\0' && n >= 1 && n <= kMaxThreads,
          "LINATTN_NUM_THREADS must be an integer in [1, ", kMaxThreads, "], got \"", env, "\"");
  return static_cast<int>(n);
}

int hardware_threads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(std::min<unsigned>(hw, kMaxThreads));
}

std::atomic<int> g_threads{0};  // 0: not set (set_num_threads, LINATTN_NUM_THREADS)

// An OpenMP runtime of the process's (share_openmp_runtime) that loops run on instead of the
// pool, through the two entry points of libgomp's ABI that a parallel region needs.
struct OpenMPRuntime {
  void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);  // GOMP_parallel
  int (*thread_num)();                                                                      // omp_get_thread_num
  int (*max_threads)();                                                                     // omp_get_max_threads
  std::string file;
};
std::atomic<const OpenMPRuntime*> g_openmp{nullptr};

struct OpenMPRegion {
  Job* job;
  const OpenMPRuntime* runtime;
  std::mutex mu;
  std::condition_variable done;
  int helpers_inside = 0;  // guarded by mu
};

// One thread of the OpenMP team. Thread 0 is the caller: after its share of the tasks it waits
// for the others as the own pool's caller does, polling, so that a long task on another thread
// still sees Ctrl-C (OpenMP's closing barrier would not poll).
void openmp_thread(void* data) {
  auto& region = *static_cast<OpenMPRegion*>(data);
  Job& job = *region.job;
  const int slot = region.runtime->thread_num();
  if (slot >= job.slots) return;  // members beyond the loop's workers (see ParallelLoop::run)
  if (slot != 0) {
    {
      std::lock_guard<std::mutex> lock(region.mu);
      ++region.helpers_inside;
    }
    work(job, slot);
    std::lock_guard<std::mutex> lock(region.mu);
    if (--region.helpers_inside == 0) region.done.notify_all();
    return;
  }
  work(job, 0);
  std::unique_lock<std::mutex> lock(region.mu);
  wait_for_helpers(lock, region.done, region.helpers_inside, job);
}

}  // namespace

std::string share_openmp_runtime(const std::string& through) {
  // Already loaded by someone else (RTLD_NOLOAD): loading one here would make a second pool.
  // Through a library: the runtime that library's symbols bind to (dlsym searches its
  // dependencies), whatever its file is called (PyTorch's wheels have shipped a renamed libgomp).
  std::vector<std::string> names;
  if (!through.empty()) names = {through};
  else names = {"libgomp.so.1", "libiomp5.so"};
  for (const std::string& name : names) {
    void* lib = dlopen(name.c_str(), RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) continue;
    auto* parallel = reinterpret_cast<decltype(OpenMPRuntime::parallel)>(dlsym(lib, "GOMP_parallel"));
    auto* thread_num = reinterpret_cast<int (*)()>(dlsym(lib, "omp_get_thread_num"));
    auto* max_threads = reinterpret_cast<int (*)()>(dlsym(lib, "omp_get_max_threads"));
    if (!parallel || !thread_num || !max_threads) continue;  // the handle stays open: it was loaded anyway
    Dl_info info{};
    std::string file = dladdr(reinterpret_cast<void*>(parallel), &info) && info.dli_fname ? info.dli_fname : name;
    // Kept for the process's life, reachable from `kept`: a loop running now may still use a
    // runtime that a later call replaced.
    static std::mutex mu;
    static auto* kept = new std::vector<std::unique_ptr<OpenMPRuntime>>();
    std::lock_guard<std::mutex> lock(mu);
    // A forked child (Python multiprocessing) goes back to the own pool, which it remakes: the
    // parent's OpenMP team does not exist there, and libgomp would wait for it.
    static const bool at_fork = (pthread_atfork(nullptr, nullptr, [] { g_openmp.store(nullptr); }), true);
    (void)at_fork;
    auto same = std::find_if(kept->begin(), kept->end(), [&](const auto& r) { return r->parallel == parallel; });
    if (same == kept->end())
      same = kept->insert(kept->end(),
                          std::make_unique<OpenMPRuntime>(OpenMPRuntime{parallel, thread_num, max_threads, file}));
    g_openmp.store(same->get());
    return file;
  }
  return "";
}

void use_own_threads() { g_openmp.store(nullptr); }

std::string thread_pool() {
  const OpenMPRuntime* runtime = g_openmp.load();
  return runtime ? "openmp " + runtime->file : "own";
}

int num_threads() {
  const int n = g_threads.load();
  if (n > 0) return n;
  static const int from_env = env_threads();  // read once; an invalid value throws on every call
  if (from_env > 0) {
    int expected = 0;
    g_threads.compare_exchange_strong(expected, from_env);
    return g_threads.load();
  }
  // Not set: the shared OpenMP runtime's count (torch.set_num_threads under linattn.torch), so
  // that one knob sizes both and the team keeps one size; else every hardware thread.
  if (const OpenMPRuntime* runtime = g_openmp.load()) return std::clamp(runtime->max_threads(), 1, kMaxThreads);
  static const int hardware = hardware_threads();  // get_nprocs reads /sys: once
  return hardware;
}

void set_num_threads(int n) {
  require(n >= 1 && n <= kMaxThreads, "set_num_threads: n must be in [1, ", kMaxThreads, "], got ", n);
  g_threads.store(n);
}

ParallelLoop::ParallelLoop(int64_t num_tasks) : tasks_(std::max<int64_t>(num_tasks, 0)) {
  workers_ = t_job ? 1 : static_cast<int>(std::clamp<int64_t>(tasks_, 1, num_threads()));
}

void ParallelLoop::run(const std::function<void(int64_t, int)>& fn) const {
  if (tasks_ == 0) return;
  if (t_job) {  // nested: this worker runs the inner loop itself
    for (int64_t t = 0; t < tasks_; ++t) fn(t, 0);
    return;
  }
  Job job;
  job.fn = &fn;
  job.num_tasks = tasks_;
  job.slots = workers_;
  if (workers_ == 1) {
    work(job, 0);
  } else if (const OpenMPRuntime* runtime = g_openmp.load()) {
    OpenMPRegion region;
    region.job = &job;
    region.runtime = runtime;
    // At least the team the runtime's other users ask for (torch asks for omp_get_max_threads()):
    // libgomp ends the pool's threads beyond a smaller team and starts them again for the next
    // larger one. Members beyond the loop's workers return at once.
    const int team = std::max(workers_, runtime->max_threads());
    runtime->parallel(openmp_thread, &region, static_cast<unsigned>(team), 0);
  } else {
    pool().run(job);
  }
  if (job.error) std::rethrow_exception(job.error);
  if (job.interrupted) throw Interrupted();
}

void parallel_for(int64_t num_tasks, const std::function<void(int64_t)>& fn) {
  ParallelLoop(num_tasks).run([&](int64_t task, int) { fn(task); });
}

SingleUser::Scope::Scope(const SingleUser& owner, const char* fn, const char* what) : owner_(owner) {
  require(!owner.busy_.exchange(true), fn, ": ", what,
          " is in use by another thread; it holds one sequence, so give each thread its own (copy())");
}

void set_interrupt_poll(InterruptPoll poll) { g_poll.store(poll); }

void interruption_point() {
  Job* job = t_job;
  if (!job) return;
  if (t_is_caller) poll_says_stop(*job);
  if (job->stop.load(std::memory_order_relaxed)) throw Interrupted();
}

}  // namespace linattn
