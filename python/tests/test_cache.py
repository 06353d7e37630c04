"""linattn.hf.LinattnCache: constant-memory generation on the kernelized and hybrid backends.
Each decoded token's logits equal those of a full causal forward over the whole sequence to
float32 rounding, greedy generate() equals a full forward re-run at every step, the size does
not grow, beam search reorders it, and what the cache cannot serve raises ValueError."""

import math
import zlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
import linattn.hf as lh  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, pad_token_id=0)
CASES = [("linattn_elu", {}), ("linattn_elu", {"window": 5}), ("linattn_relu", {}), ("linattn_relu", {"window": 3}),
         ("linattn_focused", {"conv_kernel_size": 3}), ("linattn_focused", {"focus_power": 40.0, "eps": 1e-3}), ("linattn_favor", {}), ("linattn_favor", {"kernel": "hyperbolic"}),
         ("linattn_favor", {"kernel": "trig"}), ("linattn_favor", {"window": 5}),
         ("linattn_favor", {"window": 4, "kernel": "hyperbolic"}), ("linattn_hedgehog", {"feature_dim": 4}),
         ("linattn_hedgehog", {"feature_dim": 4, "window": 5}), ("linattn_window", {"window": 4}),
         # attention sinks: the first tokens stay exact once they leave the window
         ("linattn_elu", {"window": 5, "sinks": 3}), ("linattn_favor", {"window": 4, "sinks": 2}),
         ("linattn_hedgehog", {"feature_dim": 4, "window": 3, "sinks": 4}), ("linattn_window", {"window": 4, "sinks": 3}),
         # the linear part decayed: RetNet's per-head decays, or one log-decay for all heads
         ("linattn_elu", {"window": 3, "sinks": 2, "decay": "retnet"}), ("linattn_favor", {"window": 4, "decay": -0.3}),
         ("linattn_hedgehog", {"feature_dim": 4, "window": 3, "decay": -0.1})]
# float32 logits of a 2-layer model: each path rounds differently (C++ kernels against torch
# ops), a few ulps of every term; 2^-14 of the largest logit is ~100× that and far below a
# wrong state's error (a token missing from the state moves logits by ~1e-2 relative).
TOL = 2.0 ** -14


def model_on(name, options, seed=0):
    lh.register()
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, attn_implementation="sdpa")).eval()
    model.set_attn_implementation(name)
    lh.set_options(model, **options)
    with torch.no_grad():  # learned tensors away from their neutral start (gate 0, convolution 0)
        for n, p in model.named_parameters():
            if n.split(".")[-1].startswith("linattn_") or ".linattn_" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())))
    return model


def ids_of(batch, n, seed=1):
    return torch.randint(1, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,options", CASES)
def test_decoded_logits_equal_the_full_forward(name, options):
    model = model_on(name, options)
    ids = ids_of(2, 24)
    with torch.no_grad():
        full = model(ids).logits
        cache = lh.LinattnCache(model)
        pieces = [model(ids[:, :9], past_key_values=cache, use_cache=True).logits]
        pieces.append(model(ids[:, 9:12], past_key_values=cache, use_cache=True).logits)  # a chunk after the prompt
        for t in range(12, 24):
            pieces.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    got = torch.cat(pieces, dim=1)
    assert (got - full).abs().max() <= TOL * full.abs().max()
    assert cache.get_seq_length() == 24


@pytest.mark.parametrize("name,options", CASES)
def test_greedy_generate_uses_the_cache_and_equals_a_full_rerun(name, options):
    model = model_on(name, options)
    prompt = ids_of(2, 10)
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, lh.LinattnCache)  # no argument needed
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, seq)
    explicit = model.generate(prompt, max_new_tokens=8, do_sample=False, past_key_values=lh.LinattnCache(model))
    assert torch.equal(explicit, seq)


@pytest.mark.parametrize("name,options", [("linattn_elu", {"window": 5}), ("linattn_favor", {"window": 4}),
                                          ("linattn_hedgehog", {"feature_dim": 4})])
def test_size_does_not_grow_with_the_context(name, options):
    model = model_on(name, options)
    sizes = []
    for n in (16, 64, 256):
        out = model.generate(ids_of(1, n), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        sizes.append(out.past_key_values.nbytes)
        layer = out.past_key_values.layers[0]
        assert layer.tokens == n + 3  # the last new token is sampled, not fed back
        if options.get("window"):  # the exact slots per key/value head, as the model's own cache keeps them
            assert layer.exact_keys.shape == (1, CONFIG["num_key_value_heads"], options["window"], 16)
            assert layer.exact_values.shape == layer.exact_keys.shape
    assert sizes[0] == sizes[1] == sizes[2] > 0


@pytest.mark.parametrize("name,options", [("linattn_elu", {"window": 3}), ("linattn_favor", {"window": 4}),
                                          ("linattn_hedgehog", {"feature_dim": 4})])
def test_beam_search_equals_the_full_recompute(name, options):
    # The same beams with transformers' DynamicCache, on which linattn recomputes attention
    # over every cached key at each step: reorder_cache moves the states with their beams.
    model = model_on(name, options)
    prompt = ids_of(2, 7)
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)
    ours = model.generate(prompt, **kw, return_dict_in_generate=True)
    assert isinstance(ours.past_key_values, lh.LinattnCache)
    theirs = model.generate(prompt, **kw, past_key_values=transformers.DynamicCache(config=model.config))
    assert torch.equal(ours.sequences, theirs)


def test_reorder_and_select_move_every_state_with_its_row():
    model = model_on("linattn_favor", {"window": 3})
    ids = ids_of(3, 12)
    with torch.no_grad():
        cache = lh.LinattnCache(model)
        model(ids[:, :11], past_key_values=cache, use_cache=True)
        order = torch.tensor([2, 0, 2])
        cache.reorder_cache(order)
        got = model(ids[order, 11:], past_key_values=cache, use_cache=True).logits
        want = model(ids[order]).logits[:, -1:]
        assert (got - want).abs().max() <= TOL * want.abs().max()
        cache.batch_select_indices(torch.tensor([1]))  # row 1 of the reordered batch: sequence 0
        cache.batch_repeat_interleave(2)
        more = torch.tensor([[5], [7]])
        got = model(more, past_key_values=cache, use_cache=True).logits
        want = model(torch.cat([ids[[0, 0]], more], dim=1)).logits[:, -1:]
    assert cache.layers[1].linear.sums.shape[0] == 2
    assert (got - want).abs().max() <= TOL * want.abs().max()


def test_what_the_cache_cannot_serve_raises():
    model = model_on("linattn_elu", {"window": 3})
    prompt = ids_of(2, 8)
    band = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril() & torch.ones(8, 8, dtype=torch.bool).triu(-2)
    with torch.no_grad(), pytest.raises(ValueError, match="not a causal padding mask"):
        model(prompt, attention_mask=band, past_key_values=lh.LinattnCache(model), use_cache=True)
    cache = lh.LinattnCache(model)
    for count in (1, -1):  # transformers passes negative counts
        with pytest.raises(ValueError, match="recurrent state cannot forget"):
            cache.crop(count)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="holds 2 sequences, the model gave 1"):
            model(prompt[:1, :1], past_key_values=cache, use_cache=True)
    sdpa = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, attn_implementation="sdpa")).eval()
    with pytest.raises(ValueError, match="LinattnCache: the model runs attention implementation 'sdpa'"):
        lh.LinattnCache(sdpa)
    for other in ("linattn_softmax", "linattn_nystrom"):
        sdpa.set_attn_implementation(other)
        with pytest.raises(ValueError, match="implementation '%s'" % other):
            lh.LinattnCache(sdpa)
    cache = lh.LinattnCache(model)
    model.set_attn_implementation("sdpa")  # switched after the cache was made
    with pytest.raises(ValueError, match="now runs attention implementation 'sdpa'"):
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)


def test_a_forward_that_failed_midway_leaves_nothing_behind():
    # A note left by a forward interrupted between update and attention (here: set by hand)
    # does not affect the next generate(); a layer whose attention never ran raises.
    model = model_on("linattn_elu", {"window": 3})
    prompt = ids_of(1, 6)
    want = model.generate(prompt, max_new_tokens=3, do_sample=False)
    other = lh.LinattnCache(model)
    lh.backends.PENDING_CACHE.note = (other.layers[1], torch.zeros(1))
    assert torch.equal(model.generate(prompt, max_new_tokens=3, do_sample=False), want)
    cache = lh.LinattnCache(model)
    cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)
    with pytest.raises(ValueError, match="layer 0's keys never reached linattn's attention function"):
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 1)
    assert lh.backends.PENDING_CACHE.note is None


def test_a_one_token_prompt_and_a_large_focus_power():
    # A single-token prompt runs the causal kernel (a causal convolution sees only the past);
    # focus_power 200 stays finite in the torch map as in the C++ one.
    for options in ({"conv_kernel_size": 4}, {"focus_power": 200.0}):
        model = model_on("linattn_focused", options)
        prompt = ids_of(1, 1)
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        with torch.no_grad():
            full = model(out.sequences).logits[:, :-1]
        got = torch.stack(out.logits, dim=1)
        assert (got - full[:, -6:]).abs().max() <= TOL * full.abs().max()


def test_inconsistent_use_raises():
    model = model_on("linattn_hedgehog", {"feature_dim": 4, "window": 2})
    prompt = ids_of(1, 5)
    cache = lh.LinattnCache(model)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="decoding step with autograd on"):
        model(prompt[:, :1], past_key_values=cache, use_cache=True)
    layer = model.model.layers[1]
    handle = layer.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("interrupted")))
    with torch.no_grad(), pytest.raises(RuntimeError, match="interrupted"):
        model(prompt[:, :1], past_key_values=cache, use_cache=True)  # layer 0 took the token, layer 1 did not
    handle.remove()
    with torch.no_grad(), pytest.raises(ValueError, match=r"hold different numbers of tokens \(\[6, 5\]\)"):
        model(prompt[:, :1], past_key_values=cache, use_cache=True)


def test_rollback_decoding_keeps_dynamic_cache():
    # Prompt-lookup (assisted) decoding rolls draft tokens back, which a recurrent state cannot:
    # generate() gives it transformers' DynamicCache, and the greedy tokens stay the same.
    model = model_on("linattn_elu", {"window": 3})
    prompt = ids_of(1, 12).repeat(1, 2)
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=3,
                         return_dict_in_generate=True)
    assert isinstance(out.past_key_values, transformers.DynamicCache)
    assert torch.equal(out.sequences, greedy)


def test_other_backends_keep_transformers_cache():
    model = model_on("linattn_softmax", {})
    out = model.generate(ids_of(1, 6), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, transformers.DynamicCache)
    model = model_on("linattn_elu", {})
    out = model.generate(ids_of(1, 6), max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                         past_key_values=transformers.DynamicCache(config=model.config))
    assert isinstance(out.past_key_values, transformers.DynamicCache)  # a cache the caller gives is used


@pytest.mark.parametrize("kernel,window,sinks", [("positive", 3, 1), ("hyperbolic", 0, 0), ("positive", 0, 0)])
def test_favor_decoding_far_beyond_exp_range_equals_the_forward(kernel, window, sinks):
    """FAVOR's state in log form (per-feature shifts, as the C++ forward keeps them): keys and
    queries of norm ~60 (logits of ±10^3, where e^L overflows float64) prefilled and stepped
    give hybrid_attention's causal rows in float64, finite. Tolerance: each path rounds each
    logit (a (d + 2)-term sum of size L_max = max Σ|ω·x̃| + ‖x̃‖²/2) within (d + 2)·2^-53·L_max,
    so every weight e^{L_q + L_k − R} within 4(d + 2)·2^-53·L_max relatively (both sides, both
    paths), and the outputs, weighted means of v, within twice that times max|v|."""
    import numpy as np
    import linattn
    from linattn import _linattn
    B, H, n, d, m, prompt = 2, 3, 12, 4, 5, 7
    rng = np.random.default_rng(4)
    q, k = (60 * rng.standard_normal((B, H, n, d)) for _ in range(2))
    v = rng.standard_normal((B, H, n, d))
    omega = _linattn.random_features(m, d, seed=3, dtype=np.float64)
    features = m * (1 if kernel == "positive" else 2)
    want = linattn.hybrid_attention(q, k, v, window=window, sinks=sinks, projection=omega, feature_map="favor",
                                    kernel=kernel, causal=True, scale=0.5, eps=0.0)
    state = dict(sums=np.zeros((B, H, features, d)), normaliser=np.zeros((B, H, features)),
                 exact_keys=np.zeros((B, H, sinks + window, d)), exact_values=np.zeros((B, H, sinks + window, d)),
                 exact_valid=np.zeros((B, sinks + window), bool), counts=np.zeros(B, np.int64),
                 shift=np.zeros((B, H, features)))
    favor = dict(feature_map="favor", projection=omega, kernel=kernel)
    scaled = [np.sqrt(0.5) * x for x in (q, k)]  # x̃
    l_max = max(float((np.abs(x) @ np.abs(omega).T).max() + (x * x).sum(-1).max() / 2) for x in scaled)
    tol = 2 * 4 * (d + 2) * 2.0 ** -53 * l_max * np.abs(v).max()
    _linattn.hybrid_prefill(k[:, :, :prompt], v[:, :, :prompt], None, None, None, **state, window=window, sinks=sinks,
                            scale=0.5, **favor)
    assert np.isfinite(state["shift"]).all() and np.abs(state["shift"]).max() > 700  # beyond exp's range
    for t in range(prompt, n):
        got = _linattn.hybrid_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], None, None, advance=np.ones(B, bool),
                                          window_weight=np.ones(H), log_decay=None, **state, window=window, sinks=sinks,
                                          scale=0.5, eps=0.0, **favor)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want[:, :, t], rtol=0, atol=tol)


@pytest.mark.parametrize("name,options", [("linattn_elu", {}), ("linattn_hedgehog", {"feature_dim": 4, "window": 3, "sinks": 1})])
def test_a_state_made_in_float32_continues_in_float64(name, options):
    """A prompt run in float32, then the model moved to float64: the C++ step continues the
    state in float64 (a copy of the float32 one), and the next tokens' logits equal the float64
    model's full forward to the float32 prompt's rounding (2^-14 of the largest logit, TOL)."""
    model = model_on(name, options)
    ids = ids_of(2, 14)
    with torch.no_grad():
        cache = lh.LinattnCache(model)
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        model.double()
        full = model(ids).logits[:, 8:]
        got = torch.cat([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(8, 14)],
                        dim=1)
    assert got.dtype == torch.float64
    assert all(layer.linear.sums.dtype == torch.float64 for layer in cache.layers)
    assert (got - full).abs().max() <= TOL * full.abs().max()


@pytest.mark.parametrize("name,options", [("linattn_elu", {"window": 5}), ("linattn_favor", {}),
                                          ("linattn_hedgehog", {"feature_dim": 4}),
                                          ("linattn_hedgehog", {"feature_dim": 4, "window": 3, "sinks": 1}),
                                          ("linattn_favor", {"window": 4})])
def test_a_bfloat16_model_decodes_with_a_float32_state(name, options):
    # A model in bfloat16 decodes in bfloat16; the state accumulates in float32. The decoded
    # logits equal the full bfloat16 forward's to bfloat16 rounding: the two paths round the
    # layers' activations at different points, a few units of 2^-8 of the largest logit. The
    # window is kept in float32 (widening the model's keys and values is exact), so that the C++
    # step serves every backend, FAVOR's log form and the windowless ones too.
    model = model_on(name, options).to(torch.bfloat16)
    ids = ids_of(2, 20)
    with torch.no_grad():
        full = model(ids).logits.float()
        cache = lh.LinattnCache(model)
        pieces = [model(ids[:, :8], past_key_values=cache, use_cache=True).logits]
        for t in range(8, 20):
            pieces.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    got = torch.cat(pieces, dim=1)
    assert got.dtype == torch.bfloat16
    assert all(layer.linear.sums.dtype == torch.float32 for layer in cache.layers)
    if options.get("window"):
        assert all(layer.exact_keys.dtype == torch.float32 for layer in cache.layers)
    assert cache.layers[0].step_constants is not None  # the C++ step ran
    assert (got.float() - full).abs().max() <= 2.0 ** -5 * full.abs().max()
    out = model.generate(ids[:, :6], max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 10)


def padded(ids, lengths, side):
    """Each row's first lengths[r] tokens of ids, padded (token 0, mask 0) to the batch's width."""
    batch, n = ids.shape[0], max(lengths)
    out, mask = torch.zeros((batch, n), dtype=torch.long), torch.zeros((batch, n), dtype=torch.long)
    for r, length in enumerate(lengths):
        where = slice(n - length, n) if side == "left" else slice(0, length)
        out[r, where], mask[r, where] = ids[r, :length], 1
    return out, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name,options", CASES)
def test_padded_prompts_generate_what_each_gets_alone(name, options, side):
    # Prompts of 10, 6 and 8 tokens in one batch: each row's greedy tokens and their logits equal
    # those of the row generated alone. Padded positions stay out of every state, window and
    # convolution (φ(0) ≠ 0 for elu+1 and Hedgehog); right padding is moved to the left for the
    # search, and the prompt comes back as given.
    model = model_on(name, options)
    lengths, ids = [10, 6, 8], ids_of(3, 10)
    prompt, mask = padded(ids, lengths, side)
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert isinstance(out.past_key_values, lh.LinattnCache)
    assert torch.equal(out.sequences[:, :10], prompt)
    for r, length in enumerate(lengths):
        alone = model.generate(ids[r:r + 1, :length], max_new_tokens=6, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        assert torch.equal(out.sequences[r, 10:], alone.sequences[0, length:]), (r, side)
        got, want = torch.stack([l[r] for l in out.logits]), torch.stack([l[0] for l in alone.logits])
        assert (got - want).abs().max() <= TOL * want.abs().max()


@pytest.mark.parametrize("name,options", [("linattn_elu", {"window": 3}), ("linattn_favor", {"window": 4}),
                                          ("linattn_focused", {"conv_kernel_size": 3}),
                                          ("linattn_hedgehog", {"feature_dim": 4})])
def test_right_padded_prompt_then_tokens_through_the_model(name, options):
    # Without generate(): a right-padded prompt (padding in the middle of the sequence once new
    # tokens follow), then a chunk of 2 tokens and single tokens, each row against itself alone.
    model = model_on(name, options)
    lengths, ids = [9, 5], ids_of(2, 14)
    prompt, mask = padded(ids, lengths, "right")
    more = ids_of(2, 4, seed=7)
    with torch.no_grad():
        cache = lh.LinattnCache(model)
        first = model(prompt, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        pieces, seen = [], mask
        for chunk in (more[:, :2], more[:, 2:3], more[:, 3:]):
            seen = torch.cat([seen, torch.ones_like(chunk)], dim=1)
            positions = seen.cumsum(dim=1)[:, -chunk.shape[1]:] - 1  # each row's own positions, as generate() sets
            pieces.append(model(chunk, attention_mask=seen, position_ids=positions, past_key_values=cache,
                                use_cache=True).logits)
        got = torch.cat(pieces, dim=1)
        for r, length in enumerate(lengths):
            want = model(torch.cat([ids[r:r + 1, :length], more[r:r + 1]], dim=1)).logits
            assert (first[r, :length] - want[0, :length]).abs().max() <= TOL * want.abs().max()
            assert (got[r] - want[0, length:]).abs().max() <= TOL * want.abs().max()
    assert cache.layers[0].counts.tolist() == [13, 9] and cache.get_seq_length() == 13
    wrong = torch.ones(2, 14, dtype=torch.long)
    wrong[0, 0] = 0  # a mask of other sequences than the cache has seen
    with torch.no_grad(), pytest.raises(ValueError, match=r"marks \[12, 13\] tokens before the new ones.*\[13, 9\]"):
        model(more[:, :1], attention_mask=wrong, past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("name,options", [("linattn_softmax", {}), ("linattn_elu", {}), ("linattn_elu", {"window": 3}),
                                          ("linattn_hedgehog", {"feature_dim": 4, "window": 5}),
                                          ("linattn_favor", {}), ("linattn_window", {"window": 4})])
def test_a_static_cache_generates_what_a_dynamic_cache_does(name, options):
    # StaticCache hands every layer its whole buffer, empty slots included, and transformers'
    # sdpa mask is left out for the prompt (torch's top-left is_causal): linattn's mask keeps
    # the slots visible, and the attention drops the slots no query sees.
    model = model_on(name, options)
    prompt = ids_of(2, 7)
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    dynamic = model.generate(prompt, past_key_values=transformers.DynamicCache(config=model.config), **kw)
    static = model.generate(prompt, cache_implementation="static", **kw)
    assert isinstance(static.past_key_values, transformers.StaticCache)
    assert torch.equal(static.sequences, dynamic.sequences)
    for a, b in zip(static.logits, dynamic.logits):
        assert (a - b).abs().max() <= TOL * b.abs().max()


def test_a_cache_refuses_a_model_switched_to_another_backend_or_options():
    prompt = ids_of(1, 6)
    for switch, match in ((lambda m: m.set_attn_implementation("linattn_relu"), "made for linattn_elu.*'linattn_relu'"),
                          (lambda m: lh.set_options(m, window=2), r"options changed.*window 3 -> 2"),
                          (lambda m: setattr(m.config, "linattn_options", {"window": 3, "eps": 0.5}),
                           r"eps 1e-06 -> 0.5")):
        m = model_on("linattn_elu", {"window": 3})
        cache = lh.LinattnCache(m)
        with torch.no_grad():
            m(prompt, past_key_values=cache, use_cache=True)
            switch(m)
            with pytest.raises(ValueError, match=match):
                m(prompt[:, :1], past_key_values=cache, use_cache=True)
    hedgehog = model_on("linattn_hedgehog", {"feature_dim": 8})
    cache = lh.LinattnCache(hedgehog)
    with torch.no_grad():
        hedgehog(prompt, past_key_values=cache, use_cache=True)
        hedgehog.set_attn_implementation("linattn_elu")
        with pytest.raises(ValueError, match="made for linattn_hedgehog"):
            hedgehog(prompt[:, :1], past_key_values=cache, use_cache=True)


def test_a_decoding_step_with_autograd_on_is_refused_with_frozen_projections():
    # After linearize every projection is frozen: q, k and v need no gradient, the maps do.
    lh.register()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, attn_implementation="sdpa")).eval()
    lh.linearize(model, feature_map="hedgehog", window=2, feature_dim=4)
    cache = lh.LinattnCache(model)
    prompt = ids_of(1, 5)
    model(prompt, past_key_values=cache, use_cache=True)  # the prompt: with autograd, as in training
    with pytest.raises(ValueError, match="decoding step with autograd on"):
        model(prompt[:, :1], past_key_values=cache, use_cache=True)


def test_two_threads_sharing_a_cache_are_told_so():
    # A forward in progress on another thread (here: stopped after its first layer's update,
    # held by an event, so no timing is involved) makes this thread's forward raise a message
    # that names concurrent use, and leaves the other's forward as it was. Once that thread is
    # gone, the cache serves this thread again.
    import threading
    model = model_on("linattn_elu", {"window": 3})
    cache = lh.LinattnCache(model)
    prompt = ids_of(1, 5)
    started, release = threading.Event(), threading.Event()

    def first_layer_then_wait():
        cache.update(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), 0)
        lh.backends.PENDING_CACHE.note = None
        started.set()
        release.wait()

    other = threading.Thread(target=first_layer_then_wait)
    other.start()
    try:
        assert started.wait(60)
        with torch.no_grad(), pytest.raises(ValueError, match="used by two forwards at once.*give each its own"):
            model(prompt, past_key_values=cache, use_cache=True)
        assert cache._forward[0] == other.ident  # still the other thread's forward
    finally:
        release.set()
        other.join()
    with torch.no_grad():
        assert model(prompt, past_key_values=cache, use_cache=True).logits.shape == (1, 5, 97)
    assert cache._forward is None and cache.get_seq_length() == 5


def test_a_failed_forward_frees_the_cache_for_other_threads():
    # A forward that raises in a layer's attention (here a mask that is no causal padding mask)
    # ends its thread's hold on the cache: another live thread is not told of concurrent use.
    import threading
    model = model_on("linattn_elu", {"window": 3})
    cache = lh.LinattnCache(model)
    prompt = ids_of(1, 5)
    band = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril() & torch.ones(5, 5, dtype=torch.bool).triu(-1)
    errors, failed, release = [], threading.Event(), threading.Event()

    def fail_then_stay():
        try:
            with torch.no_grad():
                model(prompt, attention_mask=band, past_key_values=cache, use_cache=True)
        except ValueError as e:
            errors.append(str(e))
        failed.set()
        release.wait()

    other = threading.Thread(target=fail_then_stay)
    other.start()
    try:
        assert failed.wait(60)
        assert errors and "not a causal padding mask" in errors[0]
        with torch.no_grad():
            got = model(prompt, past_key_values=cache, use_cache=True).logits
            want = model(prompt).logits
        assert (got - want).abs().max() <= TOL * want.abs().max()
    finally:
        release.set()
        other.join()


def test_a_cache_can_be_deep_copied_to_continue_one_prompt_twice():
    import copy
    model = model_on("linattn_hedgehog", {"feature_dim": 4, "window": 3})
    ids = ids_of(1, 9)
    with torch.no_grad():
        cache = lh.LinattnCache(model)
        model(ids[:, :7], past_key_values=cache, use_cache=True)
        twin = copy.deepcopy(cache)
        a = model(ids[:, 7:8], past_key_values=cache, use_cache=True).logits
        b = model(ids[:, 8:9], past_key_values=twin, use_cache=True).logits
        want_a = model(ids[:, :8]).logits[:, -1:]
        want_b = model(torch.cat([ids[:, :7], ids[:, 8:9]], dim=1)).logits[:, -1:]
    assert (a - want_a).abs().max() <= TOL * want_a.abs().max()
    assert (b - want_b).abs().max() <= TOL * want_b.abs().max()
    assert twin.layers[0].cache is twin and twin.get_seq_length() == 8


@pytest.mark.parametrize("search", [dict(num_beams=3, num_return_sequences=2), dict(do_sample=True, top_k=5,
                                                                                   num_return_sequences=2)])
def test_right_padded_prompts_with_several_sequences_each(search):
    model = model_on("linattn_elu", {"window": 3})
    lengths, ids = [8, 5], ids_of(2, 8)
    prompt, mask = padded(ids, lengths, "right")
    torch.manual_seed(0)
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=4, **search)
    assert out.shape == (4, 12)
    assert torch.equal(out[:, :8], prompt.repeat_interleave(2, dim=0))
    if "num_beams" in search:  # deterministic: each row's beams are those it gets alone
        for r, length in enumerate(lengths):
            alone = model.generate(ids[r:r + 1, :length], max_new_tokens=4, **search)
            assert torch.equal(out[2 * r:2 * r + 2, 8:], alone[:, length:])


def test_right_padded_prompts_given_as_embeddings_too():
    model = model_on("linattn_elu", {"window": 3})
    lengths, ids = [8, 5], ids_of(2, 8)
    prompt, mask = padded(ids, lengths, "right")
    embeds = model.get_input_embeddings()(prompt)
    out = model.generate(prompt, inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4, do_sample=False)
    for r, length in enumerate(lengths):
        alone = model.generate(ids[r:r + 1, :length], max_new_tokens=4, do_sample=False)
        assert torch.equal(out[r, -4:], alone[0, length:])


def test_sinks_keep_the_first_tokens_exact_and_are_checked():
    # The same weights with and without sinks: equal logits while the window holds every token,
    # different after (without sinks, the first tokens go to the linear part).
    with_sinks, without = model_on("linattn_elu", {"window": 3, "sinks": 2}), model_on("linattn_elu", {"window": 3})
    without.load_state_dict(with_sinks.state_dict())
    ids = ids_of(1, 16)
    with torch.no_grad():
        a, b = with_sinks(ids).logits, without(ids).logits
    assert (a[:, :3] - b[:, :3]).abs().max() <= TOL * b.abs().max()  # positions 0-2: the window of 3 holds all
    assert ((a[:, 3:] - b[:, 3:]).abs().amax(-1) > 1e-3 * b.abs().max()).all()
    model = model_on("linattn_elu", {})
    with pytest.raises(ValueError, match="sinks=2 needs window >= 1"):
        lh.set_options(model, sinks=2)
    with pytest.raises(ValueError, match="sinks must be an integer >= 0"):
        lh.set_options(model, window=2, sinks=-1)
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with pytest.raises(ValueError, match="sinks=4 needs window >= 1"):
        lh.linearize(fresh, feature_map="elu", sinks=4)
    assert fresh.config._attn_implementation != "linattn_elu"  # nothing changed
    lh.linearize(fresh, feature_map="elu", window=2, sinks=4)
    assert fresh.config.linattn_options["sinks"] == 4


def test_hybrid_decode_step_refuses_arrays_it_could_not_change_in_place():
    """linattn.hybrid_decode_step (LinattnCache's C++ step) changes its state arrays in place: one
    of another dtype, not contiguous or read-only is a TypeError naming it (a converted copy would
    take the change), and a bad value is a ValueError that leaves every state array as it was."""
    import numpy as np
    from linattn import _linattn
    B, H, d, m, s, w = 2, 3, 4, 5, 1, 3
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    args = dict(q=f32(B, H, d), k=f32(B, H, d), v=f32(B, H, d), query_features=np.abs(f32(B, H, m)),
                leaving_features=np.abs(f32(B, H, m)), advance=np.ones(B, bool),
                window_weight=np.full(H, 0.5, np.float32), log_decay=None)
    state = dict(sums=np.zeros((B, H, m, d), np.float32), normaliser=np.zeros((B, H, m), np.float32),
                 exact_keys=np.zeros((B, H, s + w, d), np.float32), exact_values=np.zeros((B, H, s + w, d), np.float32),
                 exact_valid=np.zeros((B, s + w), bool), counts=np.zeros(B, np.int64))
    opts = dict(window=w, sinks=s, scale=0.5, eps=1e-6)
    out = _linattn.hybrid_decode_step(**args, **state, **opts)
    assert out.shape == (B, H, d) and np.isfinite(out).all()
    assert state["counts"].tolist() == [1, 1] and state["exact_valid"].sum() == B  # changed in place
    for name, bad in (("sums", state["sums"].astype(np.float64)), ("counts", state["counts"].astype(np.int32)),
                      ("exact_keys", np.asfortranarray(state["exact_keys"])), ("exact_valid", state["exact_valid"][:, ::1].copy().astype(np.uint8))):
        with pytest.raises(TypeError, match=name):
            _linattn.hybrid_decode_step(**args, **dict(state, **{name: bad}), **opts)
    frozen = state["normaliser"].copy()
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="normaliser must be writable"):
        _linattn.hybrid_decode_step(**args, **dict(state, normaliser=frozen), **opts)
    before = {k: v.copy() for k, v in state.items()}
    with pytest.raises(ValueError, match="window_weight must be in"):
        _linattn.hybrid_decode_step(**dict(args, window_weight=np.full(H, 2.0, np.float32)), **state, **opts)
    with pytest.raises(ValueError, match="leaving_features must be finite and >= 0"):
        _linattn.hybrid_decode_step(**dict(args, leaving_features=-args["leaving_features"]), **state, **opts)
    for key, value in state.items():
        np.testing.assert_array_equal(value, before[key])


def test_hybrid_decode_step_takes_hedgehog_maps_or_features_not_both():
    """With Hedgehog's four map tensors the step makes both features itself (LinattnCache's one
    call per layer and token): it equals the step given hedgehog_features' features; maps and
    features together, a part of the maps, or neither is a ValueError naming them."""
    import numpy as np
    import linattn
    from linattn import _linattn
    B, H, d, f, s, w = 2, 3, 4, 3, 1, 2
    rng = np.random.default_rng(1)
    f64 = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    maps = dict(query_weight=f64(H, d, f), query_bias=f64(H, f), key_weight=f64(H, d, f), key_bias=f64(H, f))

    def fresh():
        return dict(sums=np.zeros((B, H, 2 * f, d)), normaliser=np.zeros((B, H, 2 * f)),
                    exact_keys=np.zeros((B, H, s + w, d)), exact_values=np.zeros((B, H, s + w, d)),
                    exact_valid=np.zeros((B, s + w), bool), counts=np.zeros(B, np.int64))
    a, b = fresh(), fresh()
    common = dict(advance=np.ones(B, bool), window_weight=np.full(H, 0.5), log_decay=None, window=w, sinks=s,
                  scale=0.5, eps=1e-6)
    for t in range(6):
        q, k, v = f64(B, H, d), f64(B, H, d), f64(B, H, d)
        leaving = b["exact_keys"][np.arange(B), :, s + b["counts"] % w]  # [B, H, d]: the key each row's ring gives up
        fq = linattn.hedgehog_features(q[:, :, None], maps["query_weight"], maps["query_bias"])[:, :, 0]
        fl = linattn.hedgehog_features(leaving[:, :, None], maps["key_weight"], maps["key_bias"])[:, :, 0]
        got = _linattn.hybrid_decode_step(q, k, v, None, None, **a, **common, **maps)
        want = _linattn.hybrid_decode_step(q, k, v, fq, fl, **b, **common)
        # float64: the two paths' features differ by rounding (x·W summed in another order), ~1e-16
        # relative, and outputs are means of v (|v| < 5): 1e-12 is 10^3 times that, far below a
        # wrong key's effect (~1e-1)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    q = f64(B, H, d)
    with pytest.raises(ValueError, match="query_features and leaving_features must be None when Hedgehog's maps"):
        _linattn.hybrid_decode_step(q, q, q, np.abs(f64(B, H, 2 * f)), None, **a, **common, **maps)
    with pytest.raises(ValueError, match="go together .*; 3 of them were given"):
        _linattn.hybrid_decode_step(q, q, q, None, None, **a, **common, **dict(maps, key_bias=None))
    with pytest.raises(ValueError, match="required unless Hedgehog's maps"):
        _linattn.hybrid_decode_step(q, q, q, None, None, **a, **common)
    with pytest.raises(ValueError, match="key_weight has shape"):
        _linattn.hybrid_decode_step(q, q, q, None, None, **a, **common, **dict(maps, key_weight=f64(H, d, f + 1)))


def test_hybrid_prefill_leaves_the_state_the_steps_would():
    """linattn.hybrid_prefill (LinattnCache's prefill, one C++ call per layer) writes over the state
    arrays the state that stepping the prompt's tokens through hybrid_decode_step leaves, with
    padding, grouped key heads, decay and Hedgehog's key map applied by both; key_features, a key
    map and a fixed map are one or the other, and a state array it could not change in place is a
    TypeError naming it."""
    import numpy as np
    from linattn import _linattn
    B, H, H_kv, n, d, f, s, w = 2, 4, 2, 11, 4, 3, 2, 3
    rng = np.random.default_rng(2)
    f64 = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    k, v, q = f64(B, H_kv, n, d), f64(B, H_kv, n, d), f64(B, H, n, d)
    maps = dict(query_weight=f64(H, d, f), query_bias=f64(H, f), key_weight=f64(H, d, f), key_bias=f64(H, f))
    valid = np.ones((B, n), bool)
    valid[1, [0, 4, 5]] = False  # row 1: padding first and inside
    log_decay = -0.1 * np.arange(1, H + 1)

    def fresh():
        return dict(sums=np.full((B, H, 2 * f, d), 9.0), normaliser=np.zeros((B, H, 2 * f)),
                    exact_keys=np.zeros((B, H_kv, s + w, d)), exact_values=np.zeros((B, H_kv, s + w, d)),
                    exact_valid=np.ones((B, s + w), bool), counts=np.full(B, 5, np.int64))
    got, want = fresh(), fresh()
    _linattn.hybrid_prefill(k, v, None, valid, log_decay, **got, window=w, sinks=s, key_weight=maps["key_weight"],
                            key_bias=maps["key_bias"])
    for name in ("sums", "normaliser", "exact_keys", "exact_values", "exact_valid", "counts"):
        want[name][...] = 0
    for t in range(n):
        _linattn.hybrid_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], None, None, advance=valid[:, t].copy(),
                                    window_weight=np.full(H, 0.5), log_decay=log_decay, **want, window=w, sinks=s,
                                    scale=0.5, eps=1e-6, **maps)
    assert got["counts"].tolist() == [n, n - 3]
    for name in ("exact_keys", "exact_values", "exact_valid", "counts"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # float64 sums of at most n terms |φ·v| < 5 summed in another order: 1e-12 is 10^3 times their rounding
    for name in ("sums", "normaliser"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12, err_msg=name)
    state = fresh()
    with pytest.raises(ValueError, match="key_features must be None when Hedgehog's maps"):
        _linattn.hybrid_prefill(k, v, np.ones((B, H, n, 2 * f)), None, None, **state, window=w, sinks=s,
                                key_weight=maps["key_weight"], key_bias=maps["key_bias"])
    with pytest.raises(ValueError, match="key_weight, key_bias go together"):
        _linattn.hybrid_prefill(k, v, None, None, None, **state, window=w, sinks=s, key_weight=maps["key_weight"])
    with pytest.raises(ValueError, match="key_features required unless"):
        _linattn.hybrid_prefill(k, v, None, None, None, **state, window=w, sinks=s)
    with pytest.raises(ValueError, match="key_features must be None with feature_map=\"elu\""):
        _linattn.hybrid_prefill(k, v, np.ones((B, H, n, 2 * f)), None, None, **state, window=w, sinks=s,
                                feature_map="elu")
    with pytest.raises(TypeError, match="counts must have dtype int64"):
        _linattn.hybrid_prefill(k, v, np.ones((B, H, n, 2 * f)), None, None, **dict(state, counts=np.zeros(B, np.int32)),
                                window=w, sinks=s)
    with pytest.raises(ValueError, match="sinks=2 needs window >= 1"):
        _linattn.hybrid_prefill(k, v, np.ones((B, H, n, 2 * f)), None, None, **state, window=0, sinks=s)
    assert (state["sums"] == 9.0).all() and state["counts"].tolist() == [5, 5]  # nothing written


def test_decoding_reads_learned_tensors_changed_or_replaced_after_the_prompt():
    """The C++ step's Hedgehog maps and window weight are kept per layer between tokens: a query
    map or window gate changed in place, or replaced, after the prompt is the one the next token
    reads, as a cache made with the new values from the start gives (in the last layer neither
    enters any state: its outputs feed no later layer's keys)."""
    options = {"feature_dim": 4, "window": 3, "sinks": 1}
    ids = ids_of(1, 10)
    model = model_on("linattn_hedgehog", options)
    changed = model_on("linattn_hedgehog", options)
    attn, attn_changed = model.model.layers[-1].self_attn, changed.model.layers[-1].self_attn
    with torch.no_grad():
        attn_changed.linattn_hedgehog_q.weight.mul_(1.5)
        attn_changed.linattn_window_gate.add_(0.7)
        cache, fresh = lh.LinattnCache(model), lh.LinattnCache(changed)
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        changed(ids[:, :6], past_key_values=fresh, use_cache=True)
        for t in range(6, 8):
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            changed(ids[:, t:t + 1], past_key_values=fresh, use_cache=True)
        attn.linattn_hedgehog_q.weight.mul_(1.5)  # in place
        attn.linattn_window_gate = torch.nn.Parameter(attn.linattn_window_gate + 0.7)  # replaced
        got = model(ids[:, 8:9], past_key_values=cache, use_cache=True).logits
        want = changed(ids[:, 8:9], past_key_values=fresh, use_cache=True).logits
        stale = model_on("linattn_hedgehog", options)(ids[:, :9]).logits[:, -1:]
    assert (got - want).abs().max() <= TOL * want.abs().max()
    assert (got - stale).abs().max() > 100 * TOL * want.abs().max()  # the change is visible in the logits


@pytest.mark.parametrize("feature_map", ["elu", "relu", "focused"])
def test_hybrid_decode_step_applies_a_fixed_map_by_name(feature_map):
    """feature_map="elu", "relu" or "focused": the step maps q and the leaving key itself, as
    linattn.features does (to the vector exp's last bits); features passed as well, or Hedgehog's
    maps with it, is a ValueError."""
    import numpy as np
    import linattn
    from linattn import _linattn
    B, H, d, s, w = 2, 3, 4, 1, 2
    rng = np.random.default_rng(2)

    def fresh():
        return dict(sums=np.zeros((B, H, d, d)), normaliser=np.zeros((B, H, d)), exact_keys=np.zeros((B, H, s + w, d)),
                    exact_values=np.zeros((B, H, s + w, d)), exact_valid=np.zeros((B, s + w), bool),
                    counts=np.zeros(B, np.int64))
    a, b = fresh(), fresh()
    common = dict(advance=np.ones(B, bool), window_weight=np.full(H, 0.5), log_decay=np.full(H, -0.1), window=w,
                  sinks=s, scale=0.5, eps=1e-6)
    for t in range(6):
        q, k, v = (rng.standard_normal((B, H, d)) for _ in range(3))
        leaving = b["exact_keys"][np.arange(B), :, s + b["counts"] % w]
        fq, fl = (linattn.features(x[:, :, None], feature_map, focus_power=2.5)[:, :, 0] for x in (q, leaving))
        got = _linattn.hybrid_decode_step(q, k, v, None, None, **a, **common, feature_map=feature_map, focus_power=2.5)
        want = _linattn.hybrid_decode_step(q, k, v, fq, fl, **b, **common)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)  # float64 exp's last bits, as above
    with pytest.raises(ValueError, match="must be None with feature_map"):
        _linattn.hybrid_decode_step(q, k, v, fq, fl, **a, **common, feature_map=feature_map)
    with pytest.raises(ValueError, match="were both given"):
        _linattn.hybrid_decode_step(q, k, v, None, None, **a, **common, feature_map=feature_map,
                                    query_weight=np.zeros((H, d, 2)), query_bias=np.zeros((H, 2)),
                                    key_weight=np.zeros((H, d, 2)), key_bias=np.zeros((H, 2)))
    with pytest.raises(ValueError, match="feature_map must be \"elu\", \"relu\", \"focused\" or \"given\"; got \"softmax\""):
        _linattn.hybrid_decode_step(q, k, v, None, None, **a, **common, feature_map="softmax")
    with pytest.raises(ValueError, match="feature_map=\"favor\" needs projection"):
        _linattn.hybrid_decode_step(q, k, v, None, None, **a, **common, feature_map="favor")


def test_options_edited_in_place_are_checked_again():
    """options_of keeps a config's checked options between forwards; an edit in place is checked
    again, types included (window=True equals window=1 to ==, but is not an integer)."""
    model = model_on("linattn_elu", {"window": 1})
    ids = ids_of(1, 6)
    with torch.no_grad():
        model(ids)
        for bad in (True, 1.0):
            model.config.linattn_options["window"] = bad
            with pytest.raises(ValueError, match="window must be an integer"):
                model(ids)
        model.config.linattn_options["window"] = 1
        model(ids)
