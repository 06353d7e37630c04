// How many threads linattn's kernels use, and how a long call is interrupted.
#pragma once

#include <stdexcept>
#include <string>

namespace linattn {

// The largest thread count set_num_threads accepts (users' machines have up to a few hundred
// hardware threads; more only oversubscribes them).
inline constexpr int kMaxThreads = 1024;

// Threads a call may use: set_num_threads's n; else LINATTN_NUM_THREADS (an integer in
// [1, kMaxThreads], else every call throws Error); else, while the loops run on a shared OpenMP
// runtime, that runtime's omp_get_max_threads() (torch.set_num_threads under linattn.torch);
// else the hardware's thread count. At most kMaxThreads.
int num_threads();
// Sets the thread count for calls made from now on; n in [1, kMaxThreads], else Error. Safe to
// call while other threads run kernels: those keep the worker count they started with.
// Several threads may call kernels at once; each call runs on its caller's thread plus the
// shared pool's idle helpers, so nothing queues behind a process-wide lock.
void set_num_threads(int n);

// Runs the kernels' parallel loops on the OpenMP runtime that another library already loaded
// into the process (libgomp, or a runtime with its ABI such as Intel's libiomp5), instead of on
// linattn's own helper threads. linattn.torch calls it at import when PyTorch runs on OpenMP:
// two pools on the same cores fight, since OpenMP's idle workers spin for milliseconds after
// each of PyTorch's parallel operations (libgomp's default wait policy) and linattn's helpers
// lose their cores to them meanwhile; on one shared team the spinning workers take linattn's
// tasks instead. Returns the runtime's file, or "" when none is loaded (nothing changes).
// Results are the same bits either way: tasks and per-worker scratch do not depend on the pool.
// through: an already loaded library (e.g. "libtorch_cpu.so") whose OpenMP runtime to share, the
// one its symbols bind to, whatever that runtime's file is called; "" looks for libgomp.so.1,
// then libiomp5.so. A forked child goes back to linattn's own threads.
std::string share_openmp_runtime(const std::string& through = "");
// Back to linattn's own helper threads (the default).
void use_own_threads();
// Which threads run the loops: "own" or "openmp <runtime's file>".
std::string thread_pool();

// Thrown out of a call when the interrupt poll said stop.
class Interrupted : public std::runtime_error {
 public:
  Interrupted() : std::runtime_error("linattn: interrupted") {}
};

// A poll for "stop now" (the Python module installs one that checks for KeyboardInterrupt).
// It is called only on the thread that made the call, between blocks of work, at most every
// 20 ms. nullptr (the default) disables polling.
using InterruptPoll = bool (*)();
void set_interrupt_poll(InterruptPoll poll);

}  // namespace linattn
