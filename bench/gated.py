"""Gated linear attention (linattn.torch.gated_linear_attention, causal, float32) against the
PyTorch forms a user without a CPU kernel runs, on the same inputs and threads:

- "torch recurrent": the recurrence one position at a time (fla's naive_recurrent_gla form:
  S = exp(g_t)·S + k_t v_tᵀ, o_t = scale·S_tᵀ q_t), per-head or per-channel gates;
- "torch chunk": the chunk form with the decay matrix, as fla's naive chunk of simple GLA
  (per-head gates only): A = (Q Kᵀ) ⊙ exp(b_j − b_i) within chunks of 64, the state between.

Forward, and forward + backward (gradients of q, k, v and the gates). Timing: one warm-up, then
the median of at least 5 runs and 1 s (bench/torch_bench.py's time_runs). All forms agree before
any timing (relative error below 1e-4 of the output's largest value). FLOPs: the chunk
algorithm's count, n·(2·64·(d_k + d_v) + 4·d_k·d_v) per head for the forward; the percentage is
of the measured float32 FMA peak on the same threads (linattn.measure_peak_rates).

    make bench-gated    # or: .venv/bin/python bench/gated.py --docs docs/methods/gated.md

Writes the measured section of docs/methods/gated.md (between its MEASURED markers)."""

import argparse
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402

import linattn  # noqa: E402
import linattn.torch as lt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_section  # noqa: E402
import torch_bench  # noqa: E402


def torch_recurrent(q, k, v, g, scale):
    b, h, n, dk = q.shape
    s = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t in range(n):
        decay = torch.exp(g[:, :, t] if g.dim() == 4 else g[:, :, t, None])
        s = decay[..., None] * s + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(scale * torch.einsum("bhc,bhcd->bhd", q[:, :, t], s))
    return torch.stack(outs, 2)


def torch_chunk(q, k, v, g, scale, chunk=64):
    """Per-head gates: within a chunk A = (Q Kᵀ) ⊙ exp(b_j − b_i) (j >= i), between chunks the state."""
    b, h, n, dk = q.shape
    s = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t0 in range(0, n, chunk):
        qc, kc, vc, gc = q[:, :, t0:t0 + chunk], k[:, :, t0:t0 + chunk], v[:, :, t0:t0 + chunk], g[:, :, t0:t0 + chunk]
        bc = gc.cumsum(-1)  # [b, h, L]
        L = bc.shape[-1]
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        decay = torch.exp((bc[..., :, None] - bc[..., None, :]).masked_fill(~mask, float("-inf")))
        a = (qc @ kc.transpose(-1, -2)) * decay
        outs.append(scale * (a @ vc + (qc * torch.exp(bc)[..., None]) @ s))
        s = torch.exp(bc[..., -1])[..., None, None] * s + (kc * torch.exp(bc[..., -1:] - bc)[..., None]).transpose(-1, -2) @ vc
    return torch.cat(outs, 2)


def ours(q, k, v, g, scale):
    return lt.gated_linear_attention(q, k, v, g, scale=scale)


def run(a):
    torch.set_num_threads(a.threads)
    linattn.set_num_threads(a.threads)
    rows = []
    for per_channel in (False, True):
        peers = {"linattn": ours, "torch recurrent": torch_recurrent}
        if not per_channel:
            peers["torch chunk"] = torch_chunk
        for n in a.lengths:
            gen = torch.Generator().manual_seed(n)
            B, H, d = a.batch, a.heads, a.head_dim
            q, k, v = (torch.randn(B, H, n, d, generator=gen) for _ in range(3))
            g = -0.1 * torch.rand((B, H, n, d) if per_channel else (B, H, n), generator=gen)
            scale = d ** -0.5
            want = ours(q, k, v, g, scale)
            for name, fn in peers.items():
                with torch.no_grad():
                    got = fn(q, k, v, g, scale)
                err = float((got - want).abs().max() / want.abs().max())
                if err > 1e-4:
                    raise SystemExit("%s disagrees with linattn at n = %d: relative error %.3g" % (name, n, err))
                leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]

                def fwd():
                    with torch.no_grad():
                        fn(q, k, v, g, scale)

                def fwd_bwd():
                    for x in leaves:
                        x.grad = None
                    out = fn(*leaves, scale)
                    out.backward(torch.ones_like(out))

                rows.append({"per_channel": per_channel, "n": n, "peer": name,
                             "fwd": torch_bench.warm_median_seconds(fwd, n),
                             "bwd": torch_bench.warm_median_seconds(fwd_bwd, n)})
                print(rows[-1], flush=True)
    peak = linattn.measure_peak_rates(a.threads)["float32_fma_gflops"]
    return {"rows": rows, "args": vars(a), "torch": torch.__version__, "build": linattn.build_info(),
            "cpu": platform.processor() or platform.machine(), "features": torch_bench.cpu_features(), "peak": peak,
            "coretype": os.environ.get("OPENBLAS_CORETYPE")}


def report(r, command):
    a = r["args"]
    d = a["head_dim"]
    lines = ["",
             "Measured with `%s` on %d thread(s): batch %d, %d heads, d_k = d_v = %d, causal, float32, log-gates "
             "uniform in [−0.1, 0]; torch %s; CPU features: %s; linattn: %s; OPENBLAS_CORETYPE %s; float32 FMA "
             "peak %.0f GFLOP/s (measured). Medians after a warm-up (at least 5 runs and 1 s). GFLOP/s: the "
             "chunk algorithm's forward count over linattn's forward time."
             % (command, a["threads"], a["batch"], a["heads"], d, r["torch"], r["features"], r["build"],
                r["coretype"] or "unset", r["peak"]), "",
             "| gates | n | linattn fwd | GFLOP/s (% of peak) | torch recurrent fwd | torch chunk fwd | "
             "linattn fwd+bwd | torch recurrent fwd+bwd | torch chunk fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {(row["per_channel"], row["n"], row["peer"]): row for row in r["rows"]}

    def cell(pc, n, peer, key):
        row = by.get((pc, n, peer))
        if row is None:
            return "–"
        t, mine = row[key], by[(pc, n, "linattn")][key]
        return "%.1f ms" % (1e3 * t) if peer == "linattn" else "%.1f ms (%.1f×)" % (1e3 * t, t / mine)

    for pc in (False, True):
        for n in a["lengths"]:
            flops = a["batch"] * a["heads"] * n * (2 * 64 * 2 * d + 4 * d * d)
            gf = flops / by[(pc, n, "linattn")]["fwd"] / 1e9
            lines.append("| %s | %d | %s | %.1f (%.0f%%) | %s | %s | %s | %s | %s |" % (
                "per channel" if pc else "per head", n, cell(pc, n, "linattn", "fwd"), gf, 100 * gf / r["peak"],
                cell(pc, n, "torch recurrent", "fwd"), cell(pc, n, "torch chunk", "fwd"), cell(pc, n, "linattn", "bwd"),
                cell(pc, n, "torch recurrent", "bwd"), cell(pc, n, "torch chunk", "bwd")))
    lines += ["", "(×: the peer's time over linattn's; –: no such form.)", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default="docs/methods/gated.md")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a test)")
    a = ap.parse_args()
    if a.quick:
        a.lengths, a.heads, a.head_dim = [70], 2, 8
    r = run(a)
    args = " ".join(sys.argv[1:])
    section = report(r, "make bench-gated" if args == "--docs docs/methods/gated.md" else "bench/gated.py " + args)
    print(section)
    if a.docs and not a.quick:
        measured_section.write(a.docs, "gated.py", section)


if __name__ == "__main__":
    main()
