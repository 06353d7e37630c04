"""Options renamed to one name in every layer (issue 43): linear_attention's dwc_weight is
conv_weight (as nystrom_attention's), MultiheadAttention's and linattn.hf's dwc_kernel_size is
conv_kernel_size. The former names still work until the next release, with a DeprecationWarning
naming both; both names at once is a TypeError. linear_attention's feature_map "identity" is
"given", as hybrid_attention's (the caller gives the features); "identity" still works, with a
DeprecationWarning, in every function that took it."""

import inspect

import numpy as np
import pytest
import torch

import linattn
import linattn.torch as lt
import linattn.torch.distributed as ltd
from linattn.torch import state as st

RNG = np.random.default_rng(3)


def _qkv(dtype=np.float64):
    return [RNG.standard_normal((1, 2, 7, 4)).astype(dtype) for _ in range(3)]


def test_the_registry_names_the_former_name():
    option = next(o for m in linattn.methods() if m["name"] == "linear" for o in m["options"]
                  if o["name"] == "conv_weight")
    assert option["formerly"] == "dwc_weight"
    for function in (linattn.linear_attention, linattn.linear_attention_backward, lt.linear_attention,
                     ltd.linear_attention):
        params = inspect.signature(function).parameters
        assert "conv_weight" in params and "dwc_weight" not in params, function


def test_numpy_and_torch_accept_the_former_name_with_a_warning():
    q, k, v = _qkv()
    w = RNG.standard_normal((2, 3))
    want = linattn.linear_attention(q, k, v, feature_map="focused", conv_weight=w)
    with pytest.warns(DeprecationWarning, match="linear_attention: dwc_weight is now called conv_weight"):
        got = linattn.linear_attention(q, k, v, feature_map="focused", dwc_weight=w)
    np.testing.assert_array_equal(got, want)
    g = RNG.standard_normal(want.shape)
    with pytest.warns(DeprecationWarning, match="linear_attention_backward: dwc_weight is now called conv_weight"):
        grads = linattn.linear_attention_backward(q, k, v, g, feature_map="focused", dwc_weight=w)
    for a, b in zip(grads, linattn.linear_attention_backward(q, k, v, g, feature_map="focused", conv_weight=w)):
        np.testing.assert_array_equal(a, b)
    with pytest.warns(DeprecationWarning, match="dwc_weight is now called conv_weight"):
        t = lt.linear_attention(*(torch.from_numpy(x) for x in (q, k, v)), dwc_weight=torch.from_numpy(w))
    torch.testing.assert_close(t, torch.from_numpy(linattn.linear_attention(q, k, v, conv_weight=w)), rtol=0, atol=0)
    with pytest.raises(TypeError, match="got conv_weight and dwc_weight, its former name"):
        linattn.linear_attention(q, k, v, conv_weight=w, dwc_weight=w)


def test_multihead_attention_accepts_the_former_kernel_size():
    with pytest.warns(DeprecationWarning, match="MultiheadAttention: dwc_kernel_size is now called conv_kernel_size"):
        old = lt.MultiheadAttention(8, 2, method="focused", dwc_kernel_size=3)
    assert tuple(old.conv_weight.shape) == (2, 3)
    new = lt.MultiheadAttention(8, 2, method="focused", conv_kernel_size=3)
    assert tuple(new.conv_weight.shape) == (2, 3)
    with pytest.raises(TypeError, match="its former name"):
        lt.MultiheadAttention(8, 2, method="focused", conv_kernel_size=3, dwc_kernel_size=3)


def test_hf_accepts_the_former_kernel_size_in_calls_and_saved_configs(tmp_path):
    transformers = pytest.importorskip("transformers")
    import linattn.hf as lh
    lh.register()
    config = transformers.LlamaConfig(vocab_size=31, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("linattn_focused")
    with pytest.warns(DeprecationWarning, match="dwc_kernel_size is now called conv_kernel_size"):
        lh.set_options(model, dwc_kernel_size=3)
    assert model.config.linattn_options["conv_kernel_size"] == 3
    assert "dwc_kernel_size" not in model.config.linattn_options
    with pytest.warns(DeprecationWarning):  # again, on a model that stores the name now
        lh.set_options(model, dwc_kernel_size=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "conv_weight" in n:
                p.normal_()  # a convolution that changes the output (it starts at 0)
    ids = torch.tensor([[1, 2, 3, 4]])
    want = model(ids).logits
    # A config written before the rename still runs (its options are read at every forward),
    # saves under the name now, and loads.
    model.config.linattn_options = {"dwc_kernel_size": 3}
    with pytest.warns(DeprecationWarning, match="dwc_kernel_size is now called conv_kernel_size"):
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning):
        model.save_pretrained(tmp_path / "old")
    assert '"conv_kernel_size": 3' in (tmp_path / "old" / "config.json").read_text()
    loaded = lh.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "old").eval()
    torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=0)
    # and a checkpoint whose config.json still says dwc_kernel_size (written by an older linattn)
    text = (tmp_path / "old" / "config.json").read_text().replace('"conv_kernel_size"', '"dwc_kernel_size"')
    (tmp_path / "old" / "config.json").write_text(text)
    with pytest.warns(DeprecationWarning):
        loaded = lh.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "old").eval()
    torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=0)


def _features(seed=5):
    gen = np.random.default_rng(seed)
    return [np.abs(gen.standard_normal((1, 2, 7, 4))) for _ in range(2)] + [gen.standard_normal((1, 2, 7, 3))]


def test_the_registry_names_the_former_feature_map():
    option = next(o for m in linattn.methods() if m["name"] == "linear" for o in m["options"]
                  if o["name"] == "feature_map")
    assert "given" in option["choices"] and "identity" not in option["choices"]
    assert [tuple(c) for c in option["former_choices"]] == [("identity", "given")]


def test_every_function_that_took_identity_takes_it_with_a_warning():
    fq, fk, v = _features()
    g = np.random.default_rng(6).standard_normal(v.shape)
    want = linattn.linear_attention(fq, fk, v, feature_map="given", causal=True)
    calls = {  # the function, its result with "given", and with "identity"
        "linear_attention": lambda m: linattn.linear_attention(fq, fk, v, feature_map=m, causal=True),
        "linear_attention_backward": lambda m: linattn.linear_attention_backward(fq, fk, v, g, feature_map=m)[0],
        "features": lambda m: linattn.features(fk, m),
        "features_backward": lambda m: linattn.features_backward(fk, g[..., :1].repeat(4, -1), m),
        "recurrent_state": lambda m: linattn.recurrent_state(1, 2, 4, 3, feature_map=m, dtype=np.float64)
        .prefill(fq, fk, v),
        "torch linear_attention": lambda m: lt.linear_attention(*map(torch.from_numpy, (fq, fk, v)), feature_map=m),
        "torch features": lambda m: lt.features(torch.from_numpy(fk), m),
        "torch key_state": lambda m: st.key_state(torch.from_numpy(fk), torch.from_numpy(v), feature_map=m)[0],
    }
    for name, call in calls.items():
        now = call("given")
        with pytest.warns(DeprecationWarning, match="feature_map='identity' is now called 'given'"):
            before = call("identity")
        np.testing.assert_array_equal(np.asarray(before), np.asarray(now), err_msg=name)
    np.testing.assert_array_equal(calls["recurrent_state"]("given"), want)
    # over ranks too (test_distributed.py runs "given" on 4 processes): the name is changed before
    # anything else, here before the error that no process group exists
    with pytest.warns(DeprecationWarning, match="feature_map='identity' is now called 'given'"):
        with pytest.raises(ValueError, match="torch.distributed is not initialised"):
            ltd.linear_attention(*map(torch.from_numpy, (fq, fk, v)), feature_map="identity")


def test_the_warning_points_at_the_callers_line():
    fq, fk, v = _features()
    for call in (lambda: linattn.linear_attention(fq, fk, v, feature_map="identity"),
                 lambda: lt.features(torch.from_numpy(fk), "identity"),
                 lambda: st.key_state(torch.from_numpy(fk), torch.from_numpy(v), feature_map="identity")):
        with pytest.warns(DeprecationWarning) as caught:
            call()
        assert all(w.filename == __file__ for w in caught), [(w.filename, str(w.message)) for w in caught]


def test_the_hybrid_never_took_identity():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="feature_map"):
        linattn.hybrid_attention(q, k, v, feature_map="identity", window=2)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=31, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def test_linearize_names_the_window_alone_and_favors_count_as_everywhere_else():
    import linattn.hf as lh
    # the window alone: feature_map "window" (the backend linattn_window); "none" before
    model = lh.linearize(_tiny_llama(), feature_map="window", window=2)
    assert model.config._attn_implementation == "linattn_window"
    with pytest.warns(DeprecationWarning, match="feature_map='none' is now called 'window'") as caught:
        old = lh.linearize(_tiny_llama(), feature_map="none", window=2)
    assert caught[0].filename == __file__
    assert old.config._attn_implementation == "linattn_window"
    assert old.config.linattn_options == model.config.linattn_options
    # FAVOR's m is num_features, as MultiheadAttention's and the linattn_favor backend's
    assert lh.linearize(_tiny_llama(), feature_map="favor", window=2).config.linattn_options["num_features"] == 32
    assert lh.linearize(_tiny_llama(), feature_map="favor", window=2,
                        num_features=8).config.linattn_options["num_features"] == 8
    with pytest.warns(DeprecationWarning, match="num_features now") as caught:
        old = lh.linearize(_tiny_llama(), feature_map="favor", window=2, feature_dim=8)
    assert caught[0].filename == __file__
    assert old.config.linattn_options["num_features"] == 8
    # feature_dim is Hedgehog's f, and num_features is no option of another map
    assert lh.linearize(_tiny_llama(), feature_dim=4).config.linattn_options["feature_dim"] == 4
    for feature_map in ("hedgehog", "elu", "window"):
        model = _tiny_llama()
        with pytest.raises(ValueError, match="num_features is FAVOR's count of random features"):
            lh.linearize(model, feature_map=feature_map, window=2, num_features=8)
        assert model.config._attn_implementation != "linattn_window" and not hasattr(model.config, "linattn_options")
    with pytest.raises(TypeError, match="got num_features and feature_dim"):
        lh.linearize(_tiny_llama(), feature_map="favor", window=2, num_features=8, feature_dim=8)
    with pytest.raises(ValueError, match="num_features must be an integer >= 1"):
        lh.linearize(_tiny_llama(), feature_map="favor", window=2, num_features=0)


def test_empty_state_names_its_feature_count_features():
    want = st.empty_state(1, 2, 5, 3, favor=True)
    assert tuple(want.shape) == (1, 2, 5, 5) and torch.isinf(want[..., -1]).all()
    torch.testing.assert_close(st.empty_state(1, 2, features=5, value_dim=3, favor=True), want, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match="feature_dim is now called features") as caught:
        old = st.empty_state(1, 2, feature_dim=5, value_dim=3, favor=True)
    assert caught[0].filename == __file__
    torch.testing.assert_close(old, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="got features and feature_dim"):
        st.empty_state(1, 2, 5, 3, feature_dim=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'head_dim'"):
        st.empty_state(1, 2, 5, 3, head_dim=5)
    with pytest.raises(TypeError, match="needs batch, heads, features and value_dim"):
        st.empty_state(1, 2, value_dim=3)
