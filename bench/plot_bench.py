"""Plots of a `linattn bench` CSV: time and memory against n, log–log, one line per method and
pass, linattn solid and PyTorch dashed, with the crossover n (where each linear method starts to
beat linattn's exact attention) marked. Writes DIR/time_fwd.png, DIR/time_fwd_bwd.png,
DIR/memory_fwd.png and DIR/memory_fwd_bwd.png.

Usage: python3 plot_bench.py BENCH.csv DIR   (matplotlib from Debian's python3-matplotlib)
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        r["n"] = int(r["n"])
        r["median_s"] = float(r["median_s"])
        r["workspace_bytes"] = float(r["workspace_bytes"])
        r["rss_growth_bytes"] = float(r["rss_growth_bytes"])
        r["torch_median_s"] = float(r["torch_median_s"] or 0)
        r["torch_rss_growth_bytes"] = float(r["torch_rss_growth_bytes"] or -1)
    return rows


def crossovers(rows, pass_name):
    """Smallest n from which each non-exact method stays faster than exact (same causality)."""
    out = {}
    exact = {(r["causal"], r["n"]): r["median_s"] for r in rows
             if r["method"].startswith("exact") and r["pass"] == pass_name}
    for name in sorted({r["method"] for r in rows if not r["method"].startswith("exact")}):
        pts = sorted((r["n"], r["median_s"], r["causal"]) for r in rows
                     if r["method"] == name and r["pass"] == pass_name)
        frm = None
        for n, t, causal in pts:
            if (causal, n) not in exact:
                continue
            if t < exact[(causal, n)]:
                frm = n if frm is None else frm
            else:
                frm = None
        out[name] = frm
    return out


def plot(rows, pass_name, what, path):
    """Two panels, non-causal and causal (each with exact attention of that kind)."""
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.8))
    names = sorted({r["method"] for r in rows}, key=lambda s: (not s.startswith("exact"), s))
    colors = {name: "C%d" % (i % 10) for i, name in enumerate(names)}
    cross = crossovers(rows, pass_name) if what == "time" else {}
    for ax, causal in zip(axes, ("0", "1")):
        for name in names:
            pts = sorted((r["n"], r) for r in rows
                         if r["method"] == name and r["pass"] == pass_name and r["causal"] == causal)
            if not pts:
                continue
            color = colors[name]
            ns = [n for n, _ in pts]
            if what == "time":
                ours = [r["median_s"] * 1e3 for _, r in pts]
                theirs = [(n, r["torch_median_s"] * 1e3) for n, r in pts if r["torch_status"] == "ok"]
            else:
                ours = [max(r["rss_growth_bytes"], r["workspace_bytes"], 1) / 2**20 for _, r in pts]
                theirs = [(n, r["torch_rss_growth_bytes"] / 2**20) for n, r in pts
                          if r["torch_status"] == "ok" and r["torch_rss_growth_bytes"] > 0]
            ax.plot(ns, ours, "-o", color=color, ms=3, label=name)
            if theirs:
                ax.plot([n for n, _ in theirs], [t for _, t in theirs], "--", color=color, lw=1,
                        label=name + " (PyTorch)")
            skipped = [n for n, r in pts if r["torch_status"] == "skipped"]
            if skipped and theirs:
                ax.plot(skipped, [theirs[-1][1]] * len(skipped), "x", color=color, ms=5)
            if cross.get(name):
                n0 = cross[name]
                y0 = [o for n, o in zip(ns, ours) if n == n0][0]
                ax.annotate("crossover n=%d" % n0, (n0, y0), textcoords="offset points", xytext=(6, -3),
                            fontsize=7, color=color)
                ax.plot([n0], [y0], "s", color=color, ms=7, mfc="none")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("time (ms)" if what == "time" else "peak extra memory (MiB)")
        ax.set_title("causal" if causal == "1" else "non-causal", fontsize=9)
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=6, ncol=2)
    b, h, d = rows[0]["batch"], rows[0]["heads"], rows[0]["head_dim"]
    fig.suptitle("%s, %s: B=%s H=%s d=%s float32, %s threads (solid: linattn, dashed: PyTorch, x: PyTorch "
                 "skipped, would not fit in memory; square: crossover with linattn's exact attention)"
                 % (what, pass_name, b, h, d, rows[0]["threads"]), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(path, outdir):
    rows = load(path)
    for pass_name in ("fwd", "fwd+bwd"):
        if not any(r["pass"] == pass_name for r in rows):
            continue
        tag = pass_name.replace("+", "_")
        plot(rows, pass_name, "time", "%s/time_%s.png" % (outdir, tag))
        plot(rows, pass_name, "memory", "%s/memory_%s.png" % (outdir, tag))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
