"""The PyTorch implementations `linattn bench` compares against (bench/torch_bench.py) compute
the same functions as linattn, on the same inputs and parameters: otherwise the speed ratios
would compare different things. Needs Debian's python3-torch (installed by `make bench`);
skipped where it is missing."""
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
