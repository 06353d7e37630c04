"""Gated linear attention (linattn.torch.gated_linear_attention, causal, float32) against the
PyTorch forms a user without a CPU kernel runs: flash-linear-attention's own naive PyTorch
functions (fla-core, pinned in requirements/torch.txt; its Triton kernels do not run on a CPU),
on the same inputs (in fla's [batch, seq, heads, dim] layout, made contiguous before timing) and
threads:

- "fla recurrent": the recurrence one position at a time, `naive_recurrent_simple_gla` (per-head
  gates) and `naive_recurrent_gla` (per-channel gates);
- "fla chunk": `naive_chunk_simple_gla`, the chunk form with the decay matrix (chunks of 64, the
  state between them); fla has no naive chunk form for per-channel gates.

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


def fla_functions():
    import warnings
    with warnings.catch_warnings():  # "Triton is not supported on current platform, roll back to CPU."
        warnings.simplefilter("ignore")
        from fla.ops.gla.naive import naive_recurrent_gla
        from fla.ops.simple_gla.naive import naive_chunk_simple_gla, naive_recurrent_simple_gla
    return naive_recurrent_gla, naive_chunk_simple_gla, naive_recurrent_simple_gla


def fla_version():
    from importlib.metadata import version
    return version("fla-core")


def peers_for(per_channel):
    """name -> (to_layout, call): to_layout makes the peer's inputs from ours ([B, H, n, d]);
    call(q, k, v, g, scale) returns the output in our layout."""
    recurrent_gla, chunk_simple_gla, recurrent_simple_gla = fla_functions()

    def ours_layout(q, k, v, g):
        return q, k, v, g

    def fla_layout(q, k, v, g):  # [B, T, H, ...], contiguous
        return tuple(x.transpose(1, 2).contiguous() for x in (q, k, v, g))

    def linattn_call(q, k, v, g, scale):
        return lt.gated_linear_attention(q, k, v, g, scale=scale)

    def recurrent_call(q, k, v, g, scale):
        if per_channel:  # its scale is d_k^-1/2, the one measured here
            o, _ = recurrent_gla(q, k, v, g)
        else:
            o, _ = recurrent_simple_gla(q, k, v, g, scale=scale, output_final_state=False)
        return o.transpose(1, 2)

    def chunk_call(q, k, v, g, scale):
        o, _ = chunk_simple_gla(q, k, v, g, scale=scale)
        return o.transpose(1, 2)

    peers = {"linattn": (ours_layout, linattn_call), "fla recurrent": (fla_layout, recurrent_call)}
    if not per_channel:
        peers["fla chunk"] = (fla_layout, chunk_call)
    return peers


def run(a):
    torch.set_num_threads(a.threads)
    linattn.set_num_threads(a.threads)
    rows = []
    for per_channel in (False, True):
        for n in a.lengths:
            gen = torch.Generator().manual_seed(n)
            B, H, d = a.batch, a.heads, a.head_dim
            q, k, v = (torch.randn(B, H, n, d, generator=gen) for _ in range(3))
            g = -0.1 * torch.rand((B, H, n, d) if per_channel else (B, H, n), generator=gen)
            scale = d ** -0.5
            want = lt.gated_linear_attention(q, k, v, g, scale=scale)
            for name, (to_layout, fn) in peers_for(per_channel).items():
                inputs = to_layout(q, k, v, g)
                with torch.no_grad():
                    got = fn(*inputs, scale)
                err = float((got - want).abs().max() / want.abs().max())
                if err > 1e-4:
                    raise SystemExit("%s disagrees with linattn at n = %d: relative error %.3g" % (name, n, err))
                leaves = [x.detach().requires_grad_() for x in inputs]

                def fwd():
                    with torch.no_grad():
                        fn(*inputs, scale)

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
            "cpu": platform.processor() or platform.machine(), "features": torch_bench.cpu_features(), "peak": peak, "fla": fla_version(),
            "coretype": os.environ.get("OPENBLAS_CORETYPE")}


def report(r, command):
    a = r["args"]
    d = a["head_dim"]
    lines = ["",
             "Measured with `%s` on %d thread(s): batch %d, %d heads, d_k = d_v = %d, causal, float32, log-gates "
             "uniform in [−0.1, 0]; torch %s, fla-core %s; CPU features: %s; linattn: %s; OPENBLAS_CORETYPE %s; float32 FMA "
             "peak %.0f GFLOP/s (measured). Medians after a warm-up (at least 5 runs and 1 s). GFLOP/s: the "
             "chunk algorithm's forward count over linattn's forward time."
             % (command, a["threads"], a["batch"], a["heads"], d, r["torch"], r["fla"], r["features"], r["build"],
                r["coretype"] or "unset", r["peak"]), "",
             "| gates | n | linattn fwd | GFLOP/s (% of peak) | fla recurrent fwd | fla chunk fwd | "
             "linattn fwd+bwd | fla recurrent fwd+bwd | fla chunk fwd+bwd |",
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
                cell(pc, n, "fla recurrent", "fwd"), cell(pc, n, "fla chunk", "fwd"), cell(pc, n, "linattn", "bwd"),
                cell(pc, n, "fla recurrent", "bwd"), cell(pc, n, "fla chunk", "bwd")))
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
