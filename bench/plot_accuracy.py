"""Plots of `linattn accuracy`'s CSV files (matplotlib from Debian's python3-matplotlib):
error against size, input scale and n (mean over seeds, bars: min to max), the kernel MSE
study against m and against ‖q‖·‖k‖, and a table of ranks. Usage: plot_accuracy.py DIR"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(path):
    return list(csv.DictReader(open(path)))


def error_plot(path, xkey, xlabel, out, logx=True, sigma=None):
    data = [r for r in rows(path) if sigma is None or float(r["sigma"]) == sigma]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=False)
    for col, inp in enumerate(("gaussian", "clustered")):
        for row, metric in enumerate(("out_rel_err", "grad_rel_err")):
            ax = axes[row][col]
            groups = defaultdict(lambda: defaultdict(list))
            for r in data:
                if r["input"] != inp:
                    continue
                label = r["method"] if xkey == "size" else "%s%s" % (r["method"], " %s" % r["size"] if r["size"] != "0" else "")
                groups[label][float(r[xkey])].append(float(r[metric]))
            for i, (label, pts) in enumerate(sorted(groups.items())):
                xs = sorted(pts)
                if xkey == "size" and xs == [0.0]:
                    mean = sum(pts[0.0]) / len(pts[0.0])
                    ax.axhline(mean, ls=":", color="C%d" % (i % 10), lw=1, label=label + " (no size)")
                    continue
                means = [sum(pts[x]) / len(pts[x]) for x in xs]
                lo = [m - min(pts[x]) for m, x in zip(means, xs)]
                hi = [max(pts[x]) - m for m, x in zip(means, xs)]
                ax.errorbar(xs, means, yerr=[lo, hi], fmt="-o", ms=3, capsize=2, color="C%d" % (i % 10), label=label)
            if logx:
                ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("relative error of " + ("output" if metric == "out_rel_err" else "(dq, dk, dv)"))
            ax.set_title("%s inputs" % inp, fontsize=9)
            ax.grid(True, which="both", lw=0.3)
            ax.legend(fontsize=6)
    fig.suptitle("‖approx − exact‖_F / ‖exact‖_F in float64; mean over seeds, bars min..max" +
                 ("" if sigma is None else "; input scale σ = %g" % sigma), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def kernel_plot(path, out):
    data = rows(path)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (xkey, fixed_key, fixed, xlabel) in zip(axes, [("m", "norm_product", "1.0", "features m (‖q‖·‖k‖ = 1)"),
                                                           ("norm_product", "m", "64", "‖q‖·‖k‖ (m = 64)")]):
        groups = defaultdict(list)
        for r in data:
            if r[fixed_key] == fixed or float(r[fixed_key]) == float(fixed):
                groups["%s (%s)" % (r["features"], r["kind"])].append((float(r[xkey]), float(r["rel_mse"]), float(r["rel_mse_stderr"])))
        for i, (label, pts) in enumerate(sorted(groups.items())):
            pts.sort()
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], fmt="-o", ms=3,
                        capsize=2, color="C%d" % i, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("E[(φ(q)·φ(k) − e^{q·k})²] / e^{2q·k}")
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("random-feature estimates of exp(q·k), d = 16: mean over 64 pairs and 200 projections (bars: standard error)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(d):
    for sigma in sorted({float(r["sigma"]) for r in rows(d + "/accuracy_size.csv")}):
        error_plot(d + "/accuracy_size.csv", "size", "features / landmarks / projection rows",
                   d + "/error_vs_size_sigma%g.png" % sigma, sigma=sigma)
    error_plot(d + "/accuracy_scale.csv", "sigma", "input scale σ (q, k entries ~ σ)", d + "/error_vs_scale.png", logx=False)
    error_plot(d + "/accuracy_n.csv", "n", "sequence length n", d + "/error_vs_n.png")
    kernel_plot(d + "/kernel_mse.csv", d + "/kernel_mse.png")


if __name__ == "__main__":
    main(sys.argv[1])
