"""bfloat16 against float32, and against torch's scaled_dot_product_attention in bfloat16: the
same inputs through linattn.torch and torch, on the same threads.

    make bench            (runs this after `linattn bench`, OPENBLAS_CORETYPE unset)
    .venv/bin/python bench/bf16.py --docs docs/benchmarks.md

Exact attention: linattn.torch.softmax_attention and F.scaled_dot_product_attention, each in
float32 and bfloat16, forward and forward+backward, causal and not. Linear methods: their
bfloat16 time against their float32 time. Medians of 5 runs after one warm-up (3 at the
largest n). B = 1, H = 8, d = 64; FLOPs as linattn's registry counts them (exact: 4·n²·d per
head forward, causal half)."""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import linattn
import linattn.torch as lt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_section  # noqa: E402


def median_time(fn, runs):
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def inputs(n, dtype, grad, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 8, n, 64, generator=g).to(dtype).requires_grad_(grad) for _ in range(3)]


def run(call, q, k, v, backward):
    def fn():
        out = call(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))
            for t in (q, k, v):
                t.grad = None
    return fn


def exact_rows(ns):
    rows = []
    for n in ns:
        runs = 3 if n >= 8192 else 5
        for causal in (False, True):
            flops_fwd = 4 * 8 * n * n * 64 * (0.5 if causal else 1.0)
            for backward in (False, True):
                flops = flops_fwd * (3.5 if backward else 1.0)  # backward: 2.5× the forward's FLOPs
                row = {"n": n, "causal": causal, "pass": "fwd+bwd" if backward else "fwd", "gflop": flops * 1e-9}
                for label, call in (("linattn", lambda q, k, v: lt.softmax_attention(q, k, v, causal=causal)),
                                    ("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))):
                    for dtype in (torch.float32, torch.bfloat16):
                        q, k, v = inputs(n, dtype, backward)
                        row["%s %s" % (label, str(dtype)[6:])] = median_time(run(call, q, k, v, backward), runs)
                rows.append(row)
                print(row, flush=True)
    return rows


def linear_rows(ns):
    w = torch.from_numpy(linattn.random_features(256, 64))
    methods = [("linear elu", lambda q, k, v, c: lt.linear_attention(q, k, v, causal=c)),
               ("favor+ m=256", lambda q, k, v, c: lt.favor_attention(q, k, v, w.to(q.dtype), causal=c))]
    rows = []
    for n in ns:
        for name, call in methods:
            for causal in (False, True):
                for backward in (False, True):
                    row = {"method": name + (" (causal)" if causal else ""), "n": n,
                           "pass": "fwd+bwd" if backward else "fwd"}
                    for dtype in (torch.float32, torch.bfloat16):
                        q, k, v = inputs(n, dtype, backward)
                        row[str(dtype)[6:]] = median_time(run(lambda a, b, c: call(a, b, c, causal), q, k, v, backward), 5)
                    rows.append(row)
                    print(row, flush=True)
    return rows


def cpu_line():
    model = "unknown CPU"
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    shown = [x for x in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile") if x in flags]
    return "%s, %d cores (%s)" % (model, os.cpu_count(), " ".join(shown))


def markdown(exact, linear, threads):
    lines = ["Machine: %s; %d threads (linattn and torch); torch %s; %s; OPENBLAS_CORETYPE %s."
             % (cpu_line(), threads, torch.__version__, linattn.build_info(),
                os.environ.get("OPENBLAS_CORETYPE", "unset")), "",
             "**Exact attention** (ms; × is SDPA's time over linattn's, above 1 when linattn is faster):", "",
             "| n | causal | pass | GFLOP | linattn fp32 | linattn bf16 | sdpa fp32 | sdpa bf16 | fp32: × sdpa | "
             "bf16: × sdpa bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in exact:
        lines.append("| %d | %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f |" % (
            r["n"], "yes" if r["causal"] else "no", r["pass"], r["gflop"], 1e3 * r["linattn float32"],
            1e3 * r["linattn bfloat16"], 1e3 * r["sdpa float32"], 1e3 * r["sdpa bfloat16"],
            r["sdpa float32"] / r["linattn float32"], r["sdpa bfloat16"] / r["linattn bfloat16"]))
    lines += ["", "**Linear methods in bfloat16** (ms; × is the float32 time over the bfloat16 time):", "",
              "| method | n | pass | float32 | bfloat16 | × |", "|---|---|---|---|---|---|"]
    for r in linear:
        lines.append("| %s | %d | %s | %.1f | %.1f | %.2f |" % (r["method"], r["n"], r["pass"], 1e3 * r["float32"],
                                                              1e3 * r["bfloat16"], r["float32"] / r["bfloat16"]))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", help="the page whose MEASURED section (bench/bf16.py) gets the tables")
    ap.add_argument("--exact-n", default="1024,4096,8192")
    ap.add_argument("--linear-n", default="4096,16384")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    linattn.set_num_threads(a.threads)
    print(platform.node(), cpu_line(), linattn.build_info(), flush=True)
    exact = exact_rows([int(x) for x in a.exact_n.split(",") if x])
    linear = linear_rows([int(x) for x in a.linear_n.split(",") if x])
    text = markdown(exact, linear, a.threads)
    print(text)
    if a.docs:
        measured_section.write(a.docs, "bf16.py", text)


if __name__ == "__main__":
    main()
