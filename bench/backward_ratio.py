"""Forward+backward time over forward time of the kernelized methods (elu, FAVOR+), with the
backward from the forward's saved den and state and, for comparison, the one that runs the
forward again: the figures of docs/methods/kernelized.md (issue 12's target: <= 3.0x
non-causal, <= 3.5x causal at n >= 4096).

Usage: .venv/bin/python bench/backward_ratio.py [THREADS [N]]   (defaults 1, 4096)
Inputs B=1, H=8, d=d_v=64, float32, m=256 orthogonal features. The forward, the forward saving
den and state, and the backward from them run interleaved, one call of each per round as in
training, 31 rounds after one warm-up; the table gives their medians, the ratio of the medians
and the median of the per-round ratios (robust to this shared machine's drift). The backward
that recomputes the forward is timed afterwards on its own (15 rounds): interleaved, its larger
allocations perturbed the calls around it. FLOPs per forward (FAVOR, the registry's count):
4·n·m·(d + d_v)·B·H."""
import sys
import time

import numpy as np

import linattn

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
n = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
linattn.set_num_threads(threads)
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, 8, n, 64), dtype=np.float32) * 0.5 for _ in range(4))
w = linattn.random_features(256, 64, seed=1)


def rounds_s(fns, reps):
    """`reps` timings of each function, taken in interleaved rounds (one call of each per round)
    after one warm-up, so drift in this shared machine's speed hits all alike."""
    for f in fns:
        f()
    times = [[] for _ in fns]
    for _ in range(reps):
        for f, t in zip(fns, times):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
    return times


def median(x):
    return sorted(x)[len(x) // 2]


print("threads=%d n=%d B=1 H=8 d=64 float32" % (threads, n))
print("| method | causal | forward ms | forward saving den, state ms | backward from saved ms | "
      "backward recomputing ms | (fwd+bwd)/fwd: of medians | per round, median |")
print("|---|---|---|---|---|---|---|---|")
for name, fwd, bwd in [
        ("elu", lambda c, **kw: linattn.linear_attention(q, k, v, causal=c, **kw),
         lambda c, **kw: linattn.linear_attention_backward(q, k, v, dout, causal=c, **kw)),
        ("favor+", lambda c, **kw: linattn.favor_attention(q, k, v, w, causal=c, **kw),
         lambda c, **kw: linattn.favor_attention_backward(q, k, v, w, dout, causal=c, **kw))]:
    for causal in (False, True):
        out, den, state = fwd(causal, return_den=True, return_state=True)
        f, fs, b = rounds_s([lambda: fwd(causal), lambda: fwd(causal, return_den=True, return_state=True),
                             lambda: bwd(causal, out=out, den=den, state=state)], 31)
        (br,) = rounds_s([lambda: bwd(causal)], 15)
        per_round = median([(fs[i] + b[i]) / f[i] for i in range(len(f))])
        f, fs, b, br = (1e3 * median(t) for t in (f, fs, b, br))
        print("| %s | %s | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f |"
              % (name, causal, f, fs, b, br, (fs + b) / f, per_round), flush=True)
