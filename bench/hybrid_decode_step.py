"""One decoding step of the causal hybrid (linattn hybrid_decode_step, what LinattnCache runs per
layer and token) at a converted SmolLM2-135M's shape: 9 query heads, d = 64, m' = 64 (Hedgehog
f = 32), a window of 1024 and 4 sinks (the saved conversion's, docs/linearize.md), decay,
float32, batch 1. The exact slots kept per key head (3, as the model makes them) against one per
query head (9); the features given (a fixed map's, made by the caller) against Hedgehog's maps,
which the step applies itself (the converted model's case); and a window of 64, issue 43's
shape for its 0.05 ms target.

"Cold" is a model's case: 30 layers' states stepped in turn, and a 64 MB array touched between
tokens (the weights a model streams through the caches), so each step reads its window from
memory; "warm" steps one layer's state again and again. Each figure is the median of every step
after a warm-up token, microseconds, at the thread counts given.

    .venv/bin/python bench/hybrid_decode_step.py --docs docs/methods/hybrid.md

Writes the measured section of docs/methods/hybrid.md (between its MEASURED markers for this
script)."""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import linattn
from linattn import _linattn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_section  # noqa: E402
from bf16 import cpu_line  # noqa: E402

H, D, M, SINKS, WINDOW, LAYERS, TOKENS = 9, 64, 64, 4, 1024, 30, 12


def states(kv_heads, window, rng):
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return [dict(sums=np.zeros((1, H, M, D), np.float32), normaliser=np.zeros((1, H, M), np.float32),
                 exact_keys=f32(1, kv_heads, SINKS + window, D) * 0.1, exact_values=f32(1, kv_heads, SINKS + window, D),
                 exact_valid=np.ones((1, SINKS + window), bool), counts=np.full(1, 1000, np.int64))
            for _ in range(LAYERS)]


def median_step_us(kv_heads, window, maps, cold):
    """maps: Hedgehog's maps (f = M / 2) go in and the step makes the features; else given."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    args = dict(q=f32(1, H, D), k=f32(1, kv_heads, D), v=f32(1, kv_heads, D), advance=np.ones(1, bool),
                window_weight=np.full(H, 0.5, np.float32), log_decay=np.full(H, -0.01, np.float32))
    if maps:
        args.update(query_features=None, leaving_features=None, query_weight=f32(H, D, M // 2) * 0.1,
                    query_bias=f32(H, M // 2), key_weight=f32(H, D, M // 2) * 0.1, key_bias=f32(H, M // 2))
    else:
        args.update(query_features=np.abs(f32(1, H, M)), leaving_features=np.abs(f32(1, H, M)) * 0.01)
    layers = states(kv_heads, window, rng) if cold else states(kv_heads, window, rng)[:1] * LAYERS
    other = np.ones(64 * 2**20 // 4, np.float32)
    times = []
    for token in range(TOKENS):
        if cold:
            other += 1
        for state in layers:
            t0 = time.perf_counter()
            _linattn.hybrid_decode_step(**args, **state, window=window, sinks=SINKS, scale=0.125, eps=1e-6)
            if token:
                times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--docs", help="a docs/ page whose measured section this run writes")
    a = parser.parse_args()
    rows = ["| threads | key heads | window | features | cold µs | warm µs |", "|---|---|---|---|---|---|"]
    cases = [(H, WINDOW, False), (3, WINDOW, False), (3, WINDOW, True), (3, 64, False), (3, 64, True)]
    for threads in a.threads:
        linattn.set_num_threads(threads)
        for kv_heads, window, maps in cases:
            cold, warm = median_step_us(kv_heads, window, maps, True), median_step_us(kv_heads, window, maps, False)
            rows.append("| %d | %d | %d + %d | %s | %.0f | %.0f |" % (threads, kv_heads, window, SINKS,
                                                                   "Hedgehog's maps" if maps else "given", cold, warm))
            print(rows[-1], flush=True)
    body = ("Measured with `.venv/bin/python bench/hybrid_decode_step.py --docs docs/methods/hybrid.md` on %s "
            "(%s): one `hybrid_decode_step` at 9 query heads, d = 64, m' = 64, 4 sinks, decay, float32, the exact "
            "slots per key head (3) or per query head (9), the features given or made by the step from Hedgehog's "
            "maps (f = 32); cold: 30 layers' states in turn and 64 MB touched between tokens, as in a model; warm: "
            "one state again and again. Medians, including the Python call.\n\n%s"
            % (cpu_line(), linattn.build_info(), "\n".join(rows)))
    if a.docs:
        measured_section.write(a.docs, "hybrid_decode_step.py", body)
    print(body)


if __name__ == "__main__":
    main()
