"""bfloat16 (ml_dtypes / torch.bfloat16) and float16 everywhere: NumPy functions, linattn.torch
with autograd, MultiheadAttention and the Hugging Face backends.

A 16-bit call widens its inputs exactly to float32, runs the float32 kernels and rounds the
output and gradients once (to nearest even), so the tests ask for bitwise equality with the
float32 call on the widened inputs, rounded; what the forward saves stays float32. How far a
16-bit result is from float64 on the original inputs is measured in docs/precision.md.

The one exception: on a CPU with AMX-BF16 tiles or AVX512-BF16, exact attention's bfloat16
forward multiplies in bfloat16 (build_info() says so), and so does its backward where the CPU
has AVX512-BF16. The forward rounds its probabilities to bfloat16 before P·V, so its output is
within u·|ref| + u·max|v| of the float32 one (u = 2^-8), not bitwise it; the backward rounds P
and dS (_softmax_grad_bound). The C++ suite (test_softmax_bf16.cc) checks both against float64.

Likewise linear_attention and favor_attention (positive and hyperbolic kernels) in bfloat16 on
AVX512-BF16 (build_info() says "products in bfloat16"): every matrix product takes its operands rounded to
bfloat16 (_kernelized_out_bound, _kernelized_grad_bound; the C++ suite's per-term bound against
float64 is in tests/kernelized_bounds.h)."""
import ml_dtypes
import numpy as np
import pytest
import torch

import linattn
import linattn.torch as lt

BF16 = np.dtype(ml_dtypes.bfloat16)
LOW = [BF16, np.dtype(np.float16)]
TORCH = {BF16: torch.bfloat16, np.dtype(np.float16): torch.float16}


BF16_PRODUCTS = "exact attention's forward" in linattn.build_info()
BF16_BACKWARD = "backward on AVX512-BF16" in linattn.build_info()
KERNELIZED_BF16 = "linear_attention and FAVOR+ (positive, hyperbolic) products in bfloat16" in linattn.build_info()
KERNELIZED = {"linear", "linear_backward", "favor", "favor_backward"}


def _kernelized_out_bound(ref, v):
    """|out − ref| allowed for the kernelized bfloat16-product forwards against the float32 ones.
    Its weights are non-negative sums over features, and each sum has
    three operands rounded to bfloat16 on its way (the query's and the key's features, and the
    state or the chunk's weights): num and den move by at most 3u of their own sums of absolute
    values, so num/den moves by 2·3u/(1 − 3u)·max|v| ≤ 6.1u·max|v|; the output's rounding adds
    u·|ref| (and u times that change), the float32 sums 2^-16·max|v| at these sizes."""
    u = 2.0 ** -8
    return u * np.abs(ref) + (6.2 * u + 2.0 ** -16) * np.abs(v).max()


def _kernelized_grad_bound(g32):
    """|g − g32| allowed for its bfloat16-product gradients against the float32 ones: each term
    of a gradient passes through at most ten bfloat16 roundings (kernelized_bounds.h: six
    features and four operands), here against the gradient's scale instead of the sum of its
    terms' magnitudes (the C++ suite checks that per-term bound against float64), plus the
    rounding of the result."""
    u = 2.0 ** -8
    g32 = np.abs(np.asarray(g32, np.float64))
    return 2 * u * g32 + 10 * u * g32.max()


def _tiles_bound(ref, v):
    """|out − ref| allowed for the bfloat16-product forward (AMX or AVX512-BF16) against the float32 one: the output's
    rounding, the probabilities' (u·max|v|) and the float32 sums (2^-16·max|v|, generous for
    these sizes)."""
    u = 2.0 ** -8
    return u * np.abs(ref) + (u + 2.0 ** -16) * np.abs(v).max()


def _softmax_grad_bound(q, k, v, dout, causal, grads32):
    """|g − g32| allowed for the bfloat16-product backward against the float32 one, per gradient
    (dq, dk, dv), from float64 quantities: P, dS = P∘(dP − δ), and Δδ_i, the error of δ_i from
    the bfloat16 forward's out (u·|out| + (u + 2^-16)·max|v| per element). Each dS is rounded
    (u) after P's and δ's errors: E = 2u·|dS| + P·Δδ; dP = E·|k|·scale and so on, with 1.1 for
    the float32 sums of both sides (n·2^-24 ≪ u here)."""
    u = 2.0 ** -8
    q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    scale = 1 / np.sqrt(q.shape[-1])
    s = scale * q @ np.swapaxes(k, -1, -2)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool), s.shape[-1] - s.shape[-2]), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ v
    dp = g @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (g * out).sum(-1, keepdims=True))
    d_delta = (np.abs(g) * (u * np.abs(out) + (u + 2.0 ** -16) * np.abs(v).max())).sum(-1, keepdims=True)
    e = 2 * u * np.abs(ds) + p * d_delta
    bounds = (scale * e @ np.abs(k), scale * np.swapaxes(e, -1, -2) @ np.abs(q),
              2 * u * np.swapaxes(p, -1, -2) @ np.abs(g))
    return [u * np.abs(np.asarray(g32, np.float64)) + 1.1 * b for g32, b in zip(grads32, bounds)]


def _rounded(shape, dtype, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def _wide(x):
    return x.astype(np.float32) if isinstance(x, np.ndarray) else x


def _calls(dtype, n=40, d=8, seed=0):
    """(name, function of (q, k, v, dout, extra tensors...)) for every method and its backward,
    with the extra tensors each needs, all in dtype."""
    w = linattn.random_features(32, d).astype(dtype)
    e, f = (x.astype(dtype) for x in linattn.linformer_projections(6, n))
    conv = np.full((2, 3), 0.1, np.float32).astype(dtype)
    hh = [_rounded(s, dtype, seed + i) for i, s in enumerate([(2, d, 4), (2, 4), (2, d, 4), (2, 4)])]
    fq, fk = (np.abs(_rounded((1, 2, n, 6), dtype, seed + 9 + i)) for i in range(2))
    gate = np.zeros(2, np.float32).astype(dtype)
    return [
        ("softmax", lambda q, k, v, g, *t: linattn.softmax_attention(q, k, v, causal=True), []),
        ("softmax_backward", lambda q, k, v, g, *t: linattn.softmax_attention_backward(q, k, v, g), []),
        ("linear", lambda q, k, v, g, c: linattn.linear_attention(q, k, v, conv_weight=c), [conv]),
        ("linear_backward", lambda q, k, v, g, c: linattn.linear_attention_backward(q, k, v, g, conv_weight=c,
                                                                                    causal=True), [conv]),
        ("favor", lambda q, k, v, g, w: linattn.favor_attention(q, k, v, w, causal=True), [w]),
        ("favor_backward", lambda q, k, v, g, w: linattn.favor_attention_backward(q, k, v, w, g), [w]),
        ("nystrom", lambda q, k, v, g, c: linattn.nystrom_attention(q, k, v, num_landmarks=4, conv_weight=c), [conv]),
        ("nystrom_backward", lambda q, k, v, g, c: linattn.nystrom_attention_backward(q, k, v, g, num_landmarks=4,
                                                                                      conv_weight=c), [conv]),
        ("linformer", lambda q, k, v, g, e, f: linattn.linformer_attention(q, k, v, e, f), [e, f]),
        ("linformer_backward", lambda q, k, v, g, e, f: linattn.linformer_attention_backward(q, k, v, e, f, g),
         [e, f]),
        ("efficient", lambda q, k, v, g: linattn.efficient_attention(q, k, v), []),
        ("efficient_backward", lambda q, k, v, g: linattn.efficient_attention_backward(q, k, v, g), []),
        ("hybrid", lambda q, k, v, g, a, b, c: linattn.hybrid_attention(q, k, v, query_features=a, key_features=b,
                                                                        window_gate=c, window=5, causal=True, feature_map="given"),
         [fq, fk, gate]),
        ("hybrid_backward", lambda q, k, v, g, a, b, c: linattn.hybrid_attention_backward(
            q, k, v, g, query_features=a, key_features=b, window_gate=c, window=5, causal=True, feature_map="given"),
         [fq, fk, gate]),
        ("hedgehog", lambda q, k, v, g, *h: linattn.hedgehog_attention(q, k, v, *h, causal=True), hh),
        ("hedgehog_backward", lambda q, k, v, g, *h: linattn.hedgehog_attention_backward(q, k, v, *h, g), hh),
    ]


@pytest.mark.parametrize("dtype", LOW, ids=["bfloat16", "float16"])
def test_every_numpy_function_is_its_float32_result_rounded_once(dtype):
    n, d = 40, 8
    q, k, v, g = (_rounded((1, 2, n, d), dtype, s) for s in range(4))
    calls = _calls(dtype, n, d)
    assert {c[0] for c in calls} >= {m["name"] for m in linattn.methods()}
    for name, call, extra in calls:
        got = call(q, k, v, g, *extra)
        want = call(*(_wide(x) for x in (q, k, v, g, *extra)))
        got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
        assert len(got) == len(want), name
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == dtype, (name, i, a.dtype)
            if name == "softmax" and dtype == BF16 and BF16_PRODUCTS:
                err = np.abs(a.astype(np.float64) - b)
                assert (err <= _tiles_bound(b, v.astype(np.float32))).all(), err.max()
                continue
            if name in KERNELIZED and dtype == BF16 and KERNELIZED_BF16:
                err = np.abs(a.astype(np.float64) - b)
                bound = (_kernelized_out_bound(b, v.astype(np.float32)) if not name.endswith("_backward")
                         else _kernelized_grad_bound(b))
                assert (err <= bound).all(), (name, i, err.max())
                continue
            if name == "softmax_backward" and dtype == BF16 and BF16_BACKWARD:
                bound = _softmax_grad_bound(q, k, v, g, False, want)[i]
                err = np.abs(a.astype(np.float64) - b)
                assert (err <= bound).all(), (i, err.max())
                continue
            np.testing.assert_array_equal(a.view(np.uint16), b.astype(dtype).view(np.uint16), err_msg="%s[%d]" % (name, i))


@pytest.mark.parametrize("dtype", LOW, ids=["bfloat16", "float16"])
def test_saved_tensors_are_float32_and_reused(dtype):
    q, k, v, g = (_rounded((1, 2, 33, 8), dtype, s) for s in range(4))
    out, lse = linattn.softmax_attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and lse.dtype == np.float32
    fresh = linattn.softmax_attention_backward(q, k, v, g)
    # "out" as the forward gave it (16-bit) or widened: the same gradients, within the 16-bit
    # rounding of out in the softmax backward's rowsum(dout·out).
    for o in (out, out.astype(np.float32)):
        reused = linattn.softmax_attention_backward(q, k, v, g, out=o, lse=lse)
        for a, b in zip(reused, fresh):
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=0.05, atol=0.05)
    with pytest.raises(TypeError, match="lse has dtype float64 but must be float32"):
        linattn.softmax_attention_backward(q, k, v, g, out=out, lse=lse.astype(np.float64))


def test_mixed_dtypes_name_both():
    q = _rounded((1, 1, 8, 4), BF16, 0)
    k = q.astype(np.float32)
    with pytest.raises(TypeError, match="k has dtype float32 but q has bfloat16"):
        linattn.softmax_attention(q, k, q)
    with pytest.raises(TypeError, match="v has dtype float16 but q has bfloat16"):
        linattn.linear_attention(q, q, q.astype(np.float16))
    w = linattn.random_features(8, 4)
    with pytest.raises(TypeError, match="projection has dtype float32 but q has bfloat16"):
        linattn.favor_attention(q, q, q, w)
    with pytest.raises(TypeError, match="k has dtype float32 but q has bfloat16"):
        hh = [np.zeros(s, t) for s, t in [((1, 4, 2), BF16), ((1, 2), BF16), ((1, 4, 2), np.float32),
                                          ((1, 2), np.float32)]]
        linattn.hedgehog_attention(q, k, q, *hh)


def test_helpers_refuse_16_bit_dtypes_clearly():
    with pytest.raises(TypeError, match="dtype must be float32 or float64, got bfloat16"):
        linattn.random_features(8, 4, dtype=ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="dtype must be float32 or float64, got float16"):
        linattn.linformer_projections(2, 8, dtype=np.float16)
    state = linattn.recurrent_state(1, 1, 4, 4)
    x = np.zeros((1, 1, 4), BF16)
    with pytest.raises(TypeError, match="inputs have dtype bfloat16 but the state is float32"):
        state.step(x, x, x)
    with pytest.raises(TypeError, match="projection must have dtype float32 or float64, got bfloat16"):
        linattn.recurrent_state(1, 1, 4, 4, feature_map="favor", projection=np.zeros((8, 4), BF16))


def test_float16_overflow_is_an_error_and_bfloat16_keeps_the_range():
    q = np.zeros((1, 1, 8, 4), np.float16)
    k = v = np.zeros((1, 1, 2, 4), np.float16)
    g = np.full((1, 1, 8, 4), 60000, np.float16)
    with pytest.raises(ValueError, match="dv has a value of magnitude 240000.* rounds to infinity in float16"):
        linattn.softmax_attention_backward(q, k, v, g)
    dv = linattn.softmax_attention_backward(*(x.astype(BF16) for x in (q, k, v, g)))[2]
    assert float(dv.astype(np.float32)[0, 0, 0, 0]) == 4 * 59904.0  # 60000 in bfloat16 is 59904


@pytest.mark.parametrize("dtype", LOW, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_16_bit_input_raises_as_float32_does(dtype, bad):
    q = _rounded((1, 1, 8, 4), dtype, 0)
    q[0, 0, 3, 1] = bad
    with pytest.raises(ValueError) as e16:
        linattn.softmax_attention(q, q.copy(), q.copy())
    with pytest.raises(ValueError) as e32:
        linattn.softmax_attention(*(q.astype(np.float32) for _ in range(3)))
    assert str(e16.value) == str(e32.value)
    # FAVOR+'s bfloat16-product kernels too, forward and backward (and their bad projection).
    w = linattn.random_features(8, 4)
    for call in (lambda q, k, v, w: linattn.favor_attention(q, k, v, w),
                 lambda q, k, v, w: linattn.favor_attention_backward(q, k, v, w, v.copy())):
        for args in ((q, q.copy(), q.copy(), w.astype(dtype)), (q.copy(), q.copy(), q.copy(), w.astype(dtype))):
            if args[0] is not q:
                args[0][:] = 0
                args[3][1, 2] = bad
            with pytest.raises(ValueError) as e16:
                call(*args)
            with pytest.raises(ValueError) as e32:
                call(*(x.astype(np.float32) for x in args))
            assert str(e16.value) == str(e32.value)


def test_hedgehog_float16_overflow_is_an_error_naming_it():
    q = np.zeros((1, 1, 8, 4), np.float16)
    k, v = np.zeros((1, 1, 2, 4), np.float16), np.zeros((1, 1, 2, 4), np.float16)
    hh = [np.zeros(s, np.float16) for s in [(1, 4, 2), (1, 2), (1, 4, 2), (1, 2)]]
    g = np.full((1, 1, 8, 4), 60000, np.float16)
    with pytest.raises(ValueError, match="hedgehog_attention_backward: dv has a value of magnitude 240000"):
        linattn.hedgehog_attention_backward(q, k, v, *hh, g)


def test_a_bfloat16_torch_tensor_in_the_numpy_api_is_a_clear_type_error():
    t = torch.zeros(1, 1, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="softmax_attention: q cannot be read through DLPack.*ml_dtypes.bfloat16"):
        linattn.softmax_attention(t, t, t)


# ---- linattn.torch ------------------------------------------------------------------------------

def _torch_cases(n, d):
    w = torch.from_numpy(linattn.random_features(32, d))
    e, f = (torch.from_numpy(x) for x in linattn.linformer_projections(6, n))
    conv = torch.full((2, 3), 0.1)
    fq, fk = (torch.rand(1, 2, n, 6, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    return {
        "softmax": (lambda q, k, v, *t: lt.softmax_attention(q, k, v, causal=True), []),
        "linear": (lambda q, k, v, c: lt.linear_attention(q, k, v, conv_weight=c, causal=True), [conv]),
        "favor": (lambda q, k, v, w: lt.favor_attention(q, k, v, w), [w]),
        "nystrom": (lambda q, k, v, c: lt.nystrom_attention(q, k, v, num_landmarks=4, conv_weight=c), [conv]),
        "linformer": (lambda q, k, v, e, f: lt.linformer_attention(q, k, v, e, f), [e, f]),
        "efficient": (lambda q, k, v: lt.efficient_attention(q, k, v), []),
        "hybrid": (lambda q, k, v, a, b: lt.hybrid_attention(q, k, v, query_features=a, key_features=b,
                                                             window=5, causal=True, feature_map="given"), [fq, fk]),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["softmax", "linear", "favor", "nystrom", "linformer", "efficient", "hybrid"])
def test_torch_autograd_in_16_bit_is_float32_rounded(method, dtype):
    n, d = 37, 8
    call, extra = _torch_cases(n, d)[method]
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(1, 2, n, d, generator=gen).to(dtype) for _ in range(3)]
    extra = [t.to(dtype) for t in extra]
    G = torch.randn(1, 2, n, d, generator=gen).to(dtype)

    def run(cast):
        leaves = [t.to(cast).detach().requires_grad_() for t in base]
        params = [t.to(cast).detach().requires_grad_(t.dtype.is_floating_point and t.dim() == 2 and method != "favor")
                  for t in extra]
        out = call(*leaves, *params)
        (out.float() * G.float()).sum().backward()
        return out, [t.grad for t in leaves + params if t.requires_grad]

    out, grads = run(dtype)
    out32, grads32 = run(torch.float32)
    assert out.dtype == dtype
    kernelized = method in ("linear", "favor") and dtype == torch.bfloat16 and KERNELIZED_BF16
    if method == "softmax" and dtype == torch.bfloat16 and BF16_PRODUCTS:
        bound = _tiles_bound(out32.detach().double().numpy(), base[2].float().numpy())
        assert ((out - out32).detach().double().abs().numpy() <= bound).all()
    elif kernelized:
        bound = _kernelized_out_bound(out32.detach().double().numpy(), base[2].float().numpy())
        assert ((out - out32).detach().double().abs().numpy() <= bound).all()
    else:
        assert torch.equal(out, out32.to(dtype))
    assert len(grads) == len(grads32)
    # Gradients: one rounding (u), plus, where the backward reads the forward's output (softmax's
    # rowsum(dout·out), FAVOR's), that output's own rounding, which moves them by at most u of
    # their scale: |g16 − g32| ≤ 2u·|g32| + 2u·max|g32|.
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    own = method == "softmax" and dtype == torch.bfloat16 and BF16_BACKWARD
    if own:
        own = _softmax_grad_bound(*(t.float().numpy() for t in base), G.float().numpy(), True,
                                  [t.numpy() for t in grads32])
    for i, (a, b) in enumerate(zip(grads, grads32)):
        assert a.dtype == dtype
        if own:
            bound = torch.from_numpy(own[i]).float()
        elif kernelized:
            bound = torch.from_numpy(_kernelized_grad_bound(b.numpy())).float()
        else:
            bound = 2 * u * b.abs() + 2 * u * b.abs().max()
        assert bool(((a.float() - b).abs() <= bound).all()), (a.float() - b).abs().max()


def test_torch_fake_tensors_and_opcheck_in_bfloat16():
    q, k, v = (torch.randn(1, 2, 20, 8, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.ops.linattn.softmax_attention(q, k, v, None, False, None)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.library.opcheck(torch.ops.linattn.softmax_attention.default, (q.requires_grad_(), k, v, None, False, None))
    compiled = torch.compile(lambda a, b, c: lt.linear_attention(a, b, c, causal=True), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), lt.linear_attention(q, k, v, causal=True), rtol=0, atol=0)


def test_torch_mixed_dtypes_name_both():
    q = torch.randn(1, 1, 8, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k has dtype torch.float32 but q has torch.bfloat16"):
        lt.softmax_attention(q, q.float(), q)
    w = torch.from_numpy(linattn.random_features(8, 4))
    with pytest.raises(TypeError, match="projection has dtype torch.float32 but q has torch.bfloat16"):
        lt.favor_attention(q, q, q, w)


@pytest.mark.parametrize("method,options", [("softmax", {}), ("elu", {}), ("favor", {"num_features": 32}),
                                            ("linformer", {"max_seq_len": 24}), ("nystrom", {"num_landmarks": 4}),
                                            ("hedgehog", {"feature_dim": 4})])
def test_multihead_attention_runs_as_loaded_in_bfloat16(method, options):
    torch.manual_seed(0)
    m = lt.MultiheadAttention(32, 4, method, **options)
    x = torch.randn(2, 24, 32)
    want = m(x, x, x)[0] if isinstance(m(x, x, x), tuple) else m(x, x, x)
    low = lt.MultiheadAttention(32, 4, method, **options, dtype=torch.bfloat16)
    low.load_state_dict(m.state_dict())
    got = low(x.bfloat16(), x.bfloat16(), x.bfloat16())
    got = got[0] if isinstance(got, tuple) else got
    assert got.dtype == torch.bfloat16
    # bfloat16 weights and activations: a few units of 2^-8 relative to the output's scale.
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < 0.05, err
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in low.parameters() if p.requires_grad)


@pytest.mark.parametrize("method,options", [("elu", {"conv_kernel_size": 3}), ("favor", {"num_features": 16}),
                                            ("hedgehog", {"feature_dim": 4, "window": 8})])
def test_multihead_attention_decodes_in_bfloat16_with_a_float32_state(method, options):
    # 600 steps: a state summed in bfloat16 drifts by ~1e-1 (each += loses 2^-9 of a growing
    # sum); summed in float32, decoding stays within a few bfloat16 roundings of the chunked
    # forward, which also accumulates in float32.
    torch.manual_seed(0)
    m = lt.MultiheadAttention(16, 2, method, **options, dtype=torch.bfloat16)
    n = 600
    x = torch.randn(1, n, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        full = m(x, x, x, is_causal=True)
        full = (full[0] if isinstance(full, tuple) else full).float()
        state = m.init_state(1)
        steps = torch.stack([m.step(x[:, t], state) for t in range(n)], 1)
    assert steps.dtype == torch.bfloat16
    if method == "hedgehog":
        assert state.state.dtype == torch.float32 and state.normaliser.dtype == torch.float32
    err = float((steps.float() - full).abs().max() / full.abs().max())
    assert err < 2.0 ** -5, err


def test_precision_study_runs_and_stays_within_its_stated_bounds():
    # bench/precision.py (docs/precision.md) at a small size: every 16-bit output within 8u of
    # float64 relative to its largest value (the page states 4u at n = 1024; twice that leaves room
    # for another draw), float32 within 1e-5.
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "precision.py"
    spec = importlib.util.spec_from_file_location("precision", path)
    precision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(precision)
    rows = precision.measure(n=96, batch=1, heads=2)
    assert len(rows) == 13
    for r in rows:
        assert r["float32 out"] < 1e-5 and r["float32 dv"] < 1e-5, r
        assert r["bfloat16 out"] < 8 * 2.0 ** -8 and r["bfloat16 dv"] < 8 * 2.0 ** -8, r
        assert r["float16 out"] < 8 * 2.0 ** -11 and r["float16 dv"] < 8 * 2.0 ** -11, r
    assert "| softmax |" in precision.table(rows)
