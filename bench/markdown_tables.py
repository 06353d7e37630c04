"""Markdown tables for docs/ from the CSV files of `linattn bench` and `linattn accuracy`.

Usage: markdown_tables.py bench BENCH.csv          time, rate, memory and PyTorch per row
       markdown_tables.py bench-summary BENCH.csv  the same as method × n grids per pass
       markdown_tables.py accuracy DIR              error summaries, kernel MSE, ranks
"""
import csv
import sys
from collections import defaultdict
from statistics import mean


def human(b):
    b = float(b)
    if b < 0:
        return "-"
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= f:
            return "%.1f %s" % (b / f, unit)
    return "%d B" % b


def bench(path):
    rows = list(csv.DictReader(open(path)))
    print("| method | n | pass | time (ms) | GFLOP/s | % sgemm | extra (wksp) | PyTorch (ms) | ours / PyTorch | PyTorch extra (RSS) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t = float(r["median_s"]) * 1e3
        if r["torch_status"] == "ok":
            tt = float(r["torch_median_s"]) * 1e3
            torch_cells = "%.1f | %.2f | %s" % (tt, t / tt, human(r["torch_rss_growth_bytes"]))
        else:
            torch_cells = "%s | - | -" % (r["torch_status"] + (" (" + r["torch_note"] + ")" if r["torch_note"] else ""))
        print("| %s | %s | %s | %.1f | %.1f | %.0f%% | %s | %s |" % (
            r["method"], r["n"], r["pass"], t, float(r["gflops"]), 100 * float(r["fraction_of_sgemm"]),
            human(r["workspace_bytes"]), torch_cells))


def bench_summary(path):
    """Per pass, a method × n grid: time (ours / PyTorch), % of the sgemm rate, and memory."""
    rows = list(csv.DictReader(open(path)))
    ns = sorted({int(r["n"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], int(r["n"]), r["pass"]): r for r in rows}
    for pass_name in ("fwd", "fwd+bwd"):
        for what, title in (("time", "time in ms (in brackets: ours / PyTorch; skip: PyTorch would not fit in memory)"),
                            ("rate", "GFLOP/s by each method's FLOP count, and % of the measured sgemm rate"),
                            ("memory", "peak extra memory: ours (workspace, RSS growth incl. outputs) / PyTorch (RSS growth)")):
            print("\n%s, %s:\n" % (pass_name, title))
            print("| method | " + " | ".join("n = %d" % n for n in ns) + " |")
            print("|---|" + "---:|" * len(ns))
            for m in methods:
                cells = []
                for n in ns:
                    r = by.get((m, n, pass_name))
                    if r is None:
                        cells.append("")
                        continue
                    if what == "time":
                        t = float(r["median_s"]) * 1e3
                        if r["torch_status"] == "ok":
                            extra = " (%.2f)" % (t / (float(r["torch_median_s"]) * 1e3))
                        elif r["torch_status"] == "skipped":
                            extra = " (skip)"
                        else:
                            extra = ""
                        cells.append(("%.3g" % t if t < 100 else "%.0f" % t) + extra)
                    elif what == "rate":
                        cells.append("%.0f (%.0f%%)" % (float(r["gflops"]), 100 * float(r["fraction_of_sgemm"])))
                    else:
                        theirs = human(r["torch_rss_growth_bytes"]) if r["torch_status"] == "ok" else "-"
                        cells.append("%s, %s / %s" % (human(r["workspace_bytes"]), human(r["rss_growth_bytes"]), theirs))
                print("| %s | " % m + " | ".join(cells) + " |")


def cell(v):
    return "%.3g (%.3g–%.3g)" % (mean(v), min(v), max(v))


def pivot(rows, metric, across, where):
    """One table: a row per method (and size when `across` is not the size), a column per value
    of `across`; cells are the mean over seeds and (min–max)."""
    cols = sorted({float(r[across]) for r in rows} - ({0.0} if across == "size" else set()))
    groups = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if all(r[k] == v for k, v in where.items()):
            label = r["method"] + ("" if across == "size" or r["size"] == "0" else " " + r["size"])
            groups[label][float(r[across])].append(float(r[metric]))
    head = {"size": "size", "sigma": "σ =", "n": "n ="}[across]
    print("| method | " + " | ".join("%s %g" % (head, c) for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for label, by in groups.items():
        if across == "size" and list(by) == [0.0]:
            print("| %s (no size) | %s |" % (label, cell(by[0.0])) + " ″ |" * (len(cols) - 1))
            continue
        print("| %s | " % label + " | ".join(cell(by[c]) if c in by else "" for c in cols) + " |")


def accuracy(d):
    for name, across, fixed in (("accuracy_size.csv", "size", ("sigma",)), ("accuracy_scale.csv", "sigma", ()),
                                ("accuracy_n.csv", "n", ())):
        rows = list(csv.DictReader(open(d + "/" + name)))
        seeds = len({r["seed"] for r in rows})
        for metric, what in (("out_rel_err", "output"), ("grad_rel_err", "(dq, dk, dv)")):
            for inp in ("gaussian", "clustered"):
                for f in sorted({tuple(r[k] for k in fixed) for r in rows}):
                    where = dict(zip(fixed, f), input=inp)
                    print("\n%s: relative error of the %s, %s inputs%s; mean over %d seeds (min–max)\n" % (
                        name, what, inp, "".join(", %s = %s" % kv for kv in zip(fixed, f)), seeds))
                    pivot(rows, metric, across, where)
    rows = list(csv.DictReader(open(d + "/kernel_mse.csv")))
    for across, fixed, value, title in (("m", "norm_product", 1.0, "against m, ‖q‖·‖k‖ = 1"),
                                        ("norm_product", "m", 64.0, "against ‖q‖·‖k‖, m = 64")):
        sel = [r for r in rows if float(r[fixed]) == value]
        cols = sorted({float(r[across]) for r in sel})
        print("\nkernel_mse.csv, %s: E[(φ(q)·φ(k) − exp(q·k))²] / exp(q·k)², d = 16, mean over %s pairs and "
              "%s projections ± standard error\n" % (title, sel[0]["pairs"], sel[0]["seeds"]))
        print("| features (projection) | " + " | ".join("%s %g" % ("m =" if across == "m" else "‖q‖·‖k‖ =", c)
                                                   for c in cols) + " |")
        print("|---|" + "---:|" * len(cols))
        labels = list(dict.fromkeys("%s (%s)" % (r["features"], r["kind"]) for r in sel))
        for label in labels:
            by = {float(r[across]): r for r in sel if "%s (%s)" % (r["features"], r["kind"]) == label}
            print("| %s | " % label + " | ".join("%.3g ± %.2g" % (float(by[c]["rel_mse"]), float(by[c]["rel_mse_stderr"]))
                                                 if c in by else "" for c in cols) + " |")
    rows = list(csv.DictReader(open(d + "/rank.csv")))
    print("\nrank.csv:\n")
    print("| input | method | size | numerical rank (n = 512) | effective rank | fraction of a row holding 90% of its mass |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print("| %s | %s | %s | %s | %.1f | %.3f |" % (r["input"], r["method"], r["size"], r["numerical_rank"],
                                                    float(r["effective_rank"]), float(r["mass90_fraction"])))


if __name__ == "__main__":
    {"bench": bench, "bench-summary": bench_summary, "accuracy": accuracy}[sys.argv[1]](sys.argv[2])
