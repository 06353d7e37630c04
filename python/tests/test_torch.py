"""linattn.torch: the functional operators against the NumPy API, gradcheck in float64 for every
method (causal and not, with key_lengths, parameter gradients), errors, torch.compile, and
MultiheadAttention (torch's weights, masks, decoding, saving, feature redraws)."""
import numpy as np
import pytest
import torch

import linattn
import linattn.torch as lt

B, H, N, D = 2, 2, 8, 4


def inputs(seed, dtype=torch.float64, n=N, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def method_cases():
    """(method name, extra tensors maker, options) for every registered method."""
    def favor(dtype):
        return {"projection": torch.from_numpy(linattn.random_features(6, D, seed=1, dtype=np.float64)).to(dtype)}

    def linformer(dtype):
        e, f = linattn.linformer_projections(3, N, seed=2, dtype=np.float64)
        return {"e": torch.from_numpy(e).to(dtype), "f": torch.from_numpy(f).to(dtype)}

    def dwc(dtype):
        return {"conv_weight": torch.linspace(-0.5, 0.7, H * 3, dtype=dtype).reshape(H, 3)}

    def conv(dtype):
        return {"conv_weight": torch.linspace(-0.5, 0.7, H * 3, dtype=dtype).reshape(H, 3)}

    none = lambda dtype: {}  # noqa: E731
    return [("softmax", none, {}), ("linear", none, {"feature_map": "elu"}),
            ("linear", dwc, {"feature_map": "focused"}), ("linear", none, {"feature_map": "relu"}),
            ("favor", favor, {"kernel": "positive"}), ("favor", favor, {"kernel": "hyperbolic"}),
            ("nystrom", conv, {"num_landmarks": 4}), ("linformer", linformer, {}), ("efficient", none, {})]


def causal_ok(name):
    return name in ("softmax", "linear", "favor")


CASES = [(name, make, opts, causal) for name, make, opts in method_cases() for causal in (False, True)
         if not causal or causal_ok(name)]
IDS = ["%s-%s%s" % (c[0], "-".join(str(v) for v in c[2].values()), "-causal" if c[3] else "") for c in CASES]


@pytest.mark.parametrize("name,make,opts,causal", CASES, ids=IDS)
def test_forward_equals_numpy_and_gradcheck(name, make, opts, causal):
    fn = getattr(lt, name + "_attention")
    q, k, v = inputs(1, requires_grad=True)
    extra = make(torch.float64)
    lengths = [N, 5]
    got = fn(q, k, v, **extra, causal=causal, key_lengths=lengths, **opts)
    want = getattr(linattn, name + "_attention")(*(t.detach().numpy() for t in (q, k, v)),
                                                 **{n: t.numpy() for n, t in extra.items()},
                                                 causal=causal, key_lengths=lengths, **opts)
    np.testing.assert_array_equal(got.detach().numpy(), want)
    trainable = {n: t.clone().requires_grad_(True) for n, t in extra.items() if n != "projection"}
    fixed = {n: t for n, t in extra.items() if n == "projection"}
    names = list(trainable)

    def f(q, k, v, *params):
        return fn(q, k, v, **fixed, **dict(zip(names, params)), causal=causal,
                  key_lengths=torch.tensor(lengths), **opts)

    assert torch.autograd.gradcheck(f, (q, k, v, *trainable.values()), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_backward_operator_with_and_without_saved_tensors():
    q, k, v = inputs(2, dtype=torch.float32, n=130)
    w = torch.from_numpy(linattn.random_features(16, D, seed=3))
    out, den, state = torch.ops.linattn.favor_attention(q, k, v, w, None, "positive", True, None)
    dout = torch.randn_like(out)
    with_saved = torch.ops.linattn.favor_attention_backward(q, k, v, w, None, dout, out, den, state,
                                                            "positive", True, None)
    without = torch.ops.linattn.favor_attention_backward(q, k, v, w, None, dout, None, None, None,
                                                         "positive", True, None)
    for a, b in zip(with_saved, without):
        assert torch.equal(a, b)


def test_gradients_equal_the_numpy_backward_in_float32():
    q, k, v = inputs(4, dtype=torch.float32, n=70, requires_grad=True)
    out = lt.linear_attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = linattn.linear_attention_backward(*(t.detach().numpy() for t in (q, k, v)), dout.numpy(), causal=True)
    for t, w in zip((q, k, v), want):
        np.testing.assert_array_equal(t.grad.numpy(), w)


def test_loops_run_on_torchs_openmp_team_with_the_same_bits():
    """linattn.torch shares torch's OpenMP runtime (linattn.share_openmp_runtime), so that
    torch's spinning idle workers take linattn's tasks instead of its own helpers' cores; the
    results are the same bits on either pool, at thread counts below and above batch·heads
    (= 4), for every method, forward and backward."""
    assert "parallel backend: OpenMP" in torch.__config__.parallel_info()  # the pinned torch's
    pool = linattn.thread_pool()
    assert pool.startswith("openmp ") and "gomp" in pool, pool
    saved = linattn.get_num_threads()
    try:
        for name, make, opts, causal in CASES:
            fn = getattr(lt, name + "_attention")
            extra = make(torch.float32)
            results = []
            for own in (True, False):
                if own:
                    linattn.use_own_threads()
                else:
                    linattn.share_openmp_runtime()
                for threads in (1, 3, 8):
                    linattn.set_num_threads(threads)
                    q, k, v = inputs(5, dtype=torch.float32, requires_grad=True)
                    out = fn(q, k, v, **extra, causal=causal, key_lengths=[N, 5], **opts)
                    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
                    results.append((linattn.thread_pool(), threads, [out.detach(), q.grad, k.grad, v.grad]))
            assert results[0][0] == "own" and results[-1][0] == pool
            for where, threads, got in results[1:]:
                for a, b in zip(got, results[0][2]):
                    assert torch.equal(a, b), (name, opts, causal, where, threads)
    finally:
        linattn.share_openmp_runtime()
        linattn.set_num_threads(saved)


def test_own_threads_can_be_kept():
    """LINATTN_OWN_THREADS=1 keeps linattn's own helper threads under linattn.torch; 0 or unset
    shares torch's; another value is refused at import."""
    import os
    import subprocess
    import sys
    code = "import linattn.torch, linattn; print(linattn.thread_pool())"
    for env, want in (({"LINATTN_OWN_THREADS": "1"}, "own"), ({"LINATTN_OWN_THREADS": "0"}, "openmp"), ({}, "openmp"),
                      ({"LINATTN_OWN_THREADS": "yes"}, None)):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**{k: v for k, v in os.environ.items() if k != "LINATTN_OWN_THREADS"}, **env})
        if want is None:
            assert r.returncode != 0 and "LINATTN_OWN_THREADS must be 1" in r.stderr and "'yes'" in r.stderr, r.stderr
            continue
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[0] == want, r.stdout


def test_thread_count_follows_torchs_unless_set():
    """Under linattn.torch, with LINATTN_NUM_THREADS unset and no linattn.set_num_threads, linattn
    uses torch's thread count and follows torch.set_num_threads; linattn.set_num_threads and
    LINATTN_NUM_THREADS win over it; with linattn's own threads the default is every core."""
    import os
    import subprocess
    import sys
    code = ("import torch, linattn, linattn.torch\n"
            "a = linattn.get_num_threads(), torch.get_num_threads()\n"
            "torch.set_num_threads(1); b = linattn.get_num_threads()\n"
            "linattn.set_num_threads(3); torch.set_num_threads(2); c = linattn.get_num_threads()\n"
            "print(a[0], a[1], b, c)")
    base = {k: v for k, v in os.environ.items() if k not in ("LINATTN_NUM_THREADS", "LINATTN_OWN_THREADS",
                                                              "OMP_NUM_THREADS")}
    for env in ({"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "2", "LINATTN_NUM_THREADS": "5"},
                {"OMP_NUM_THREADS": "2", "LINATTN_OWN_THREADS": "1"}):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**base, **env})
        assert r.returncode == 0, r.stderr
        mine, torchs, after_torch_1, after_set = (int(x) for x in r.stdout.split())
        assert torchs == 2 and after_set == 3, r.stdout
        if "LINATTN_NUM_THREADS" in env:
            assert mine == after_torch_1 == 5, r.stdout
        elif "LINATTN_OWN_THREADS" in env:
            assert mine == after_torch_1 == os.cpu_count(), r.stdout
        else:
            assert mine == 2 and after_torch_1 == 1, r.stdout


def test_errors():
    q, k, v = inputs(5, dtype=torch.float32)
    w = torch.from_numpy(linattn.random_features(8, D))
    with pytest.raises(TypeError, match="favor_attention: q must have dtype torch.float32, torch.float64, "
                                        "torch.bfloat16 or torch.float16, got torch.int32"):
        lt.favor_attention(q.int(), k, v, w)
    with pytest.raises(TypeError, match="favor_attention: k has dtype torch.float32 but q has torch.float16"):
        lt.favor_attention(q.half(), k, v, w)
    with pytest.raises(TypeError, match="softmax_attention: k must be a torch.Tensor, got ndarray"):
        lt.softmax_attention(q, k.numpy(), v)
    with pytest.raises(ValueError, match="projection has requires_grad=True, but it is a constant"):
        lt.favor_attention(q, k, v, w.clone().requires_grad_(True))
    with pytest.raises(TypeError, match="softmax_attention: causal must be True or False"):
        lt.softmax_attention(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="key_lengths must hold integers"):
        lt.softmax_attention(q, k, v, key_lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="causal=true is not supported"):
        lt.efficient_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="kernel"):
        lt.favor_attention(q, k, v, w, kernel="nope")
    with pytest.raises(ValueError, match="key_lengths"):
        lt.softmax_attention(q, k, v, key_lengths=[1, 99])
    with pytest.raises(TypeError):
        lt.softmax_attention(q, k, v, no_such_option=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_refused():
    q, k, v = (t.cuda() for t in inputs(6, dtype=torch.float32))
    with pytest.raises(TypeError, match="CPU only"):
        lt.softmax_attention(q, k, v)


def test_non_contiguous_inputs_are_made_contiguous():
    q, k, v = inputs(7, dtype=torch.float32)
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)
    assert not qt.is_contiguous()
    assert torch.equal(lt.linear_attention(qt, k, v), lt.linear_attention(q, k, v))


def test_numpy_api_takes_cpu_tensors_through_dlpack():
    q, k, v = inputs(8, dtype=torch.float32)
    np.testing.assert_array_equal(linattn.softmax_attention(q, k, v),
                                  linattn.softmax_attention(q.numpy(), k.numpy(), v.numpy()))
    with pytest.raises(TypeError, match="softmax_attention: q requires grad; pass q.detach"):
        linattn.softmax_attention(q.requires_grad_(True), k, v)


class TinyModel(torch.nn.Module):
    def __init__(self, method, **opts):
        super().__init__()
        torch.manual_seed(0)
        self.attn = lt.MultiheadAttention(16, 2, method, **opts)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.attn(x, is_causal=True)) + x)


@pytest.mark.parametrize("method", ["softmax", "favor", "elu"])
def test_torch_compile_fullgraph_gives_the_eager_result(method):
    model = TinyModel(method)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1))
    eager = model(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


# ---- MultiheadAttention --------------------------------------------------------------------

def test_from_torch_softmax_equals_torch_multihead_attention():
    torch.manual_seed(3)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    ours = lt.MultiheadAttention.from_torch(ref)
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[1, 7:] = True
    mask[2, 4:] = True
    want, _ = ref(x, x, x, key_padding_mask=mask, need_weights=False)
    torch.testing.assert_close(ours(x, key_padding_mask=mask), want, rtol=1e-12, atol=1e-12)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(10, dtype=torch.float64)
    want, _ = ref(x, x, x, attn_mask=causal, need_weights=False, is_causal=True)
    torch.testing.assert_close(ours(x, is_causal=True), want, rtol=1e-12, atol=1e-12)
    assert set(ours.state_dict()) >= {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    with pytest.raises(ValueError, match="suffix"):
        bad = torch.zeros(3, 10, dtype=torch.bool)
        bad[0, 0] = True
        ours(x, key_padding_mask=bad)


@pytest.mark.parametrize("method,opts", [("elu", {}), ("focused", {"conv_kernel_size": 3}),
                                         ("favor", {"num_features": 32}), ("relu", {})])
def test_step_by_step_decoding_equals_the_causal_forward(method, opts):
    torch.manual_seed(4)
    m = lt.MultiheadAttention(16, 2, method, dtype=torch.float64, **opts).eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        want = m(x, is_causal=True)
    state = m.init_state(2)
    rows = []
    for t in range(9):
        if t == 5:
            branch = state.copy()
        rows.append(m.step(x[:, t], state))
    torch.testing.assert_close(torch.stack(rows, 1), want, rtol=1e-10, atol=1e-12)
    assert state.tokens == 9 and branch.tokens == 5
    # The branch taken at t = 5 decodes on independently.
    torch.testing.assert_close(m.step(x[:, 5], branch), rows[5], rtol=1e-12, atol=1e-12)


def test_favor_projection_is_saved_and_redrawn_reproducibly():
    a = lt.MultiheadAttention(16, 2, "favor", num_features=8, seed=1, feature_redraw_interval=2)
    b = lt.MultiheadAttention(16, 2, "favor", num_features=8, seed=7)
    x = torch.randn(1, 5, 16)
    first = a.projection.clone()
    a.train()
    a(x)
    assert torch.equal(a.projection, first)
    a(x)
    assert not torch.equal(a.projection, first) and int(a.redraws) == 1
    a.eval()
    for _ in range(3):
        a(x)
    assert int(a.redraws) == 1
    b.load_state_dict(a.state_dict())
    b.eval()
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)
    c = lt.MultiheadAttention(16, 2, "favor", num_features=8, seed=1)
    c.redraw_features()
    assert torch.equal(c.projection, a.projection)


def test_module_errors():
    with pytest.raises(ValueError, match="not divisible"):
        lt.MultiheadAttention(10, 3)
    with pytest.raises(TypeError, match="takes no option 'num_landmarks'"):
        lt.MultiheadAttention(8, 2, "elu", num_landmarks=4)
    with pytest.raises(ValueError, match="recurrent decoding is for the kernelized methods"):
        lt.MultiheadAttention(8, 2, "softmax").init_state(1)
    with pytest.raises(ValueError, match="needs max_seq_len"):
        lt.MultiheadAttention(8, 2, "linformer")
    m = lt.MultiheadAttention(8, 2, "linformer", max_seq_len=12, s_proj=4)
    out = m(torch.randn(2, 12, 8))
    out.sum().backward()
    assert m.e.grad is not None and m.f.grad is not None


def test_multihead_favor_features_kind():
    # features= picks linattn.random_features' kind; a bad kind or a non-favor method is an error.
    for kind in ("orthogonal", "iid", "orthogonal_fixed", "quantile"):
        m = lt.MultiheadAttention(16, 2, "favor", num_features=8, seed=3, features=kind)
        want = linattn.random_features(8, 8, kind, 3)
        assert np.array_equal(m.projection.numpy(), want), kind
    with pytest.raises(ValueError, match="features must be one of"):
        lt.MultiheadAttention(16, 2, "favor", features="gaussian")
    with pytest.raises(TypeError, match="features is an option of method 'favor' only"):
        lt.MultiheadAttention(16, 2, "elu", features="quantile")
