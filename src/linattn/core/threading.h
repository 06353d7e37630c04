// The one parallel primitive: parallel_for over task indices on a fixed pool of workers.
// Workers are numbered 0..num_workers()-1 (0 is the calling thread), so callers allocate
// per-worker scratch before the loop and index it by worker.
#pragma once

#include <cstdint>
#include <functional>

namespace linattn {

// Threads used by every kernel. Default: LINATTN_NUM_THREADS, else the hardware's count.
int num_threads();
// Sets the thread count for later calls (n >= 1); throws Error otherwise.
void set_num_threads(int n);

// Runs fn(task, worker) for task in [0, num_tasks) with dynamic scheduling.
// Exceptions thrown by fn are rethrown on the calling thread (the first one wins).
// While it runs, BLAS calls are single-threaded: parallelism comes from our tasks.
// Nested calls from inside fn run serially on the calling worker.
void parallel_for(int64_t num_tasks, const std::function<void(int64_t task, int worker)>& fn);

}  // namespace linattn
