// The parallel loop: every task once, worker ids inside the loop's worker count whatever the
// thread count, concurrent callers, set_num_threads during loops, errors, interruption; on
// linattn's own helper threads and on an OpenMP runtime's team (share_openmp_runtime).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "linattn/core/parallel.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::ScopedThreads;

enum class Pool { Own, OpenMP };

class Threading : public ::testing::TestWithParam<Pool> {
 protected:
  void SetUp() override {
    if (GetParam() == Pool::OpenMP) {
      const std::string file = testing::share_system_openmp();
      ASSERT_NE(file.find("libgomp"), std::string::npos) << file;
      ASSERT_EQ(thread_pool(), "openmp " + file);
    } else {
      use_own_threads();
      ASSERT_EQ(thread_pool(), "own");
    }
  }
  void TearDown() override { use_own_threads(); }
};

INSTANTIATE_TEST_SUITE_P(Pools, Threading, ::testing::Values(Pool::Own, Pool::OpenMP),
                         [](const auto& info) { return info.param == Pool::Own ? "Own" : "OpenMP"; });

// Sharing through a library takes the runtime that library binds to (here the runtime itself);
// a library that is not loaded gives nothing to share, and the pool stays as it was.
TEST(ThreadPool, SharingThroughALoadedLibrary) {
  const std::string file = testing::share_system_openmp();
  ASSERT_NE(file.find("libgomp"), std::string::npos) << file;
  use_own_threads();
  EXPECT_EQ(share_openmp_runtime("libgomp.so.1"), file);
  EXPECT_EQ(thread_pool(), "openmp " + file);
  use_own_threads();
  EXPECT_EQ(share_openmp_runtime("liblinattn-not-loaded.so"), "");
  EXPECT_EQ(thread_pool(), "own");
}

// Without a runtime in the process there is nothing to share: the loops stay on the own pool.
TEST(ThreadPool, SharingNeedsALoadedRuntime) {
  use_own_threads();
  for (const char* name : {"libgomp.so.1", "libiomp5.so"}) {
    if (void* loaded = dlopen(name, RTLD_LAZY | RTLD_NOLOAD)) {
      dlclose(loaded);
      GTEST_SKIP() << name << " is already loaded in this process (a test of the OpenMP pool ran first)";
    }
  }
  EXPECT_EQ(share_openmp_runtime(), "");
  EXPECT_EQ(thread_pool(), "own");
}

TEST_P(Threading, EveryTaskRunsOnceOnAValidWorker) {
  for (int threads : {1, 2, 3, 8, 16})
    for (int64_t tasks : {1, 2, 3, 7, 1000}) {
      ScopedThreads scope(threads);
      const ParallelLoop loop(tasks);
      EXPECT_EQ(loop.workers(), std::min<int64_t>(threads, tasks));
      std::vector<std::atomic<int>> hits(static_cast<size_t>(tasks));
      std::atomic<bool> bad_worker{false};
      loop.run([&](int64_t t, int w) {
        hits[static_cast<size_t>(t)].fetch_add(1);
        if (w < 0 || w >= loop.workers()) bad_worker = true;
      });
      for (auto& h : hits) ASSERT_EQ(h.load(), 1) << threads << " threads, " << tasks << " tasks";
      EXPECT_FALSE(bad_worker.load());
    }
}

TEST(ThreadPool, PerWorkerChecksTheWorkerId) {
  ScopedThreads scope(4);
  const ParallelLoop loop(3);
  PerWorker<int> slots(loop);
  EXPECT_EQ(slots.size(), 3);
  EXPECT_NO_THROW(slots[2]);
  EXPECT_THROW(slots[3], std::logic_error);
  EXPECT_THROW(slots[-1], std::logic_error);
}

TEST_P(Threading, ExceptionsReachTheCaller) {
  ScopedThreads scope(3);
  EXPECT_THROW(parallel_for(100,
                            [](int64_t t) {
                              if (t == 57) throw std::runtime_error("task 57");
                            }),
               std::runtime_error);
  // The pool still works afterwards.
  std::atomic<int> count{0};
  parallel_for(10, [&](int64_t) { ++count; });
  EXPECT_EQ(count.load(), 10);
}

TEST_P(Threading, NestedLoopsRunOnTheCallingWorker) {
  ScopedThreads scope(3);
  std::atomic<int> count{0};
  parallel_for(4, [&](int64_t) {
    const ParallelLoop inner(5);
    EXPECT_EQ(inner.workers(), 1);
    PerWorker<int> scratch(inner);
    inner.run([&](int64_t, int w) {
      scratch[w] += 1;
      ++count;
    });
  });
  EXPECT_EQ(count.load(), 20);
}

TEST(ThreadPool, ThreadCountOutsideItsRangeIsAnError) {
  for (int n : {0, -1, kMaxThreads + 1, 100000})
    EXPECT_NE(testing::error_of([&] { set_num_threads(n); }).find("set_num_threads: n must be in [1, 1024]"),
              std::string::npos)
        << n;
  ScopedThreads scope(kMaxThreads);  // the largest is accepted
  EXPECT_EQ(num_threads(), kMaxThreads);
}

// Two callers, one worker each: each caller's only task waits until the other caller's task
// has started. A process-wide lock around loops would deadlock here (caught by the timeout).
TEST_P(Threading, ConcurrentCallersRunAtTheSameTime) {
  for (int threads : {1, 2}) {
    ScopedThreads scope(threads);
    std::mutex mu;
    std::condition_variable cv;
    int inside = 0;
    std::atomic<int> met{0};
    auto caller = [&] {
      parallel_for(1, [&](int64_t) {
        std::unique_lock<std::mutex> lock(mu);
        ++inside;
        cv.notify_all();
        // Only a deadlock reaches the limit: the other caller starts in microseconds.
        if (cv.wait_for(lock, std::chrono::seconds(120), [&] { return inside >= 2; })) ++met;
      });
    };
    std::thread a(caller), b(caller);
    a.join();
    b.join();
    EXPECT_EQ(met.load(), 2) << "the two loops did not overlap";
  }
}

// set_num_threads from another thread while loops with per-worker scratch run: each loop keeps
// the worker count it was made with, so scratch always covers the ids (ASan checks the writes).
TEST_P(Threading, SetNumThreadsWhileLoopsRun) {
  ScopedThreads scope(2);
  std::atomic<bool> done{false};
  std::thread toggler([&] {
    int n = 1;
    while (!done.load()) {
      set_num_threads(n);
      n = n % 16 + 1;
      std::this_thread::yield();
    }
  });
  int64_t total = 0;
  for (int rep = 0; rep < 300; ++rep) {
    const ParallelLoop loop(rep % 20 + 1);
    PerWorker<std::vector<int64_t>> scratch(loop, [] { return std::vector<int64_t>(8, 0); });
    loop.run([&](int64_t t, int w) { scratch[w][static_cast<size_t>(t % 8)] += 1; });
    for (int w = 0; w < scratch.size(); ++w)
      for (int64_t x : scratch[w]) total += x;
  }
  done = true;
  toggler.join();
  int64_t want = 0;
  for (int rep = 0; rep < 300; ++rep) want += rep % 20 + 1;
  EXPECT_EQ(total, want);
}

std::atomic<bool> g_stop_requested{false};
std::atomic<int> g_polls{0};
bool poll_for_test() {
  ++g_polls;
  return g_stop_requested.load();
}

// A forked child runs loops too: on the OpenMP pool, the child has none of the parent's team
// (libgomp would wait for it forever), so it goes back to its own helpers. The child's loop
// would hang rather than fail, so an alarm ends it.
TEST_P(Threading, AForkedChildRunsLoops) {
  ScopedThreads scope(3);
  std::atomic<int> count{0};
  parallel_for(30, [&](int64_t) { ++count; });  // the parent's pool is up
  ASSERT_EQ(count.load(), 30);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(60);
    std::atomic<int> in_child{0};
    parallel_for(30, [&](int64_t) { ++in_child; });
    _exit(in_child.load() == 30 && thread_pool() == "own" ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child's loop did not end (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(thread_pool().substr(0, 6), GetParam() == Pool::OpenMP ? "openmp" : "own");  // the parent's is kept
}

// A poll that says stop ends the loop with Interrupted, from tasks that are long (they reach an
// interruption point) on every worker. The stop is asked for from inside the loop, once a task
// has made progress, not after a fixed time; the loop then ends long before it would have run
// to the end: each task sleeps at least 100 × 1 ms, so all 1000 take at least 100 s / threads.
TEST_P(Threading, InterruptPollStopsALoop) {
  for (int threads : {1, 3}) {
    ScopedThreads scope(threads);
    g_stop_requested = false;
    g_polls = 0;
    set_interrupt_poll(poll_for_test);
    const auto t0 = std::chrono::steady_clock::now();
    std::atomic<int64_t> finished{0};
    EXPECT_THROW(parallel_for(1000,
                              [&](int64_t) {
                                for (int i = 0; i < 100; ++i) {
                                  std::this_thread::sleep_for(std::chrono::milliseconds(1));
                                  if (i == 10) g_stop_requested = true;
                                  interruption_point();
                                }
                                ++finished;
                              }),
                 Interrupted);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    set_interrupt_poll(nullptr);
    const double uninterrupted_at_least = 1000 * 0.1 / threads;
    EXPECT_LT(seconds, uninterrupted_at_least / 2) << threads << " threads";
    EXPECT_LT(finished.load(), 1000);
    EXPECT_GT(g_polls.load(), 0);
    // Polling off again: loops run to the end.
    std::atomic<int> count{0};
    parallel_for(10, [&](int64_t) { ++count; });
    EXPECT_EQ(count.load(), 10);
  }
}

}  // namespace
}  // namespace linattn
