"""The peers' side of `linattn bench`: the same inputs through what a PyTorch user would otherwise
call, timed the way linattn times its own (one warm-up, then the median of >= 5 runs and >= 1 s,
or of 2 runs from n = 16384). Peers per method (PEERS below): exact attention against
torch.nn.functional.scaled_dot_product_attention (PyTorch 2.x's fused CPU flash kernel);
FAVOR+ against performer-pytorch, Nystrom against nystrom-attention, Linformer against
linformer (lucidrains' packages); every method also against its plain-PyTorch formula.

Usage (the linattn program runs this; one call per sequence length):
    python3 torch_bench.py REQUESTS.csv RESULTS.csv
REQUESTS.csv: dir,method,causal,pass,batch,heads,n,head_dim,threads
  dir holds q.f32, k.f32, v.f32, dout.f32 ([B,H,n,d] float32, raw), and where the method needs
  them favor_projection_<m>.f32 ([m,d]) and linformer_e_<s>.f32, linformer_f_<s>.f32 ([s,n]):
  the random features and projections linattn itself used.
RESULTS.csv: method,causal,pass,peer,status,median_s,runs,rss_growth_bytes,note
  one row per request and peer; status is ok, skipped (would not fit in memory) or
  unavailable (the peer's package cannot be imported).
  rss_growth_bytes: growth of the peak resident memory over one call, measured in a fresh
  process (python3 torch_bench.py --memory REQUESTS.csv INDEX PEER) so no memory cached from
  earlier calls hides what the call needs.

The peers get their best conditions: torch.set_num_threads(threads) (it starts with 1 on these
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


# ---- the peers: what a PyTorch user would otherwise call -----------------------------------
# Each takes the request's float tensors t (q, k, v, dout: [B,H,n,d]) and extra parameters and
# returns (call, leaves, dout): call(*leaves) is one forward, leaves are what gets a gradient
# (fresh copies per run) and dout is the output gradient in the peer's own output layout. Inputs
# are brought into the peer's layout before timing (lucidrains' modules take x as [B, n, H·d]);
# their input and output projections are identities, so only attention itself is timed.

def plain_peer(fn):
    def make(t, extra, causal):
        params = [extra[x] for x in ("linformer_e", "linformer_f") if x in extra]

        def call(q, k, v, *ef):
            ex = dict(extra)
            if ef:
                ex["linformer_e"], ex["linformer_f"] = ef
            return fn(q, k, v, causal, ex)
        return call, [t["q"], t["k"], t["v"]] + params, t["dout"]
    return make


def sdpa_peer(t, extra, causal):
    """torch.nn.functional.scaled_dot_product_attention: on CPU, PyTorch's fused flash kernel."""
    def call(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call, [t["q"], t["k"], t["v"]], t["dout"]


def packed(t):
    """q, k, v as one [B, n, 3·H·d] tensor (lucidrains' layout after the qkv Linear) and dout as
    [B, n, H·d]."""
    B, H, n, d = t["q"].shape
    x = torch.cat([t[s].transpose(1, 2).reshape(B, n, H * d) for s in ("q", "k", "v")], -1).contiguous()
    return x, t["dout"].transpose(1, 2).reshape(B, n, H * d).contiguous()


class Slice(torch.nn.Module):
    """Stands in for a projection Linear: the i-th of three equal slices of the last dimension."""
    def __init__(self, i):
        super().__init__()
        self.i = i

    def forward(self, x):
        w = x.shape[-1] // 3
        return x[..., self.i * w:(self.i + 1) * w]


def performer_peer(t, extra, causal):
    """performer-pytorch's FastAttention (FAVOR+, positive features) with our projection."""
    import contextlib
    import io
    from performer_pytorch import FastAttention
    w = extra["favor_w"]
    with contextlib.redirect_stdout(io.StringIO()):  # it prints that its CUDA kernel is missing
        fa = FastAttention(dim_heads=w.shape[1], nb_features=w.shape[0], causal=causal)
    fa = fa.to(w.dtype)
    fa.projection_matrix.copy_(w)
    return fa, [t["q"], t["k"], t["v"]], t["dout"]


def nystrom_peer(t, extra, causal):
    """nystrom-attention's NystromAttention (no residual conv; identity projections)."""
    from nystrom_attention import NystromAttention
    B, H, n, d = t["q"].shape
    mod = NystromAttention(dim=H * d, dim_head=d, heads=H, num_landmarks=extra["landmarks"],
                           pinv_iterations=6, residual=False).to(t["q"].dtype)
    mod.to_qkv, mod.to_out = torch.nn.Identity(), torch.nn.Identity()
    x, dout = packed(t)
    return mod, [x], dout


def linformer_peer(t, extra, causal):
    """linformer's LinformerSelfAttention with our E, F (proj_k = Eᵀ, proj_v = Fᵀ, which get
    gradients as its parameters); identity projections."""
    from linformer import LinformerSelfAttention
    B, H, n, d = t["q"].shape
    e, f = extra["linformer_e"], extra["linformer_f"]
    mod = LinformerSelfAttention(dim=H * d, seq_len=n, k=e.shape[0], heads=H, dim_head=d).to(t["q"].dtype)
    mod.to_q, mod.to_k, mod.to_v, mod.to_out = Slice(0), Slice(1), Slice(2), torch.nn.Identity()
    with torch.no_grad():
        mod.proj_k.copy_(e.T)
        mod.proj_v.copy_(f.T)
    x, dout = packed(t)
    return mod, [x], dout


# Per method (by name prefix) its peers, in the order printed; causal tells whether the peer has
# a causal form.
PEERS = {
    "exact softmax": [("torch sdpa", sdpa_peer, True), ("torch plain", plain_peer(exact), True)],
    "linear elu": [("torch plain", plain_peer(elu), True)],
    "favor+": [("performer-pytorch", performer_peer, True), ("torch plain", plain_peer(favor), True)],
    "nystrom": [("nystrom-attention", nystrom_peer, False), ("torch plain", plain_peer(nystrom), False)],
    "linformer": [("linformer", linformer_peer, False), ("torch plain", plain_peer(linformer), False)],
    "efficient attention": [("torch plain", plain_peer(efficient), False)],
}


def peers_of(name, causal):
    for prefix, peers in PEERS.items():
        if name.startswith(prefix):
            return [(p, make) for p, make, has_causal in peers if has_causal or not causal]
    return []


def bytes_needed(name, peer, causal, B, H, n, d, m, backward):
    """Rough peak of a peer (float32), to skip what cannot fit."""
    f = 4 * B * H
    if peer == "torch sdpa":
        per = 8 * n * d  # flash: blocks, never n×n
    elif name.startswith("exact"):
        per = 3 * n * n  # scores, softmax, (mask) — and their gradients
    elif causal:  # prefix sums of φ(k)⊗v (performer-pytorch's chunks keep them all for autograd)
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


def prepare(r, peer, make, cache):
    """The run of one request by one peer, and the peer's estimated peak bytes."""
    B, H, n, d = (int(r[x]) for x in ("batch", "heads", "n", "head_dim"))
    name, causal, backward = r["method"], r["causal"] == "1", r["pass"] == "fwd+bwd"
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
    need = bytes_needed(name, peer, causal, B, H, n, d, m, backward)
    call, leaves, dout = make(t, extra, causal)
    params = [p for p in call.parameters()] if isinstance(call, torch.nn.Module) else []

    if backward:
        def run():
            for p in params:  # as a training step's zero_grad(set_to_none=True)
                p.grad = None
            call(*[x.detach().requires_grad_(True) for x in leaves]).backward(dout)
    else:
        def run():
            with torch.no_grad():
                call(*leaves)
    return run, need


def measure_memory(requests_path, index, peer):
    """Peak RSS growth of one call of request `index` by `peer`, in this fresh process: with
    nothing freed and cached by the allocator yet, the high-water mark sees every byte the call
    needs."""
    r = list(csv.DictReader(open(requests_path)))[index]
    torch.set_num_threads(int(r["threads"]))
    make = dict(peers_of(r["method"], r["causal"] == "1"))[peer]
    run, _ = prepare(r, peer, make, {})
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
    w.writerow(["method", "causal", "pass", "peer", "status", "median_s", "runs", "rss_growth_bytes", "note"])
    cache = {}
    for index, r in enumerate(rows):
        n = int(r["n"])
        torch.set_num_threads(int(r["threads"]))
        for peer, make in peers_of(r["method"], r["causal"] == "1"):
            head = [r["method"], r["causal"], r["pass"], peer]
            try:
                run, need = prepare(r, peer, make, cache)
            except ImportError as e:
                w.writerow(head + ["unavailable", "", "", "", "cannot import: %s" % e])
                continue
            if need > 0.6 * available_bytes():
                w.writerow(head + ["skipped", "", "", need, "would need about %.1f GiB" % (need / 2**30)])
                out.flush()
                continue
            run()  # warm-up
            median, runs = time_runs(run, n)
            # Memory in a fresh process: in this one, memory freed by earlier calls stays mapped
            # and is reused, so the high-water mark would under-count.
            mem = subprocess.run([sys.executable, __file__, "--memory", requests_path, str(index), peer],
                                 capture_output=True, text=True)
            growth = int(mem.stdout.split()[-1]) if mem.returncode == 0 and mem.stdout.split() else -1
            w.writerow(head + ["ok", median, runs, growth, ""])
            out.flush()


if __name__ == "__main__":
    if sys.argv[1] == "--memory":
        measure_memory(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main(sys.argv[1], sys.argv[2])


def warm_median_seconds(fn, n):
    """One warm-up, then time_runs' median (the timing `linattn bench` gives the peers)."""
    fn()
    return time_runs(fn, n)[0]


def cpu_features():
    """The CPU's vector features that decide linattn's paths, from /proc/cpuinfo."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]
    return ", ".join(f for f in wanted if f in flags) or "unknown"

