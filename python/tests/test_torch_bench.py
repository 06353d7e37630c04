"""The peers `linattn bench` compares against (bench/torch_bench.py: plain-PyTorch formulas,
torch's scaled_dot_product_attention, performer-pytorch, nystrom-attention, linformer) compute
the same functions as linattn, on the same inputs and parameters: otherwise the speed ratios
would compare different things. Needs requirements/torch.txt (in .venv); skipped without torch."""
import importlib.util
import os

import numpy as np
import pytest

import linattn

torch = pytest.importorskip("torch")
spec = importlib.util.spec_from_file_location(
    "torch_bench", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "torch_bench.py"))
tb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tb)


@pytest.fixture
def data(rng):
    B, H, n, d = 1, 2, 96, 16
    centres = rng.standard_normal((B, H, 8, d))
    idx = np.arange(n) * 8 // n
    q = 0.5 * rng.standard_normal((B, H, n, d)) + centres[:, :, idx]
    k = 0.5 * rng.standard_normal((B, H, n, d)) + centres[:, :, idx]
    v = rng.standard_normal((B, H, n, d))
    return q, k, v


def run(fn, q, k, v, causal=False, **extra):
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))
    with torch.no_grad():
        return fn(t(q), t(k), t(v), causal, {x: t(y) if isinstance(y, np.ndarray) else y for x, y in extra.items()}).numpy()


@pytest.mark.parametrize("causal", [False, True])
def test_exact_and_kernelized(data, causal):
    q, k, v = data
    np.testing.assert_allclose(run(tb.exact, q, k, v, causal), linattn.softmax_attention(q, k, v, causal=causal),
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(run(tb.elu, q, k, v, causal), linattn.linear_attention(q, k, v, causal=causal),
                               rtol=1e-10, atol=1e-12)
    w = linattn.random_features(32, q.shape[-1], seed=3, dtype=np.float64)
    np.testing.assert_allclose(run(tb.favor, q, k, v, causal, favor_w=w),
                               linattn.favor_attention(q, k, v, w, causal=causal), rtol=1e-9, atol=1e-12)


def test_nystrom_linformer_efficient(data):
    q, k, v = data
    np.testing.assert_allclose(run(tb.nystrom, q, k, v, landmarks=12),
                               linattn.nystrom_attention(q, k, v, num_landmarks=12), rtol=1e-8, atol=1e-10)
    e, f = linattn.linformer_projections(24, q.shape[2], seed=4, dtype=np.float64)
    np.testing.assert_allclose(run(tb.linformer, q, k, v, linformer_e=e, linformer_f=f),
                               linattn.linformer_attention(q, k, v, e, f), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(run(tb.efficient, q, k, v), linattn.efficient_attention(q, k, v),
                               rtol=1e-10, atol=1e-12)


def run_peer(method, peer, q, k, v, causal=False, **extra):
    """One forward of a bench peer, its output as [B,H,n,d] (lucidrains' modules give [B,n,H·d])."""
    t = {s: torch.from_numpy(np.ascontiguousarray(x)) for s, x in (("q", q), ("k", k), ("v", v))}
    t["dout"] = torch.zeros_like(t["v"])
    extra = {x: torch.from_numpy(y) if isinstance(y, np.ndarray) else y for x, y in extra.items()}
    make = dict(tb.peers_of(method, causal))[peer]
    call, leaves, _ = make(t, extra, causal)
    with torch.no_grad():
        out = call(*leaves)
    B, H, n, d = q.shape
    if out.dim() == 3:
        out = out.reshape(B, n, H, d).transpose(1, 2)
    return out.numpy()


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_peer_is_exact_attention(data, causal):
    q, k, v = data
    np.testing.assert_allclose(run_peer("exact softmax", "torch sdpa", q, k, v, causal),
                               linattn.softmax_attention(q, k, v, causal=causal), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_peer_is_favor(data, causal, monkeypatch):
    """performer-pytorch adds 1e-4 to every feature (and 1e-6 to the causal key sums); with those
    set to 0 it computes our FAVOR+ with the same projection. The benchmark times it as shipped:
    the constants cost nothing."""
    import functools
    pp = pytest.importorskip("performer_pytorch.performer_pytorch")
    monkeypatch.setattr(pp, "softmax_kernel", functools.partial(pp.softmax_kernel, eps=0.0))
    monkeypatch.setattr(pp, "causal_linear_attention_noncuda",
                        functools.partial(pp.causal_linear_attention_noncuda, eps=0.0))
    q, k, v = data
    w = linattn.random_features(32, q.shape[-1], seed=3, dtype=np.float64)
    np.testing.assert_allclose(run_peer("favor+ m=32", "performer-pytorch", q, k, v, causal, favor_w=w),
                               linattn.favor_attention(q, k, v, w, causal=causal), rtol=1e-9, atol=1e-12)


def test_nystrom_peer(data):
    """nystrom-attention scales the pseudo-inverse's first iterate by the largest row and column
    sums over all heads at once, we per head: the same for one head."""
    pytest.importorskip("nystrom_attention")
    q, k, v = (x[:, :1] for x in data)
    np.testing.assert_allclose(run_peer("nystrom m=12", "nystrom-attention", q, k, v, landmarks=12),
                               linattn.nystrom_attention(q, k, v, num_landmarks=12), rtol=1e-8, atol=1e-10)


def test_linformer_peer(data):
    pytest.importorskip("linformer")
    q, k, v = data
    e, f = linattn.linformer_projections(24, q.shape[2], seed=4, dtype=np.float64)
    np.testing.assert_allclose(run_peer("linformer s=24", "linformer", q, k, v, linformer_e=e, linformer_f=f),
                               linattn.linformer_attention(q, k, v, e, f), rtol=1e-10, atol=1e-12)


def test_every_method_has_a_peer_and_exact_attention_has_sdpa():
    for name in ("exact softmax", "linear elu", "favor+ m=256", "nystrom m=64", "linformer s=256",
                 "efficient attention"):
        assert tb.peers_of(name, False), name
    assert [p for p, _ in tb.peers_of("exact softmax (causal)", True)] == ["torch sdpa", "torch plain"]
    assert tb.peers_of("nystrom m=64", True) == []  # no causal form, as in linattn


def bench_script(name):
    """(path, module) of bench/<name>.py, loaded as a module."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", name + ".py")
    spec = importlib.util.spec_from_file_location("bench_" + name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_lolcats_peers_compute_the_hybrid():
    # bench/hybrid_lolcats.py: LoLCATs' linear (cumsum) and quadratic forms are the same function
    # as linattn's causal hybrid on given features, in float64 to 1e-12 (the script itself
    # checks float32 at 1e-4 before timing); --quick runs the whole script.
    import subprocess
    import sys
    path, hl = bench_script("hybrid_lolcats")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 29, 8, generator=g, dtype=torch.float64) for _ in range(3))
    fq, fk = (torch.rand(2, 3, 29, 6, generator=g, dtype=torch.float64) for _ in range(2))
    gate = torch.randn(3, generator=g, dtype=torch.float64)
    for window in (1, 4, 40):
        want = hl.ours(q, k, fq, fk, v, gate, window, 1e-6)
        for name, fn in hl.PEERS.items():
            got = fn(q, k, fq, fk, v, gate, window, 1e-6)
            assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max()), (name, window)
        # The two parts timed alone: the window's exact softmax over keys (i − window, i] (γ cancels
        # at eps = 0), and the linear part's causal sums [Σ_{j<=i} φq·φk v_j | Σ_{j<=i} φq·φk].
        i, j = torch.arange(29)[:, None], torch.arange(29)[None, :]
        band = (j <= i) & (j > i - window)
        scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~band, float("-inf"))
        want_window = torch.softmax(scores, -1) @ v
        got = hl.window_part(q, k, fq, fk, v, gate, window, 0.0)
        assert float((got - want_window).abs().max()) <= 1e-12 * float(want_window.abs().max()), window
    weights = (fq @ fk.transpose(-1, -2)).tril()
    want_linear = torch.cat([weights @ v, weights.sum(-1, keepdim=True)], -1)
    got = hl.linear_part(q, k, fq, fk, v, gate, 4, 1e-6)
    assert float((got - want_linear).abs().max()) <= 1e-12 * float(want_linear.abs().max())
    out = subprocess.run([sys.executable, path, "--quick", "--threads", "1"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| 40 |" in out.stdout
    assert "hybrid / (sum) fwd" in out.stdout


def test_gated_peers_compute_gated_linear_attention():
    # bench/gated.py: fla's naive PyTorch forms (fla-core) are the same function as linattn's
    # gated linear attention. They compute in float32 whatever the input (their .float()), so
    # in float32: each output is a sum of ~150 terms, a float32 rounding bound of about
    # 150·u·Σ|terms| ≈ 1e-5 of the largest output; 1e-4 leaves a margin and is far below a
    # wrong decay's error. --quick runs the whole script.
    import subprocess
    import sys
    path, bg = bench_script("gated")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 150, 8, generator=g) for _ in range(3))
    for per_channel in (False, True):
        gates = -0.5 * torch.rand((2, 3, 150, 8) if per_channel else (2, 3, 150), generator=g)
        peers = bg.peers_for(per_channel)
        want = None
        for name, (to_layout, fn) in peers.items():
            got = fn(*to_layout(q, k, v, gates), 8 ** -0.5)
            want = got if want is None else want
            assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()), (name, per_channel)
        assert set(peers) == {"linattn", "fla recurrent"} | (set() if per_channel else {"fla chunk"})
    out = subprocess.run([sys.executable, path, "--quick", "--threads", "1"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| per channel | 70 |" in out.stdout


def test_delta_bench_runs_and_its_peers_are_transformers_functions():
    # bench/delta.py times transformers' own reference PyTorch functions (not fla's Triton ones,
    # which fail on a CPU) and checks every form against linattn's at 1e-4 before timing;
    # --quick runs the whole script, the tiny models included (same tokens on both paths).
    import subprocess
    import sys
    path, bd = bench_script("delta")
    chunk, recurrent = bd.transformers_functions()
    assert chunk.__module__.startswith("transformers.") and recurrent.__module__.startswith("transformers.")
    assert bd.flops_per_position(128, 128) == 6 * 128 * 128 + 4 * 64 * 128 + 3 * 64 * 128
    out = subprocess.run([sys.executable, path, "--quick", "--threads", "1"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "| 70 |" in out.stdout and "same on both paths: yes" in out.stdout
