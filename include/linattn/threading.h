// How many threads linattn's kernels use, and how a long call is interrupted.
#pragma once

#include <stdexcept>

namespace linattn {

// The largest thread count set_num_threads accepts (users' machines have up to a few hundred
// hardware threads; more only oversubscribes them).
inline constexpr int kMaxThreads = 1024;

// Threads a call may use. Default: LINATTN_NUM_THREADS (an integer in [1, kMaxThreads], else
// the first call throws Error), otherwise the hardware's thread count, at most kMaxThreads.
int num_threads();
// Sets the thread count for calls made from now on; n in [1, kMaxThreads], else Error. Safe to
// call while other threads run kernels: those keep the worker count they started with.
// Several threads may call kernels at once; each call runs on its caller's thread plus the
// shared pool's idle helpers, so nothing queues behind a process-wide lock.
void set_num_threads(int n);

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
