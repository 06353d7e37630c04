// The one parallel primitive (internal; include/linattn/threading.h has the public thread
// count): a loop over task indices whose worker count is fixed when the
// loop is made, run on a shared pool of helper threads. Per-worker scratch is sized from that
// count (PerWorker below) and indexed by the worker id run() hands out, so a loop can never
// hand out an id its scratch does not cover, whatever set_num_threads does meanwhile.
//
// Several threads may run loops at once (two Python threads, say): each loop's caller works as
// its worker 0 and takes as many idle helpers as its worker count allows; nothing is serialised
// behind a process-wide lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "linattn/core/error.h"
#include "linattn/threading.h"

namespace linattn {

// A parallel loop over tasks [0, num_tasks). workers() = min(num_threads(), num_tasks), and 1
// when the loop is made inside another loop's task (nested loops run on the calling worker).
class ParallelLoop {
 public:
  explicit ParallelLoop(int64_t num_tasks);
  int workers() const { return workers_; }
  int64_t tasks() const { return tasks_; }
  // Runs fn(task, worker) for every task, worker in [0, workers()), dynamic scheduling. The
  // first exception thrown by fn stops the hand-out of tasks and is rethrown here, after
  // every worker has left fn.
  void run(const std::function<void(int64_t task, int worker)>& fn) const;

 private:
  int64_t tasks_;
  int workers_;
};

// How many consecutive tasks of `work_per_task` multiply-adds one loop index should take so
// that each index has at least ~2^16 of them: waking a helper thread costs tens of
// microseconds, more than a small task (a decoding step of a few heads). In [1, num_tasks].
inline int64_t tasks_per_index(int64_t num_tasks, int64_t work_per_task) {
  const int64_t group = (int64_t{1} << 16) / (work_per_task > 0 ? work_per_task : 1);
  return group < 1 ? 1 : (group > num_tasks ? (num_tasks > 0 ? num_tasks : 1) : group);
}

// For loops that need no per-worker scratch: fn(task).
void parallel_for(int64_t num_tasks, const std::function<void(int64_t task)>& fn);

// One S per worker of a loop, built before the loop runs (from make(), or default-built).
template <class S>
class PerWorker {
 public:
  explicit PerWorker(const ParallelLoop& loop) : items_(static_cast<size_t>(loop.workers())) {}
  template <class Make>
  PerWorker(const ParallelLoop& loop, Make&& make) {
    items_.reserve(static_cast<size_t>(loop.workers()));
    for (int w = 0; w < loop.workers(); ++w) items_.push_back(make());
  }
  S& operator[](int worker) {
    // Cheap enough to keep in release builds: one comparison per task.
    if (worker < 0 || static_cast<size_t>(worker) >= items_.size())
      throw std::logic_error("PerWorker: worker id " + std::to_string(worker) +
                             " outside the loop's " + std::to_string(items_.size()) + " workers");
    return items_[static_cast<size_t>(worker)];
  }
  int size() const { return static_cast<int>(items_.size()); }

 private:
  std::vector<S> items_;
};

// Marks an object that must not be used by two threads at once (a decoding state holds one
// sequence): a second concurrent user gets an Error naming `fn` instead of corrupting it.
class SingleUser {
 public:
  SingleUser() = default;
  SingleUser(SingleUser&&) noexcept {}  // a moved-to object starts unused
  SingleUser& operator=(SingleUser&&) noexcept { return *this; }

  class Scope {
   public:
    Scope(const SingleUser& owner, const char* fn, const char* what);
    ~Scope() { owner_.busy_.store(false); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    const SingleUser& owner_;
  };

 private:
  mutable std::atomic<bool> busy_{false};
};

// ---- interruption ---------------------------------------------------------------------------

// Call inside long tasks: throws Interrupted once the current loop has been told to stop.
void interruption_point();

}  // namespace linattn
