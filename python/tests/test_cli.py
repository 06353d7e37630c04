"""The `linattn` program's bench and accuracy commands on small sizes: they run, write one CSV row
per (method, n, pass) with sane numbers, and reject bad options with a message naming them.
The full sweeps (minutes to an hour) are run by hand for docs/; this only guards the plumbing."""
import csv
import os
import subprocess

import pytest

import linattn

# The program: LINATTN_PROGRAM (make test-python sets it), else the checkout's build/bin/linattn.
BIN = os.environ.get("LINATTN_PROGRAM") or os.path.join(os.path.dirname(__file__), "..", "..", "build", "bin", "linattn")
pytestmark = pytest.mark.skipif(not os.path.exists(BIN), reason="linattn program not built")


def run(*args):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=600)


def test_bench_writes_one_row_per_method_n_and_pass(tmp_path):
    out = tmp_path / "bench.csv"
    r = run("bench", "--n", "128,256", "--heads", "2", "--no-torch", "--m", "32", "--landmarks", "16",
            "--s-proj", "32", "--csv", str(out))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(out)))
    methods = {row["method"] for row in rows}
    assert {"exact softmax", "favor+ m=32", "nystrom m=16", "linformer s=32", "efficient attention"} <= methods
    assert len(rows) == len(methods) * 2 * 2  # every method at both n, forward and forward+backward
    for row in rows:
        assert float(row["median_s"]) > 0
        assert float(row["gflops"]) > 0
        assert row["impl"] == "linattn"  # --no-torch: no peer rows
    assert "crossover" in r.stdout


def test_bench_peers_are_rows_of_their_own(tmp_path):
    """With PyTorch importable, each of our rows is followed by one row per peer (exact attention:
    torch sdpa and the plain formula), timed on the same inputs."""
    pytest.importorskip("torch")
    import sys
    out = tmp_path / "bench.csv"
    r = subprocess.run([BIN, "bench", "--n", "64", "--heads", "2", "--methods", "exact", "--forward-only",
                        "--csv", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, LINATTN_PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(out)))
    impls = {(row["method"], row["impl"]): row for row in rows}
    for method in ("exact softmax", "exact softmax (causal)"):
        for impl in ("linattn", "torch sdpa", "torch plain"):
            assert impls[(method, impl)]["status"] == "ok", (method, impl)
            assert float(impls[(method, impl)]["median_s"]) > 0
    assert len(rows) == 6
    assert "vs torch sdpa" in r.stdout


def test_bench_rejects_unknown_option_and_method():
    r = run("bench", "--frobnicate", "3")
    assert r.returncode != 0 and "--frobnicate" in r.stderr
    r = run("bench", "--n", "128", "--methods", "no-such-method", "--no-torch")
    assert r.returncode != 0 and "no-such-method" in r.stderr


def _one_line_failure(r, *words):
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("linattn: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_failures_are_one_line_and_a_nonzero_exit(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where a folder would have to be
    _one_line_failure(run("bench", "--n", "128", "--no-torch", "--plots", str(blocked / "plots")), "--plots")
    _one_line_failure(run("bench", "--n", "128", "--no-torch", "--csv", str(blocked / "x.csv")), "--csv")
    _one_line_failure(run("accuracy", "--out", str(blocked / "acc")), "--out")
    _one_line_failure(run("bench", "--n", "1000000000", "--no-torch"), "--n 1000000000", "available")
    _one_line_failure(run("bench", "--n", "128", "--threads", "100000", "--no-torch"), "set_num_threads", "1024")
    _one_line_failure(run("demo", "--threads", "0"), "--threads")


def test_more_threads_than_batch_heads(tmp_path):
    """The crash of 0.1.0: Nyström, Linformer and Efficient Attention with 16 threads and
    batch·heads = 2 (what `make demo` does on a 16-core machine)."""
    env = dict(os.environ, LINATTN_NUM_THREADS="16")
    r = subprocess.run([BIN, "demo", "--heads", "2", "--methods", "nystrom,linformer,efficient"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    for name in ("nystrom", "linformer", "efficient"):
        assert name in r.stdout
    bad = dict(os.environ, LINATTN_NUM_THREADS="lots")
    r = subprocess.run([BIN, "demo"], capture_output=True, text=True, timeout=60, env=bad)
    assert r.returncode != 0 and "LINATTN_NUM_THREADS must be an integer" in r.stderr


def test_demo_agrees_with_every_methods_own_definition():
    """`linattn demo`'s "err vs own" column (max |out - ref| / max |ref| against the method's
    float64 definition) is rounding-sized for every method: float32 over n = 4096 keys, at most
    a few hundred u = 6e-8. 1e-4 leaves room and catches a wrong reference comparison (the
    hybrid's sampled rows once gave 0.32)."""
    r = subprocess.run([BIN, "demo", "--heads", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method") and "err vs own" in line)
    rows = []
    for line in lines[header + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    assert len(rows) >= 10, r.stdout
    for fields in rows:
        assert float(fields[-2]) < 1e-4, " ".join(fields)
