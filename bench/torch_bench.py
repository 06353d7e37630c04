"""The PyTorch side of `linattn bench`: the same inputs through plain-PyTorch implementations of
each method, timed the way linattn times its own (one warm-up, then the median of >= 5 runs and
>= 1 s, or of 2 runs from n = 16384).

Usage (the linattn program runs this; one call per sequence length):
    python3 torch_bench.py REQUESTS.csv RESULTS.csv
REQUESTS.csv: dir,method,causal,pass,batch,heads,n,head_dim,threads
  dir holds q.f32, k.f32, v.f32, dout.f32 ([B,H,n,d] float32, raw), and where the method needs
  them favor_w_<m>.f32 ([m,d]) and linformer_<s>_e.f32, linformer_<s>_f.f32 ([s,n]): the
  random features and projections linattn itself used.
RESULTS.csv: method,causal,pass,status,median_s,runs,rss_growth_bytes,note
  status is ok, skipped (would not fit in memory) or unavailable (no such PyTorch version).
  rss_growth_bytes: growth of the peak resident memory over one call, measured in a fresh
  process (python3 torch_bench.py --memory REQUESTS.csv INDEX) so no memory cached from
  earlier calls hides what the call needs.

PyTorch gets its best conditions: torch.set_num_threads(threads) (it starts with 1 on these
machines) and OMP_WAIT_POLICY=passive (set before torch is imported), so idle OpenMP threads do
not spin against the BLAS threads.
"""
import csv
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


# ---- the methods, in plain PyTorch ----------------------------------------------------------

def exact(q, k, v, causal, extra):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def kernelized(fq, fk, v, causal, eps):
    """φ(q)(φ(k)ᵀv) / (φ(q)·Σφ(k) + eps); causal by prefix sums (cumsum) of φ(k)⊗v."""
    if not causal:
        kv = fk.transpose(-1, -2) @ v
        den = fq @ fk.sum(-2).unsqueeze(-1)
        return (fq @ kv) / (den + eps)
    kv = torch.cumsum(fk.unsqueeze(-1) * v.unsqueeze(-2), dim=-3)  # [B,H,n,m,dv]
    num = (fq.unsqueeze(-1) * kv).sum(-2)
    den = (fq * torch.cumsum(fk, dim=-2)).sum(-1, keepdim=True)
    return num / (den + eps)


def elu(q, k, v, causal, extra):
    return kernelized(F.elu(q) + 1, F.elu(k) + 1, v, causal, 1e-6)


def favor(q, k, v, causal, extra):
    w = extra["favor_w"]
    d, m = q.shape[-1], w.shape[0]
    c = d ** -0.25  # x scaled by sqrt(scale), scale = 1/sqrt(d)

    def phi(x, shift):
        x = x * c
        u = x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)
        return torch.exp(u - shift(u)) / math.sqrt(m)

    # Stabilisers that cancel in the ratio: per query row; one constant for all keys.
    fq = phi(q, lambda u: u.amax(-1, keepdim=True).detach())
    fk = phi(k, lambda u: u.amax(dim=(-1, -2), keepdim=True).detach())
    return kernelized(fq, fk, v, causal, 0.0)


def nystrom(q, k, v, causal, extra):
    m, iters = extra["landmarks"], 6
    B, H, n, d = q.shape
    s = 1 / math.sqrt(d)
    pool = lambda x: F.adaptive_avg_pool1d(x.reshape(B * H, n, d).transpose(1, 2), m).transpose(1, 2).reshape(B, H, m, d)
    qt, kt = pool(q), pool(k)
    f1 = (s * q @ kt.transpose(-1, -2)).softmax(-1)
    a = (s * qt @ kt.transpose(-1, -2)).softmax(-1)
    f3 = (s * qt @ k.transpose(-1, -2)).softmax(-1)
    eye = torch.eye(m)
    z = a.transpose(-1, -2) / (a.abs().sum(-2).amax(-1) * a.abs().sum(-1).amax(-1))[..., None, None]
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return f1 @ (z @ (f3 @ v))


def linformer(q, k, v, causal, extra):
    e, f = extra["linformer_e"], extra["linformer_f"]
    s = 1 / math.sqrt(q.shape[-1])
    return (s * q @ (e @ k).transpose(-1, -2)).softmax(-1) @ (f @ v)


def efficient(q, k, v, causal, extra):
    s = 1 / math.sqrt(q.shape[-1])
    return (s * q).softmax(-1) @ ((s * k).softmax(-2).transpose(-1, -2) @ v)


METHODS = {"exact softmax": exact, "linear elu": elu, "favor+": favor, "nystrom": nystrom,
           "linformer": linformer, "efficient attention": efficient}


def implementation(name):
    for prefix, fn in METHODS.items():
        if name.startswith(prefix):
            return fn
    return None


def bytes_needed(name, causal, B, H, n, d, m, backward):
    """Rough peak of the PyTorch implementation (float32), to skip what cannot fit."""
    f = 4 * B * H
    if name.startswith("exact"):
        per = 3 * n * n  # scores, softmax, (mask) — and their gradients
    elif causal:  # prefix sums of φ(k)⊗v and their products
        per = 2 * n * m * d
    else:
        per = 6 * n * max(m, d)
    return f * per * (3 if backward else 1)


def available_bytes():
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_reset():
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def status_bytes(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return -1


def load(path, shape):
    return torch.from_numpy(np.fromfile(path, dtype=np.float32).reshape(shape))


def time_runs(run, n):
    runs = 2 if n >= 16384 else 5
    times, start = [], time.perf_counter()
    while len(times) < runs or (n < 16384 and time.perf_counter() - start < 1.0):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), len(times)


def prepare(r, cache):
    """The implementation, inputs, extra parameters and estimated peak bytes of one request."""
    B, H, n, d = (int(r[x]) for x in ("batch", "heads", "n", "head_dim"))
    name, causal, backward = r["method"], r["causal"] == "1", r["pass"] == "fwd+bwd"
    fn = implementation(name)
    if fn is None:
        return None
    key = r["dir"]
    if key not in cache:
        cache.clear()
        shape = (B, H, n, d)
        cache[key] = {x: load(os.path.join(key, x + ".f32"), shape) for x in ("q", "k", "v", "dout")}
    t = cache[key]
    extra = {"landmarks": 64}
    m = d
    if name.startswith("favor+"):
        m = int(name.split("m=")[1].split()[0])
        extra["favor_w"] = load(os.path.join(key, "favor_projection_%d.f32" % m), (m, d))
    if name.startswith("nystrom"):
        extra["landmarks"] = m = int(name.split("m=")[1].split()[0])
    if name.startswith("linformer"):
        s = int(name.split("s=")[1].split()[0])
        m = s
        extra["linformer_e"] = load(os.path.join(key, "linformer_e_%d.f32" % s), (s, n))
        extra["linformer_f"] = load(os.path.join(key, "linformer_f_%d.f32" % s), (s, n))
    need = bytes_needed(name, causal, B, H, n, d, m, backward)

    if backward:
        params = [t["q"], t["k"], t["v"]] + [extra[x] for x in ("linformer_e", "linformer_f") if x in extra]

        def run():
            ps = [p.detach().requires_grad_(True) for p in params]
            ex = dict(extra)
            if "linformer_e" in ex:
                ex["linformer_e"], ex["linformer_f"] = ps[3], ps[4]
            y = fn(ps[0], ps[1], ps[2], causal, ex)
            y.backward(t["dout"])
    else:
        def run():
            with torch.no_grad():
                fn(t["q"], t["k"], t["v"], causal, extra)
    return run, need


def measure_memory(requests_path, index):
    """Peak RSS growth of one call of request `index`, in this fresh process: with nothing freed
    and cached by the allocator yet, the high-water mark sees every byte the call needs."""
    r = list(csv.DictReader(open(requests_path)))[index]
    torch.set_num_threads(int(r["threads"]))
    run, _ = prepare(r, {})
    if not rss_reset():
        print(-1)
        return
    before = status_bytes("VmRSS:")
    run()
    print(status_bytes("VmHWM:") - before)


def main(requests_path, results_path):
    rows = list(csv.DictReader(open(requests_path)))
    out = open(results_path, "w", newline="")
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["method", "causal", "pass", "status", "median_s", "runs", "rss_growth_bytes", "note"])
    cache = {}
    for index, r in enumerate(rows):
        n = int(r["n"])
        torch.set_num_threads(int(r["threads"]))
        prepared = prepare(r, cache)
        if prepared is None:
            w.writerow([r["method"], r["causal"], r["pass"], "unavailable", "", "", "", "no PyTorch version"])
            continue
        run, need = prepared
        if need > 0.6 * available_bytes():
            w.writerow([r["method"], r["causal"], r["pass"], "skipped", "", "", need,
                        "would need about %.1f GiB" % (need / 2**30)])
            out.flush()
            continue
        run()  # warm-up
        median, runs = time_runs(run, n)
        # Memory in a fresh process: in this one, memory freed by earlier calls stays mapped and
        # is reused, so the high-water mark would under-count.
        mem = subprocess.run([sys.executable, __file__, "--memory", requests_path, str(index)],
                             capture_output=True, text=True)
        growth = int(mem.stdout.split()[-1]) if mem.returncode == 0 and mem.stdout.split() else -1
        w.writerow([r["method"], r["causal"], r["pass"], "ok", median, runs, growth, ""])
        out.flush()


if __name__ == "__main__":
    if sys.argv[1] == "--memory":
        measure_memory(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[1], sys.argv[2])
