"""linattn.gated_delta_rule (NumPy), linattn.torch.gated_delta_rule (autograd) and
linattn.hf.delta (transformers' Gated DeltaNet and KDA models on linattn).

The kernel is checked against its float64 recurrence and by central differences in C++
(tests/test_delta.cc). Here: the Python layers pass everything through (gradcheck in float64),
the results equal transformers' own reference PyTorch functions (the "fallback" each model runs
without fla), and tiny random Qwen3-Next, Qwen3.5, OLMo-hybrid and Kimi-Linear models give the
same logits and the same greedy tokens on linattn as on transformers' path.

Tolerance against transformers' functions: they compute in float32 whatever the input dtype.
With l2-normalised keys and β in [0, 2] every step is a contraction, so each float32 result is
within n·m·u·Σ of the exact one (tests/test_delta.cc: m = 2·d_k + 168, Σ = ‖S_0‖ + Σ_t β_t‖v_t‖,
u = 2^-24), and two such results within twice that."""

import inspect

import numpy as np
import pytest
import torch

import linattn
import linattn.torch as lt

transformers = pytest.importorskip("transformers")


def unwrapped(module, name):
    """transformers' own reference PyTorch function (under its hub/fla dispatch)."""
    from linattn.hf.delta import ORIGINALS
    return inspect.unwrap(ORIGINALS.get((module.__name__, name), getattr(module, name)))


def qwen3_next():
    import transformers.models.qwen3_next.modeling_qwen3_next as m
    return m


def kimi():
    import transformers.models.kimi_linear.modeling_kimi_linear as m
    return m


def make_inputs(b, t, h, hk, dk, dv, per_channel, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=gen, dtype=dtype)
    k = torch.randn(b, t, hk, dk, generator=gen, dtype=dtype)
    v = torch.randn(b, t, h, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, t, h, *((dk,) if per_channel else ()), generator=gen, dtype=dtype) * 2
    beta = torch.rand(b, t, h, generator=gen, dtype=dtype)
    s0 = torch.randn(b, h, dk, dv, generator=gen, dtype=dtype)
    return q, k, v, g, beta, s0


def bound(v, beta, s0, n, dk):
    sigma = s0.flatten(2).norm(dim=-1) + (beta * v.norm(dim=-1)).sum(1)  # [B, H]
    return 2 * n * (2 * dk + 168) * 2.0 ** -24 * sigma.max().item() * dk ** -0.5


def expect_same_as_transformers(pairs, q, k, v, g, beta, s0):
    """Each (transformers' function, linattn's) of `pairs` on the same inputs: outputs and final
    states within the float32 bound (module docstring), dtypes and shapes as theirs."""
    n, dk = q.shape[1], q.shape[-1]
    tol = bound(v, beta, s0, n, dk)
    for theirs, ours in pairs:
        want, want_state = theirs(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        got, state = ours(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert (got - want).abs().max().item() <= tol
        assert (state - want_state.to(state.dtype)).abs().max().item() <= tol * dk ** 0.5
        none, no_state = ours(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False)
        assert no_state is None and none.shape == want.shape


@pytest.mark.parametrize("t", [1, 63, 64, 130])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_equals_transformers_gated_delta_rule_chunk_and_recurrent(t, heads):
    from linattn.hf.delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
    m = qwen3_next()
    expect_same_as_transformers(((unwrapped(m, "torch_chunk_gated_delta_rule"), chunk_gated_delta_rule),
                                 (unwrapped(m, "torch_recurrent_gated_delta_rule"), recurrent_gated_delta_rule)),
                                *make_inputs(2, t, heads[0], heads[1], 16, 8, False, seed=t))


@pytest.mark.parametrize("t", [1, 65])
def test_equals_transformers_kda(t):
    from linattn.hf.delta import chunk_kda, recurrent_kda
    m = kimi()
    expect_same_as_transformers(((unwrapped(m, "chunk_kimi_delta_attention"), chunk_kda),
                                 (unwrapped(m, "recurrent_kimi_delta_attention"), recurrent_kda)),
                                *make_inputs(1, t, 3, 3, 16, 8, True, seed=10 + t))


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
def test_torch_gradients_pass_central_differences(per_channel, l2norm):
    q, k, v, g, beta, s0 = make_inputs(1, 70, 4, 2, 3, 2, per_channel, seed=3)
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    g = (g.transpose(1, 2) if not per_channel else g.permute(0, 2, 1, 3)).contiguous()
    beta = beta.transpose(1, 2).contiguous()
    if not l2norm:  # unit keys, as the kernel's regime
        k = k / k.norm(dim=-1, keepdim=True)
    args = [x.requires_grad_() for x in (q, k, v, g, beta, s0)]

    def fn(q, k, v, g, beta, s0):
        return lt.gated_delta_rule(q, k, v, g, beta, initial_state=s0, return_state=True, scale=0.6,
                                   use_qk_l2norm_in_kernel=l2norm)

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_numpy_and_torch_agree_and_split_calls_chain():
    q, k, v, g, beta, s0 = make_inputs(2, 150, 4, 2, 8, 5, False, seed=5)
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    g, beta = g.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous()
    out, state = linattn.gated_delta_rule(q.numpy(), k.numpy(), v.numpy(), g.numpy(), beta.numpy(),
                                          initial_state=s0.numpy(), return_state=True, use_qk_l2norm_in_kernel=True)
    tout, tstate = lt.gated_delta_rule(q, k, v, g, beta, initial_state=s0, return_state=True,
                                       use_qk_l2norm_in_kernel=True)
    assert np.array_equal(out, tout.numpy()) and np.array_equal(state, tstate.numpy())
    a, sa = lt.gated_delta_rule(q[:, :, :77], k[:, :, :77], v[:, :, :77], g[:, :, :77], beta[:, :, :77],
                                initial_state=s0, return_state=True, use_qk_l2norm_in_kernel=True)
    b, sb = lt.gated_delta_rule(q[:, :, 77:], k[:, :, 77:], v[:, :, 77:], g[:, :, 77:], beta[:, :, 77:],
                                initial_state=sa, return_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.allclose(torch.cat([a, b], 2), tout, atol=1e-12, rtol=0)
    assert torch.allclose(sb, tstate, atol=1e-12, rtol=0)


def test_bfloat16_is_computed_in_float32_with_a_float32_state():
    q, k, v, g, beta, s0 = make_inputs(1, 40, 2, 2, 8, 4, False, seed=6, dtype=torch.float32)
    q, k, v, g, beta = (x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
    out, state = lt.gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g.bfloat16(), beta.bfloat16(),
                                     initial_state=s0, return_state=True, use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    want = lt.gated_delta_rule(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(),
                               g.bfloat16().float(), beta.bfloat16().float(), initial_state=s0,
                               use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, want.bfloat16())


def test_bad_input_is_an_error_naming_the_argument():
    q, k, v, g, beta, s0 = make_inputs(1, 8, 2, 2, 4, 3, False, seed=7)
    q, k, v, g, beta = (x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
    n = (q.numpy(), k.numpy(), v.numpy(), g.numpy(), beta.numpy())
    with pytest.raises(ValueError, match="g must be <= 0"):
        linattn.gated_delta_rule(*n[:3], -n[3], n[4])
    with pytest.raises(ValueError, match=r"beta must be in \[0, 2\]"):
        linattn.gated_delta_rule(*n[:4], n[4] + 2.5)
    bad = n[2].copy()
    bad[0, 1, 3, 0] = np.nan
    with pytest.raises(ValueError, match="v has a non-finite value"):
        linattn.gated_delta_rule(n[0], n[1], bad, n[3], n[4])
    with pytest.raises(ValueError, match="multiple of q's and k's heads"):
        linattn.gated_delta_rule(n[0], n[1], np.concatenate([n[2], n[2][:, :1]], 1), np.zeros((1, 3, 8)),
                                 np.zeros((1, 3, 8)))
    with pytest.raises(ValueError, match="beta has shape"):
        linattn.gated_delta_rule(*n[:4], n[4][:, :, :5])
    with pytest.raises(TypeError, match="g has dtype"):
        lt.gated_delta_rule(q, k, v, g.float(), beta)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        lt.gated_delta_rule(q, k, v, g.numpy(), beta)
    from linattn.hf.delta import chunk_gated_delta_rule
    with pytest.raises(ValueError, match="cu_seqlens is not supported"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 8]))


TINY = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                        linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=100, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                     linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=100)),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM",
                    dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, linear_num_value_heads=4, linear_num_key_heads=2,
                         linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=100, pad_token_id=0,
                         eos_token_id=1)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=16, linear_num_heads=4,
                         layer_types=["linear_attention"] * 3 + ["full_attention"],
                         vocab_size=100, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)),
}


@pytest.mark.parametrize("folder", sorted(TINY))
def test_tiny_models_give_transformers_logits_and_tokens(folder, monkeypatch):
    import importlib
    import linattn.hf
    import linattn.hf.delta as delta
    config_name, model_name, kwargs = TINY[folder]
    module = importlib.import_module("transformers.models.%s.modeling_%s" % (folder, folder))
    names = delta.replaced_names(module)
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kwargs)
    model = getattr(transformers, model_name)(config).eval()
    assert any(t == "linear_attention" for t in getattr(config, "layer_types", ["linear_attention"]))
    ids = torch.randint(3, 100, (2, 150))
    prompt = ids[:1, :20]
    for theirs in names:  # transformers' own reference PyTorch path
        monkeypatch.setattr(module, theirs, unwrapped(module, theirs))

    def run():
        model.eval()
        with torch.no_grad():
            logits = model(ids).logits
        tokens = model.generate(prompt, max_new_tokens=12, do_sample=False)
        model.train()
        model.zero_grad()
        model(ids[:, :70], labels=ids[:, :70]).loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return logits, tokens, grads

    want, want_tokens, want_grads = run()
    linattn.hf.register()
    for theirs, ours in names.items():
        assert getattr(module, theirs) is getattr(delta, ours)
    got, got_tokens, got_grads = run()
    # float32 models: both paths round the same sums in float32, in another order (differences
    # ~1e-7 relative); a wrong term would differ at O(1)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert torch.equal(got_tokens, want_tokens)
    assert got_grads.keys() == want_grads.keys()
    linear = [name for name in want_grads if "linear_attn" in name or "A_log" in name or "dt_bias" in name]
    assert linear  # the delta-rule layers' own parameters get gradients through linattn
    # A gradient that is a sum of cancelling terms (dt_bias) is off by the rounding of its terms,
    # of the model's gradient scale: 1e-3 of its own size plus 1e-5 of the largest gradient.
    scale = max(grad.abs().max().item() for grad in want_grads.values())
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).abs().max().item() <= 1e-3 * grad.abs().max().item() + 1e-5 * scale, name


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv1d_equals_transformers_functions(width, activation):
    # transformers' fallbacks compute in the weight's dtype: float64 here, so both are float64
    # sums of W + 1 terms: within (W + 9)·u·Σ|terms| ~ 1e-15; 1e-12 of the largest value.
    from linattn.hf.delta import causal_conv1d_fn, causal_conv1d_update
    m = qwen3_next()
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(2, 6, 11, generator=gen, dtype=torch.float64)
    w = torch.randn(6, width, generator=gen, dtype=torch.float64)
    b = torch.randn(6, generator=gen, dtype=torch.float64)
    want = unwrapped(m, "causal_conv1d_fn")(x, w, b, activation=activation)
    got = causal_conv1d_fn(x, w, b, activation=activation)
    assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item()
    # decoding: one position at a time against the cache's conv state (W positions, as the models keep)
    state_theirs = torch.randn(2, 6, max(width, 1), generator=gen, dtype=torch.float64)
    state_ours = state_theirs.clone()
    for t in range(3):
        step = x[:, :, t:t + 1]
        want = unwrapped(m, "causal_conv1d_update")(step, state_theirs, w, b, activation)
        got = causal_conv1d_update(step, state_ours, w, b, activation)
        assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item()
        assert torch.equal(state_ours, state_theirs)


def test_causal_conv1d_gradients_and_split_calls():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    s0 = torch.randn(2, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: lt.causal_conv1d(a[0], a[1], a[2], initial_state=a[3],
                                                                return_state=True), (x, w, b, s0))
    with torch.no_grad():
        whole, state = lt.causal_conv1d(x, w, b, initial_state=s0, return_state=True)
        a, sa = lt.causal_conv1d(x[:, :, :2], w, b, initial_state=s0, return_state=True)
        c, sc = lt.causal_conv1d(x[:, :, 2:], w, b, initial_state=sa, return_state=True)
    assert torch.equal(torch.cat([a, c], 2), whole) and torch.equal(sc, state)
    out = linattn.causal_conv1d(x.detach().numpy(), w.detach().numpy(), b.detach().numpy(),
                                initial_state=s0.detach().numpy())
    assert np.array_equal(out, whole.numpy())


def test_causal_conv1d_bad_input_is_an_error():
    x, w = np.zeros((1, 3, 5)), np.zeros((3, 4))
    with pytest.raises(ValueError, match="activation must be None"):
        linattn.causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="weight has shape"):
        linattn.causal_conv1d(x, np.zeros((2, 4)))
    bad = x.copy()
    bad[0, 1, 2] = np.inf
    with pytest.raises(ValueError, match="x has a non-finite value"):
        linattn.causal_conv1d(bad, w)
    from linattn.hf.delta import causal_conv1d_update
    state = torch.ones(1, 3, 4)
    with pytest.raises(ValueError, match="activation must be None"):
        causal_conv1d_update(torch.zeros(1, 3, 1), state, torch.zeros(3, 4), activation="gelu")
    assert torch.equal(state, torch.ones(1, 3, 4))  # the cache's state untouched
    with pytest.raises(ValueError, match="conv_state holds 2 positions"):
        causal_conv1d_update(torch.zeros(1, 3, 1), torch.zeros(1, 3, 2), torch.zeros(3, 4))
    with pytest.raises(TypeError, match="weight has dtype"):
        lt.causal_conv1d(torch.zeros(1, 3, 5), torch.zeros(3, 4, dtype=torch.float64))


def test_register_patches_modules_imported_later_and_imports_none():
    # A fresh interpreter: register() first, then the model's module; register() itself imports
    # no modeling module (it costs seconds), the import hook patches it as it loads.
    import subprocess
    import sys
    code = ("import sys, linattn.hf, linattn.hf.delta as d; linattn.hf.register(); "
            "assert not any(n.startswith('transformers.models.qwen3_5.') for n in sys.modules); "
            "import transformers.models.qwen3_5.modeling_qwen3_5 as m; "
            "assert m.torch_chunk_gated_delta_rule is d.chunk_gated_delta_rule; "
            "assert m.causal_conv1d_update is d.causal_conv1d_update; "
            "assert ('transformers.models.qwen3_5.modeling_qwen3_5', 'torch_chunk_gated_delta_rule') in d.ORIGINALS; "
            "import inspect; assert 'def torch_chunk_gated_delta_rule' in inspect.getsource(m); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
