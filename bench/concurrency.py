"""Two Python threads calling linattn at once: throughput against one thread, and the same
results. Each call uses `--threads` workers (default 1); on a machine with at least
2 × threads cores the two callers should each run at full speed (speed-up near 2).

    PYTHONPATH=build/python .venv/bin/python bench/concurrency.py [--threads T] [--n N] [--calls C]
"""
import argparse
import threading
import time

import numpy as np

import linattn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--calls", type=int, default=6)
    a = p.parse_args()
    linattn.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((1, 4, a.n, 64)).astype(np.float32) for _ in range(3)]
    w = linattn.random_features(256, 64)
    calls = {
        "softmax_attention": lambda: linattn.softmax_attention(*x),
        "favor_attention": lambda: linattn.favor_attention(*x, w),
        "nystrom_attention": lambda: linattn.nystrom_attention(*x),
    }
    print(f"linattn {linattn.__version__}, {linattn.build_info()}")
    print(f"B=1 H=4 n={a.n} d=64 float32, {a.threads} worker(s) per call, {a.calls} calls per thread")
    print(f"{'function':<20} {'1 thread (s)':>13} {'2 threads (s)':>14} {'throughput x':>13}  same results")
    for name, call in calls.items():
        want = call()
        call()  # warm-up
        t0 = time.perf_counter()
        for _ in range(2 * a.calls):
            call()
        serial = time.perf_counter() - t0
        outs = []

        def worker():
            for _ in range(a.calls):
                outs.append(call())

        threads = [threading.Thread(target=worker) for _ in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        parallel = time.perf_counter() - t0
        same = all(np.array_equal(o, want) for o in outs)
        print(f"{name:<20} {serial:13.2f} {parallel:14.2f} {serial / parallel:13.2f}  {same}")


if __name__ == "__main__":
    main()
