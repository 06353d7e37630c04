"""The sliding-window + linear hybrid (linattn.torch.hybrid_attention, causal, Hedgehog-sized
given features) against what a LoLCATs user runs on a CPU, on the same inputs and threads:

- "lolcats linear": LoLCATs' O(n) form (src/model/linear_attention/linear_window_attention_sw_linear.py:
  sliding_window_softmax_attention + under_window_linear_attention), with its causal dot product
  (a CUDA kernel from fast-transformers there) written as the cumulative sum that is the CPU
  fallback in plain PyTorch: Σ_{j<=i} φ(k_j) v_jᵀ for every i, O(n·m'·d) memory;
- "lolcats quadratic": hybrid_attention_quadratic, the n×n form its training uses;
- the hybrid's two parts, each timed alone (issue 43 asks for the hybrid within 1.5× of their
  sum): the window alone, as linattn_window runs it (hybrid_attention with one feature of 0:
  the exact band, the sinks' and the row's bookkeeping, and a linear part of one feature), and
  the linear part alone, gated_linear_attention's chunked engine on the same features with
  [v | 1] and no decay (the numerator and the denominator in one call), as the hybrid calls it.

Forward, and forward + backward (gradients of q, k, v, both feature tensors and the gate). Each
timing: one warm-up, then the median of at least 5 runs and 1 s (bench/torch_bench.py's
time_runs). The three agree before any timing (float32, relative error below 1e-4 of the
output's largest value). FLOPs are linattn's count (the window's scores and weighted values,
4·n·w·d; the linear state's update and application, 4·n·m'·(d + 1)), the backward taken as 2.5
times the forward, as the registry counts.

    make bench-hybrid    # or: .venv/bin/python bench/hybrid_lolcats.py --docs docs/methods/hybrid.md

Writes the measured section of docs/methods/hybrid.md (between its MEASURED markers)."""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import linattn  # noqa: E402
import linattn.torch as lt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_section  # noqa: E402
import torch_bench  # noqa: E402
from bf16 import cpu_line  # noqa: E402



def lolcats_linear(q, k, fq, fk, v, gate, window, eps):
    """LoLCATs' linear-time hybrid (causal): softmax over the last `window` keys by unfold, and
    linear attention over the keys before them (keys delayed by `window` rows), one normaliser.
    Padding slots of the window are masked out rather than by LoLCATs' a == 0 heuristic."""
    d, n = q.shape[-1], q.shape[2]
    gamma = torch.sigmoid(gate).view(1, -1, 1, 1)
    kw = F.pad(k, (0, 0, window - 1, 0)).unfold(2, window, 1)  # [B,H,n,d,w]
    vw = F.pad(v, (0, 0, window - 1, 0)).unfold(2, window, 1)
    slot = torch.arange(n).view(-1, 1) - (window - 1) + torch.arange(window).view(1, -1)
    a = torch.einsum("bhld,bhldw->bhlw", q, kw) * d ** -0.5
    a = a.masked_fill((slot < 0).view(1, 1, n, window), float("-inf"))
    a = gamma * torch.exp(a - a.amax(-1, keepdim=True))
    num = torch.einsum("bhlw,bhldw->bhld", a, vw)
    den = a.sum(-1, keepdim=True)
    fk_d = F.pad(fk, (0, 0, window, 0))[:, :, :n]  # φ(k_{i−w}): the linear part's newest key
    v_d = F.pad(v, (0, 0, window, 0))[:, :, :n]
    kv = torch.cumsum(fk_d.unsqueeze(-1) * v_d.unsqueeze(-2), 2)  # [B,H,n,m',d]: the cumsum fallback
    num = num + torch.einsum("bhlf,bhlfd->bhld", fq, kv)
    den = den + (fq * fk_d.cumsum(2)).sum(-1, keepdim=True)
    return num / (den + eps)


def lolcats_quadratic(q, k, fq, fk, v, gate, window, eps):
    """LoLCATs' hybrid_attention_quadratic (causal): the n×n window and linear weights."""
    n, d = q.shape[2], q.shape[-1]
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    win, lin = (j <= i) & (j > i - window), j <= i - window
    a = (q @ k.transpose(-1, -2)) * d ** -0.5
    a = a.masked_fill(~win, float("-inf"))
    a = torch.sigmoid(gate).view(1, -1, 1, 1) * torch.exp(a - a.amax(-1, keepdim=True))
    a = a + (fq @ fk.transpose(-1, -2)) * lin
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def ours(q, k, fq, fk, v, gate, window, eps):
    return lt.hybrid_attention(q, k, v, query_features=fq, key_features=fk, window_gate=gate, window=window,
                               feature_map="given", causal=True, eps=eps)


def window_part(q, k, fq, fk, v, gate, window, eps):
    zero = q.new_zeros(q.shape[:3] + (1,))
    return lt.hybrid_attention(q, k, v, query_features=zero, key_features=zero, window_gate=gate, window=window,
                               feature_map="given", causal=True, eps=eps)


def linear_part(q, k, fq, fk, v, gate, window, eps):
    v1 = torch.cat([v, v.new_ones(v.shape[:3] + (1,))], -1)
    return lt.gated_linear_attention(fq, fk, v1, fq.new_zeros(fq.shape[:3]), scale=1.0)


PEERS = {"linattn": ours, "lolcats linear (cumsum)": lolcats_linear, "lolcats quadratic": lolcats_quadratic}
PARTS = {"window part": window_part, "linear part": linear_part}  # timed, not compared: each is half the formula


def run(a):
    torch.set_num_threads(a.threads)
    linattn.set_num_threads(a.threads)
    rows = []
    for n in a.lengths:
        g = torch.Generator().manual_seed(n)
        B, H, d, m, w = a.batch, a.heads, a.head_dim, a.features, a.window
        q, k, v = (torch.randn(B, H, n, d, generator=g) for _ in range(3))
        # Hedgehog's features: two softmaxes over f = m'/2 each, so every feature lies in (0, 1).
        fq, fk = (torch.cat([torch.softmax(x, -1), torch.softmax(-x, -1)], -1)
                  for x in (torch.randn(B, H, n, m // 2, generator=g) for _ in range(2)))
        gate = torch.randn(H, generator=g)
        args = (q, k, fq, fk, v, gate, w, 1e-6)
        want = ours(*args)
        cumsum_bytes = 4 * B * H * n * m * d
        for name, fn in {**PEERS, **PARTS}.items():
            fits = not (name.startswith("lolcats quadratic") and 4 * B * H * n * n * 4 > a.memory_limit) and \
                not (name.startswith("lolcats linear") and 3 * cumsum_bytes > a.memory_limit)
            if not fits:
                rows.append({"n": n, "peer": name, "fwd": None, "bwd": None})
                continue
            with torch.no_grad():
                got = fn(*args)
            err = float((got - want).abs().max() / want.abs().max()) if name in PEERS else 0.0
            if err > 1e-4:
                raise SystemExit("%s disagrees with linattn at n = %d: relative error %.3g" % (name, n, err))
            leaves = [x.detach().requires_grad_() for x in (q, k, fq, fk, v, gate)]

            def fwd():
                with torch.no_grad():
                    fn(*args)

            def fwd_bwd():
                for x in leaves:
                    x.grad = None
                out = fn(*leaves[:5], leaves[5], w, 1e-6)
                out.backward(torch.ones_like(out))

            rows.append({"n": n, "peer": name, "fwd": torch_bench.warm_median_seconds(fwd, n), "bwd": torch_bench.warm_median_seconds(fwd_bwd, n)})
        print(rows[-5:], flush=True)
    flops = {n: 4.0 * a.batch * a.heads * n * (a.window * a.head_dim + a.features * (a.head_dim + 1))
             for n in a.lengths}
    return {"rows": rows, "flops": flops, "args": vars(a), "torch": torch.__version__,
            "build": linattn.build_info(), "cpu": cpu_line(),
            "features": torch_bench.cpu_features(), "coretype": os.environ.get("OPENBLAS_CORETYPE")}


def report(r, command):
    a = r["args"]
    lines = ["",
             "Measured with `%s` on %d thread(s) of %s: batch %d, %d heads, head_dim %d, m' = %d given features "
             "(Hedgehog-shaped), window %d, causal, float32; torch %s; CPU features: %s; linattn: %s; "
             "OPENBLAS_CORETYPE %s. Medians after a warm-up (at least 5 runs and 1 s). GFLOP/s is linattn's "
             "count over its own time."
             % (command, a["threads"], r["cpu"], a["batch"], a["heads"], a["head_dim"], a["features"], a["window"],
                r["torch"], r["features"], r["build"], r["coretype"] or "unset"), "",
             "| n | linattn fwd | GFLOP/s | lolcats linear (cumsum) fwd | lolcats quadratic fwd | linattn fwd+bwd | "
             "lolcats linear fwd+bwd | lolcats quadratic fwd+bwd |",
             "|---|---|---|---|---|---|---|---|"]
    parts = []  # the hybrid against its two parts, a row per n that timed them
    by = {(row["n"], row["peer"]): row for row in r["rows"]}

    def cell(n, peer, key):
        t, mine = by[(n, peer)][key], by[(n, "linattn")][key]
        if t is None:
            return "– (over %.0f GB)" % (a["memory_limit"] / 1e9)
        if peer == "linattn":
            return "%.1f ms" % (1e3 * t)
        return "%.1f ms (%.1f×)" % (1e3 * t, t / mine)

    for n in a["lengths"]:
        gf = r["flops"][n] / by[(n, "linattn")]["fwd"] / 1e9
        lines.append("| %d | %s | %.1f | %s | %s | %s | %s | %s |" % (
            n, cell(n, "linattn", "fwd"), gf, cell(n, "lolcats linear (cumsum)", "fwd"),
            cell(n, "lolcats quadratic", "fwd"), cell(n, "linattn", "bwd"), cell(n, "lolcats linear (cumsum)", "bwd"),
            cell(n, "lolcats quadratic", "bwd")))
        if (n, "window part") in by:
            cells = []
            for key in ("fwd", "bwd"):
                w, lin = by[(n, "window part")][key], by[(n, "linear part")][key]
                cells += ["%.1f ms" % (1e3 * w), "%.1f ms" % (1e3 * lin), "%.2f" % (by[(n, "linattn")][key] / (w + lin))]
            parts.append("| %d | %s |" % (n, " | ".join(cells)))
    lines += ["", "(×: the peer's time over linattn's.)"]
    if parts:
        lines += ["", "The hybrid against its two parts, each timed alone (the window alone, as linattn_window runs "
                  "it; the linear part alone on the chunked engine):", "",
                  "| n | window part fwd | linear part fwd | hybrid / (sum) fwd | window part fwd+bwd | "
                  "linear part fwd+bwd | hybrid / (sum) fwd+bwd |", "|---|---|---|---|---|---|---|"] + parts
    lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default="docs/methods/hybrid.md")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--features", type=int, default=64, help="m' (Hedgehog: 2·feature_dim)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--memory-limit", type=float, default=6e9, help="bytes a peer's largest tensors may take")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a test)")
    a = ap.parse_args()
    if a.quick:
        a.lengths, a.heads, a.head_dim, a.features, a.window = [40], 2, 8, 6, 5
    r = run(a)
    args = " ".join(sys.argv[1:])
    section = report(r, "make bench-hybrid" if args == "--docs docs/methods/hybrid.md" else
                     "bench/hybrid_lolcats.py " + args)
    print(section)
    if not a.quick:
        measured_section.write(a.docs, "hybrid_lolcats.py", section)


if __name__ == "__main__":
    main()
