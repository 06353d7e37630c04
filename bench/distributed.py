"""What linattn.torch.distributed sends and how long it takes: bytes each rank hands to
torch.distributed per forward and backward (counted by linattn.torch.distributed.traffic() and
checked against the formulas of docs/distributed.md), and the forward+backward time on P
gloo processes on this machine, next to one process of linattn.torch.

    make distributed     # or: .venv/bin/python bench/distributed.py --out out/distributed --docs docs/distributed.md

Writes the measured section of docs/distributed.md (between its MEASURED markers) and the raw
results as JSON in --out. --quick runs tiny sizes (the test's). On a 2-core machine P processes
share 2 cores, so the times show the overhead of splitting, not a speed-up; the bytes are what
carries over to a cluster."""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_section  # noqa: E402

import linattn
import linattn.torch as lt

B, H, D = 1, 4, 64
M_FAVOR, S_LINFORMER = 256, 256
AGREE = 40 * 8  # the agreement row every call starts with: 40 float64

# (label, function, options, layout)
CONFIGS = [
    ("softmax", "softmax_attention", {}, "contiguous"),
    ("softmax causal", "softmax_attention", {"causal": True}, "zigzag"),
    ("elu", "linear_attention", {}, "contiguous"),
    ("elu causal", "linear_attention", {"causal": True}, "contiguous"),
    ("FAVOR+ m=256", "favor_attention", {}, "contiguous"),
    ("FAVOR+ m=256 causal", "favor_attention", {"causal": True}, "contiguous"),
    ("Efficient", "efficient_attention", {}, "contiguous"),
    ("Linformer s=256", "linformer_attention", {}, "contiguous"),
]


def predicted_bytes(label, n, P, elt=4):
    """(forward, backward) payload bytes per rank, from the algorithm (docs/distributed.md)."""
    block = B * H * (n // P) * 2 * D * elt  # one k, v block (d_v = d)
    if label.startswith("softmax"):
        return AGREE + (P - 1) * block, ((P - 1) + (P if P > 1 else 0)) * block
    if label.startswith(("elu", "FAVOR")):
        m = D if label.startswith("elu") else M_FAVOR
        state = B * H * m * (D + 1) * elt
        shift = B * H * m * elt if label.startswith("FAVOR") else 0
        segments = 1  # contiguous layout
        if label.endswith("causal"):  # FAVOR's shifts travel with the states, and so back
            return AGREE + segments * (state + shift), P * segments * (state + shift)
        return AGREE + shift + state, state
    if label == "Efficient":
        return AGREE + B * H * D * elt + B * H * D * (D + 1) * elt, B * H * D * (D + 1) * elt
    return AGREE + B * H * S_LINFORMER * 2 * D * elt, B * H * S_LINFORMER * 2 * D * elt  # Linformer


def make_inputs(function, n, gen):
    q, k, v = (torch.randn(B, H, n, D, generator=gen) * 0.5 for _ in range(3))
    extra = []
    if function == "favor_attention":
        extra = [torch.from_numpy(linattn.random_features(M_FAVOR, D, seed=0))]
    if function == "linformer_attention":
        extra = [torch.randn(S_LINFORMER, n, generator=gen) / n ** 0.5 for _ in range(2)]
    return q, k, v, extra


def timed(step, reps, sync):
    """Median seconds of step() after one warm-up; sync() makes every rank start together and
    returns the slowest rank's time."""
    step()
    times = []
    for _ in range(reps):
        sync(None)
        t = time.perf_counter()
        step()
        times.append(sync(time.perf_counter() - t))
    return statistics.median(times)


def timed_alternately(steps, reps, sync):
    """Median seconds of each of steps, timed in turns (one of each per round, after a warm-up
    of each), so that the machine's drift from moment to moment falls on all of them alike."""
    for step in steps:
        step()
    times = [[] for _ in steps]
    for _ in range(reps):
        for step, t_list in zip(steps, times):
            sync(None)
            t = time.perf_counter()
            step()
            t_list.append(sync(time.perf_counter() - t))
    return [statistics.median(t_list) for t_list in times]


def worker(rank, P, store, ns, reps, path):
    import linattn.torch.distributed as ld
    threads = max(1, 2 // P)
    torch.set_num_threads(threads)
    linattn.set_num_threads(threads)
    # A FileStore: no port to choose, so none can be taken by another process first.
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=P)

    def sync(elapsed):
        if elapsed is None:
            dist.barrier()
            return None
        t = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    rows = []
    for n in ns:
        for label, function, opts, layout in CONFIGS:
            q, k, v, extra = make_inputs(function, n, torch.Generator().manual_seed(n))
            part = lambda x: ld.shard(x, layout=layout)  # noqa: E731,B023
            ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
            extra = [e.requires_grad_() if function == "linformer_attention" else e for e in extra]
            fn = getattr(ld, function)

            def step():
                out = fn(ql, kl, vl, *extra, layout=layout, **opts)  # noqa: B023
                out.sum().backward()

            ld.reset_traffic()
            out = fn(ql, kl, vl, *extra, layout=layout, **opts)
            forward_bytes = ld.traffic()["bytes"]
            out.sum().backward()
            backward_bytes = ld.traffic()["bytes"] - forward_bytes
            row = {"method": label, "n": n, "ranks": P, "threads_per_rank": threads, "forward_bytes": forward_bytes,
                   "backward_bytes": backward_bytes, "predicted": predicted_bytes(label, n, P)}
            if P == 1:  # one process of linattn.torch on the same inputs, timed in turns with P = 1
                qa, ka, va = (x.detach().requires_grad_() for x in (q, k, v))
                single = getattr(lt, function)
                opts1 = dict(opts)

                def step1():
                    out = single(qa, ka, va, *extra, **opts1)  # noqa: B023
                    out.sum().backward()
                row["seconds"], row["single_process_seconds"] = timed_alternately([step, step1], reps, sync)
            else:
                row["seconds"] = timed(step, reps, sync)
            rows.append(row)
            if rank == 0:
                print("  P=%d n=%-6d %-20s %9d + %9d bytes  %.4f s" % (P, n, label, forward_bytes, backward_bytes,
                                                                     row["seconds"]), flush=True)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def human(b):
    for unit, f in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= f:
            return "%.1f %s" % (b / f, unit)
    return "%d B" % b


def table(rows, ranks, ns):
    by = {(r["method"], r["n"], r["ranks"]): r for r in rows}
    lines = ["| method | n | " + " | ".join("P=%d bytes/rank fwd + bwd" % P for P in ranks if P > 1) +
             " | one process, linattn.torch | " + " | ".join("P=%d" % P for P in ranks) + " |",
             "|---|---:|" + "---:|" * (len([P for P in ranks if P > 1]) + 1 + len(ranks))]
    for label, *_ in CONFIGS:
        for n in ns:
            cells = []
            for P in ranks:
                if P > 1:
                    r = by[(label, n, P)]
                    cells.append("%s + %s" % (human(r["forward_bytes"]), human(r["backward_bytes"])))
            cells.append("%.1f ms" % (1e3 * by[(label, n, ranks[0])]["single_process_seconds"]))
            cells += ["%.1f ms" % (1e3 * by[(label, n, P)]["seconds"]) for P in ranks]
            lines.append("| %s | %d | %s |" % (label, n, " | ".join(cells)))
    return "\n".join(lines)


def report(rows, ranks, ns, command, reps):
    bad = [r for r in rows if [r["forward_bytes"], r["backward_bytes"]] != list(r["predicted"])]
    if bad:
        raise SystemExit("payload differs from the formulas: %s" % bad)
    return "\n".join([
        "Measured with `%s` (B = %d, H = %d, d = d_v = %d, float32; FAVOR+ m = %d, Linformer s = %d; contiguous "
        "blocks, zig-zag for causal softmax) on this 2-core VM: P gloo processes on the loopback interface, each with "
        "max(1, 2/P) threads. Bytes: payload this rank handed to torch.distributed (linattn.torch.distributed."
        "traffic()), per forward and per backward, every row equal to the formula above. Times: forward + backward, "
        "median of %d after a warm-up, the slowest rank's; at P = 1 timed in turns with one process."
        % (command, B, H, D, M_FAVOR, S_LINFORMER, reps),
        "",
        table(rows, ranks, ns),
        "",
        "The bytes of the linear methods do not change with n (elu: %s per rank forward at every n and P); the "
        "ring's grow as n (softmax at P = %d: %s at n = %d, %s at n = %d). Times on 2 cores: P > 2 processes "
        "share the cores, so the column shows what splitting costs, not what a cluster gains." % (
            human(next(r for r in rows if r["method"] == "elu" and r["ranks"] == ranks[-1])["forward_bytes"]),
            ranks[-1], human(next(r for r in rows if r["method"] == "softmax" and r["ranks"] == ranks[-1]
                                  and r["n"] == ns[0])["forward_bytes"]), ns[0],
            human(next(r for r in rows if r["method"] == "softmax" and r["ranks"] == ranks[-1]
                       and r["n"] == ns[-1])["forward_bytes"]), ns[-1]),
    ])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/distributed")
    ap.add_argument("--docs", default=None, help="docs/distributed.md: rewrite its measured section")
    ap.add_argument("--ns", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--quick", action="store_true", help="n = 64, 128 and one repetition (the test's)")
    ap.add_argument("--rows", help="write the report from this distributed.json instead of measuring")
    a = ap.parse_args()
    if a.quick:
        a.ns, a.reps = [64, 128], 1
    if a.ranks[0] != 1:
        raise SystemExit("--ranks must start with 1 (the single-process times come from it)")
    os.makedirs(a.out, exist_ok=True)
    rows = json.load(open(a.rows)) if a.rows else []
    if rows:
        a.ns = sorted({r["n"] for r in rows})
        a.ranks = sorted({r["ranks"] for r in rows})
    for P in ([] if rows else a.ranks):
        print("P = %d" % P, flush=True)
        path = os.path.join(a.out, "ranks%d.json" % P)
        # A FileStore file must be new, and on a local file system: its fcntl locks hung on this
        # checkout's shared mount (2026-11-25), so it goes to a fresh temporary folder.
        store = os.path.join(tempfile.mkdtemp(prefix="linattn-distributed-"), "store%d" % P)
        mp.spawn(worker, args=(P, store, a.ns, a.reps, path), nprocs=P, join=True)
        rows += json.load(open(path))
    if not a.rows:
        json.dump(rows, open(os.path.join(a.out, "distributed.json"), "w"), indent=1)
    command = "make distributed" if not a.quick else "bench/distributed.py --quick"
    text = report(rows, a.ranks, a.ns, command, a.reps)
    print(text)
    if a.docs:
        measured_section.write(a.docs, "distributed.py", text)


if __name__ == "__main__":
    sys.exit(main())
