"""Markdown tables for docs/ from the CSV files of `linattn bench` and `linattn accuracy`.

Usage: markdown_tables.py bench BENCH.csv          time, rate, memory and the peers per row
       markdown_tables.py bench-summary BENCH.csv  the same as method × n grids per pass, plus the
                                                   crossover n and exact attention against torch sdpa
       markdown_tables.py accuracy DIR              error summaries, kernel MSE, ranks

BENCH.csv is the long format `linattn bench` writes: one row per implementation per (method, n,
pass), with columns method, causal ("0"/"1"), n, batch, heads, head_dim, pass ("fwd"/"fwd+bwd"),
impl, status, flops, median_s, min_s, runs, gflops, fraction_of_sgemm, workspace_bytes,
rss_growth_bytes, sgemm_gflops, threads, note. impl "linattn" is this library (status ok,
workspace_bytes its exact scratch); any other impl is a peer run on the same inputs ("torch sdpa"
for the exact softmax rows, "torch plain" for every method, "performer-pytorch", "nystrom-attention",
"linformer" for their methods) with workspace_bytes -1 and status ok, skipped (would not fit in
memory; note says why), unavailable or failed. A method's "first peer" is the first peer impl the
CSV lists for it.
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


def num(x, empty=0.0):
    """float of a CSV cell; `empty` for an empty cell."""
    return float(x) if x not in ("", None) else empty


def ms(t):
    return "%.3g" % t if t < 100 else "%.0f" % t


def load_bench(path):
    """(ours, peers, methods, ns): ours[(method, n, pass)] is the linattn row, peers[...] the peer
    rows in CSV order; methods in CSV order with their first peer impl (or None)."""
    ours, peers, first = {}, defaultdict(list), {}
    for r in csv.DictReader(open(path)):
        r["n"] = int(r["n"])
        key = (r["method"], r["n"], r["pass"])
        first.setdefault(r["method"], None)
        if r["impl"] == "linattn":
            ours[key] = r
        else:
            peers[key].append(r)
            if first[r["method"]] is None:
                first[r["method"]] = r["impl"]
    ns = sorted({k[1] for k in ours})
    return ours, peers, first, ns


def peer_row(peers, key, impl):
    return next((p for p in peers.get(key, ()) if p["impl"] == impl), None)


def peer_ok(p):
    return p is not None and p["status"] == "ok" and num(p["median_s"]) > 0


def bench(path):
    ours, peers, _, _ = load_bench(path)
    print("| method | n | pass | time (ms) | GFLOP/s | % sgemm | extra (wksp) | peers: time (ours / peer) |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for key, r in ours.items():
        t = num(r["median_s"]) * 1e3
        cells = []
        for p in peers.get(key, ()):
            if peer_ok(p):
                tt = num(p["median_s"]) * 1e3
                cells.append("%s: %s ms (%.2f)" % (p["impl"], ms(tt), t / tt))
            else:
                cells.append("%s: %s" % (p["impl"], p["status"] + (" (" + p["note"] + ")" if p["note"] else "")))
        print("| %s | %d | %s | %s | %.1f | %.0f%% | %s | %s |" % (
            r["method"], r["n"], r["pass"], ms(t), num(r["gflops"]), 100 * num(r["fraction_of_sgemm"]),
            human(num(r["workspace_bytes"], -1)), "; ".join(cells) or "-"))


def crossover(ours, ref, method, pass_name, ns):
    """Smallest n of the sweep from which `method` stays faster than ref(n) (a time, or None where
    there is nothing to compare with) at every measured n; None if never."""
    frm = None
    for n in ns:
        r = ours.get((method, n, pass_name))
        t_ref = ref(n)
        if r is None or t_ref is None:
            continue
        if num(r["median_s"]) < t_ref:
            frm = n if frm is None else frm
        else:
            frm = None
    return frm


def bench_summary(path):
    """Per pass, method × n grids: time (ours / first peer, ours / torch plain), rate, memory; then
    the crossover n of each non-exact method and exact attention against torch sdpa."""
    ours, peers, first, ns = load_bench(path)
    methods = [m for m in first if any((m, n, p) in ours for n in ns for p in ("fwd", "fwd+bwd"))]
    exact = [m for m in methods if m.startswith("exact")]
    causal = {r["method"]: r["causal"] for r in ours.values()}
    passes = [p for p in ("fwd", "fwd+bwd") if any(k[2] == p for k in ours)]

    def vs(r, p):
        """ours / peer in brackets, "(skip)", or nothing."""
        if peer_ok(p):
            return " (%.2f)" % (num(r["median_s"]) / num(p["median_s"]))
        return " (skip)" if p is not None and p["status"] == "skipped" else ""

    for pass_name in passes:
        for what, title in (
                ("time", "time in ms (in brackets: ours / the method's first peer, named after \"vs\" in the "
                         "method column; skip: the peer would not fit in memory)"),
                ("plain", "time in ms (in brackets: ours / torch plain, the same formula in plain PyTorch; "
                          "skip: it would not fit in memory)"),
                ("rate", "GFLOP/s by each method's FLOP count, and % of the measured sgemm rate"),
                ("memory", "peak extra memory: ours (workspace, RSS growth incl. outputs) / the method's first "
                           "peer, named after \"vs\" (RSS growth)")):
            print("\n%s, %s:\n" % (pass_name, title))
            print("| method | " + " | ".join("n = %d" % n for n in ns) + " |")
            print("|---|" + "---:|" * len(ns))
            for m in methods:
                impl = {"time": first[m], "memory": first[m], "plain": "torch plain"}.get(what)
                cells = []
                for n in ns:
                    key = (m, n, pass_name)
                    r = ours.get(key)
                    if r is None:
                        cells.append("")
                        continue
                    p = peer_row(peers, key, impl) if impl else None
                    if what in ("time", "plain"):
                        cells.append(ms(num(r["median_s"]) * 1e3) + vs(r, p))
                    elif what == "rate":
                        cells.append("%.0f (%.0f%%)" % (num(r["gflops"]), 100 * num(r["fraction_of_sgemm"])))
                    else:
                        if p is not None and p["status"] == "ok":
                            theirs = human(num(p["rss_growth_bytes"], -1))
                        else:
                            theirs = "skip" if p is not None and p["status"] == "skipped" else "-"
                        cells.append("%s, %s / %s" % (human(num(r["workspace_bytes"], -1)),
                                                      human(num(r["rss_growth_bytes"], -1)), theirs))
                label = m + (" vs " + impl if impl else "") if what != "plain" else m
                print("| %s | " % label + " | ".join(cells) + " |")

    def exact_of(c):
        return next((e for e in exact if causal[e] == c), None)

    def ref_ours(c, pass_name):
        e = exact_of(c)
        return lambda n: num(ours[(e, n, pass_name)]["median_s"]) if e and (e, n, pass_name) in ours else None

    def ref_sdpa(c, pass_name):
        e = exact_of(c)

        def f(n):
            p = peer_row(peers, (e, n, pass_name), "torch sdpa") if e else None
            return num(p["median_s"]) if peer_ok(p) else None
        return f

    print("\ncrossover: the smallest n of the sweep from which the method is faster than exact attention of the "
          "same causality at every measured n (-: never), against linattn's exact attention and against torch "
          "sdpa:\n")
    print("| method | " + " | ".join("%s vs %s" % (p, w) for p in passes for w in ("ours exact", "torch sdpa")) + " |")
    print("|---|" + "---:|" * (2 * len(passes)))
    for m in methods:
        if m in exact:
            continue
        cells = []
        for pass_name in passes:
            for ref in (ref_ours, ref_sdpa):
                n0 = crossover(ours, ref(causal[m], pass_name), m, pass_name, ns)
                cells.append("-" if n0 is None else "%d" % n0)
        print("| %s | " % m + " | ".join(cells) + " |")

    print("\nexact attention vs torch sdpa: time ours / torch sdpa (skip: sdpa would not fit in memory):\n")
    print("| method | pass | " + " | ".join("n = %d" % n for n in ns) + " |")
    print("|---|---|" + "---:|" * len(ns))
    for m in exact:
        for pass_name in passes:
            cells = []
            for n in ns:
                r = ours.get((m, n, pass_name))
                p = peer_row(peers, (m, n, pass_name), "torch sdpa")
                cells.append("" if r is None else vs(r, p).strip(" ()"))
            print("| %s | %s | " % (m, pass_name) + " | ".join(cells) + " |")


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
