"""Plots of a `linattn bench` CSV: time and memory against n, log–log, two panels (non-causal,
causal). linattn's rows are solid lines with markers, one colour per method; each method's first
peer (the first non-linattn impl the CSV lists for it: performer-pytorch, nystrom-attention,
linformer, or torch plain, the same formula in plain PyTorch) is dashed in the same colour, with its
skipped points (would not fit in memory) marked x; torch sdpa, from the exact softmax rows, is a
thick black dash-dot line in the panel of its causality. A square marks the crossover n from which
each non-exact method stays faster than linattn's exact attention. Writes DIR/time_fwd.png,
DIR/time_fwd_bwd.png, DIR/memory_fwd.png and DIR/memory_fwd_bwd.png.

The CSV is the long format `linattn bench` writes: one row per implementation per (method, n, pass)
with columns method, causal, n, batch, heads, head_dim, pass, impl, status, flops, median_s, min_s,
runs, gflops, fraction_of_sgemm, workspace_bytes, rss_growth_bytes, sgemm_gflops, threads, note;
impl "linattn" is this library, any other impl a peer (workspace_bytes -1; status ok, skipped,
unavailable or failed).

Usage: python3 plot_bench.py BENCH.csv DIR   (matplotlib from Debian's python3-matplotlib)
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def num(x, empty):
    return float(x) if x not in ("", None) else empty


def load(path):
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        r["n"] = int(r["n"])
        r["median_s"] = num(r["median_s"], 0.0)
        r["workspace_bytes"] = num(r["workspace_bytes"], -1.0)
        r["rss_growth_bytes"] = num(r["rss_growth_bytes"], -1.0)
    return rows


def first_peers(rows):
    """method -> the first peer impl the CSV lists for it (methods without a peer are absent)."""
    out = {}
    for r in rows:
        if r["impl"] != "linattn":
            out.setdefault(r["method"], r["impl"])
    return out


def crossovers(rows, pass_name):
    """Smallest n from which each non-exact method stays faster than linattn's exact attention of
    the same causality (linattn rows only)."""
    out = {}
    ours = [r for r in rows if r["impl"] == "linattn" and r["pass"] == pass_name]
    exact = {}
    for r in ours:
        if r["method"].startswith("exact"):
            exact.setdefault((r["causal"], r["n"]), r["median_s"])
    for name in sorted({r["method"] for r in ours if not r["method"].startswith("exact")}):
        pts = sorted((r["n"], r["median_s"], r["causal"]) for r in ours if r["method"] == name)
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


def value(r, what):
    """The plotted y of a row: time in ms, or peak extra memory in MiB (None if not measured)."""
    if what == "time":
        return r["median_s"] * 1e3 if r["median_s"] > 0 else None
    m = max(r["rss_growth_bytes"], r["workspace_bytes"])
    if r["impl"] == "linattn":
        return max(m, 1) / 2**20
    return m / 2**20 if m > 0 else None


def peer_line(ax, rows, ns_ours, ys_ours, what, style):
    """Plot the ok points of peer rows (sorted by n) and mark the skipped ones with x, at the last
    ok point's height (or at ours where the peer has none)."""
    ok = [(r["n"], value(r, what)) for r in rows if r["status"] == "ok" and value(r, what) is not None]
    if ok:
        ax.plot([n for n, _ in ok], [y for _, y in ok], **style, **({"marker": "."} if len(ok) == 1 else {}))
    skipped = [r["n"] for r in rows if r["status"] == "skipped"]
    if skipped:
        ours = dict(zip(ns_ours, ys_ours))
        ys = [ok[-1][1] if ok else ours.get(n, 1) for n in skipped]
        ax.plot(skipped, ys, "x", color=style["color"], ms=5)


def plot(rows, pass_name, what, path):
    """Two panels, non-causal and causal (each with exact attention of that kind)."""
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.8))
    rows = [r for r in rows if r["pass"] == pass_name]
    ours_all = [r for r in rows if r["impl"] == "linattn"]
    names = sorted({r["method"] for r in ours_all}, key=lambda s: (not s.startswith("exact"), s))
    colors = {name: "C%d" % (i % 10) for i, name in enumerate(names)}
    peer_of = first_peers(rows)
    cross = crossovers(rows, pass_name) if what == "time" else {}
    for ax, causal in zip(axes, ("0", "1")):
        for name in names:
            pts = sorted((r["n"], r) for r in ours_all if r["method"] == name and r["causal"] == causal)
            if not pts:
                continue
            color = colors[name]
            ns = [n for n, _ in pts]
            ours = [value(r, what) for _, r in pts]
            ax.plot(ns, ours, "-o", color=color, ms=3, label=name)
            peer = peer_of.get(name)
            # torch sdpa, the exact rows' first peer, gets its own black line below.
            if peer and peer != "torch sdpa":
                theirs = sorted((r for r in rows if r["method"] == name and r["causal"] == causal
                                 and r["impl"] == peer), key=lambda r: r["n"])
                peer_line(ax, theirs, ns, ours, what,
                          dict(ls="--", color=color, lw=1, label="%s (%s)" % (name, peer)))
            if cross.get(name):
                n0 = cross[name]
                y0 = [o for n, o in zip(ns, ours) if n == n0][0]
                ax.annotate("crossover n=%d" % n0, (n0, y0), textcoords="offset points", xytext=(6, -3),
                            fontsize=7, color=color)
                ax.plot([n0], [y0], "s", color=color, ms=7, mfc="none")
        sdpa = sorted((r for r in rows if r["impl"] == "torch sdpa" and r["causal"] == causal
                       and r["method"].startswith("exact")), key=lambda r: r["n"])
        if sdpa:
            ex = sorted((r["n"], value(r, what)) for r in ours_all
                        if r["method"].startswith("exact") and r["causal"] == causal)
            peer_line(ax, sdpa, [n for n, _ in ex], [y for _, y in ex], what,
                      dict(ls="-.", color="black", lw=2.2, label="torch sdpa"))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("time (ms)" if what == "time" else "peak extra memory (MiB)")
        ax.set_title("causal" if causal == "1" else "non-causal", fontsize=9)
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=6, ncol=2)
    r0 = ours_all[0] if ours_all else rows[0]
    fig.suptitle("%s, %s: B=%s H=%s d=%s float32, %s threads (solid: linattn, dashed: the method's peer package "
                 "or plain PyTorch, dash-dot: torch sdpa; x: peer skipped, would not fit in memory; square: "
                 "crossover with linattn's exact attention)"
                 % (what, pass_name, r0["batch"], r0["heads"], r0["head_dim"], r0["threads"]), fontsize=8)
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
