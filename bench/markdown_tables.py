"""Markdown tables for docs/ from the CSV files of `linattn bench` and `linattn accuracy`.

Usage: markdown_tables.py bench BENCH.csv          time, rate, memory and PyTorch per row
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


def accuracy(d):
    for name, key in (("accuracy_size.csv", "size"), ("accuracy_scale.csv", "sigma"), ("accuracy_n.csv", "n")):
        rows = list(csv.DictReader(open(d + "/" + name)))
        groups = defaultdict(list)
        for r in rows:
            groups[(r["input"], r["method"], r["size"], r[key])].append((float(r["out_rel_err"]), float(r["grad_rel_err"])))
        print("\n%s (mean over %d seeds; min–max):\n" % (name, len(next(iter(groups.values())))))
        extra = "" if key == "size" else " %s |" % key
        print("| input | method | size |%s output rel. error | (dq, dk, dv) rel. error |" % extra)
        print("|---|---|---:|%s---:|---:|" % ("" if key == "size" else "---:|"))
        for (inp, meth, size, x), v in groups.items():
            o = [a for a, _ in v]
            g = [b for _, b in v]
            xcell = "" if key == "size" else " %s |" % x
            print("| %s | %s | %s |%s %.3g (%.3g–%.3g) | %.3g (%.3g–%.3g) |" % (
                inp, meth, size, xcell, mean(o), min(o), max(o), mean(g), min(g), max(g)))
    rows = list(csv.DictReader(open(d + "/kernel_mse.csv")))
    print("\nkernel_mse.csv:\n")
    print("| features | projection | m | ‖q‖·‖k‖ | relative MSE (± s.e.) |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print("| %s | %s | %s | %s | %.3g ± %.2g |" % (r["features"], r["kind"], r["m"], r["norm_product"],
                                                   float(r["rel_mse"]), float(r["rel_mse_stderr"])))
    rows = list(csv.DictReader(open(d + "/rank.csv")))
    print("\nrank.csv:\n")
    print("| input | method | size | numerical rank (n = 512) | effective rank | fraction of a row holding 90% of its mass |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print("| %s | %s | %s | %s | %.1f | %.3f |" % (r["input"], r["method"], r["size"], r["numerical_rank"],
                                                    float(r["effective_rank"]), float(r["mass90_fraction"])))


if __name__ == "__main__":
    {"bench": bench, "accuracy": accuracy}[sys.argv[1]](sys.argv[2])
