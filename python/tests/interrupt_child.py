"""Ctrl-C during a long call, in a process of its own (test_reliability.py runs it, so that no
signal can reach the test runner): `python interrupt_child.py THREADS`. Prints one JSON line.

The call is sized from a measured one so that it would take at least TARGET_S; SIGINT is sent
once the call is inside the library (its workspace is allocated), not after a fixed time. On
a machine so loaded that the signal still arrives after the call returned, the attempt is
reported as "late" and repeated with a call twice as long.

`python interrupt_child.py THREADS openmp` imports linattn.torch first, so that the loops run on
PyTorch's OpenMP team (linattn.share_openmp_runtime) and the call is interrupted there."""
import importlib
import json
import math
import os
import signal
import sys
import threading
import time

import numpy as np

import linattn

TARGET_S = 2.0
SHAPE = (1, 2)  # batch·heads = 2: the test runs 1 and 3 threads, below and above it
D = 64


def timed(q):
    t0 = time.perf_counter()
    linattn.softmax_attention(q, q, q)
    return time.perf_counter() - t0


def attempt(q):
    """One interrupted call: what happened and when (seconds, perf_counter)."""
    done = threading.Event()
    times = {}

    def send_when_inside():
        while linattn.workspace_stats()["current_bytes"] == 0:
            if done.is_set():
                return
            time.sleep(1e-3)
        times["signal"] = time.perf_counter()
        os.kill(os.getpid(), signal.SIGINT)

    watcher = threading.Thread(target=send_when_inside)
    outcome = "finished"
    try:
        try:
            watcher.start()
            times["start"] = time.perf_counter()
            linattn.softmax_attention(q, q, q)
        except KeyboardInterrupt:
            outcome = "interrupted"
        times["end"] = time.perf_counter()
        done.set()
        watcher.join()
        if outcome == "finished" and "signal" in times:
            time.sleep(1.0)  # the signal is on its way; let the handler raise here
    except KeyboardInterrupt:
        outcome = "late"  # the call had returned when the signal arrived
    return outcome, times


def main():
    # Python installs its Ctrl-C handler only when SIGINT is not ignored at start; a runner
    # started in the background (nohup, `cmd &` without job control) passes SIGINT ignored.
    # The library's polling is what is tested, so the child installs Python's handler itself.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.argv[2:] == ["openmp"]:
        importlib.import_module("linattn.torch")
        assert linattn.thread_pool().startswith("openmp "), linattn.thread_pool()
    linattn.set_num_threads(int(sys.argv[1]))
    rng = np.random.default_rng(0)
    n0 = 1024
    q0 = rng.standard_normal((*SHAPE, n0, D)).astype(np.float32)
    base = sorted(timed(q0) for _ in range(3))[1]
    n = max(n0, int(math.ceil(n0 * math.sqrt(TARGET_S / base) / 64)) * 64)  # cost grows as n²
    attempts = []
    for _ in range(3):
        predicted = base * (n / n0) ** 2
        q = rng.standard_normal((*SHAPE, n, D)).astype(np.float32)
        outcome, times = attempt(q)
        attempts.append({"n": n, "predicted_s": predicted, "outcome": outcome, **times})
        if outcome != "late" and outcome != "finished":
            break
        n = int(n * math.sqrt(2))
    small = q0[:, :, :64]
    after = bool(np.isfinite(linattn.softmax_attention(small, small, small)).all())
    print(json.dumps({"attempts": attempts, "works_after": after, "pool": linattn.thread_pool()}))


if __name__ == "__main__":
    main()
