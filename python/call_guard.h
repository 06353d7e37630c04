// Kernels run with the GIL released, from any Python thread, daemon threads included. When the
// interpreter exits while such a call runs, two things used to abort the process:
//
// 1. Taking the GIL back. Python 3.11 ends a thread that asks for the GIL once finalization
//    has begun with pthread_exit(), whose forced unwind calls std::terminate ("terminate called
//    without an active exception") when it crosses a noexcept frame, such as
//    pybind11::gil_scoped_release's destructor.
// 2. Static destructors. exit() runs OpenBLAS's teardown, which frees its buffers while the
//    call is still inside sgemm ("BLAS : Bad memory unallocation").
//
// So an atexit hook (registered at import; it runs after Python has joined the non-daemon
// threads, so any call still running is on a daemon thread) tells running calls to stop (the
// interrupt poll answers "stop" on every thread) and waits until none is inside the library.
// A thread other than the main one whose call ends after that, or that starts one, parks for
// good without the GIL, as Python 3.14 parks daemon threads itself: the process's exit ends it.
// The main thread is running the atexit hooks themselves, and its calls (from a hook registered
// before linattn was imported) run as usual.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

namespace linattn_python {

namespace py = pybind11;

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Calls inside the library, and whether the interpreter is exiting.
class Calls {
 public:
  static Calls& get() {
    static Calls* calls = new Calls();  // leaked: parked threads still see it during exit
    return *calls;
  }
  // The thread that imported the module, Python's main thread.
  void set_main_thread() { main_ = std::this_thread::get_id(); }
  // Whether this thread must park rather than go on: the interpreter is exiting and this is
  // not the main thread.
  bool must_park() const {
    return (exiting_.load() || interpreter_finalizing()) && std::this_thread::get_id() != main_;
  }
  // false when the call must not start (must_park()).
  bool enter() {
    std::lock_guard<std::mutex> lock(mu_);
    if (must_park()) return false;
    ++inside_;
    return true;
  }
  void leave() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--inside_ == 0) none_inside_.notify_all();
  }
  // The atexit hook: from now on polls say stop; waits (GIL released) until every call has
  // left. Kernels reach an interruption point every few milliseconds; the bound only keeps a
  // wedged call from hanging the exit, and says so.
  void exit_begins() {
    exiting_.store(true);
    py::gil_scoped_release nogil;
    std::unique_lock<std::mutex> lock(mu_);
    if (!none_inside_.wait_for(lock, std::chrono::seconds(60), [&] { return inside_ == 0; }))
      std::fprintf(stderr, "linattn: %d call(s) still running 60 s after exit began; exiting anyway\n", inside_);
  }

 private:
  std::mutex mu_;
  std::condition_variable none_inside_;
  int inside_ = 0;
  std::atomic<bool> exiting_{false};
  std::thread::id main_;
};

[[noreturn]] inline void park_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// fn() with the GIL released; its result, or its exception once the GIL is held again. The
// GIL is taken back by a plain call, not a destructor: should finalization begin between the
// test and the take, Python's pthread_exit unwinds through here and pybind11's dispatcher
// (which rethrows abi::__forced_unwind) with no noexcept frame in its way.
template <class Fn>
auto run_without_gil(Fn&& fn) -> std::invoke_result_t<Fn&> {
  using R = std::invoke_result_t<Fn&>;
  Calls& calls = Calls::get();
  PyThreadState* state = PyEval_SaveThread();
  if (!calls.enter()) park_forever();
  std::optional<R> result;
  std::exception_ptr error;
  try {
    result.emplace(fn());
  } catch (...) {
    error = std::current_exception();
  }
  calls.leave();
  if (calls.must_park()) park_forever();
  PyEval_RestoreThread(state);
  if (error) std::rethrow_exception(error);
  return std::move(*result);
}

}  // namespace linattn_python
