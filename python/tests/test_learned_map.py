"""A learned feature map of one's own (linattn.torch.LearnedFeatureMap): its own class and one
registration line make it a method everywhere, with no other edit. A toy map kept in torch alone
(no kernel_maps, so every decoding path hands the C++ step and prefill its features) runs in
MultiheadAttention (forward, backward, decoding steps against its causal forward),
linattn.hf.linearize, LinattnCache (the decoded logits against the full forward, with a window,
sinks, decay and padding) and the save / from_pretrained round trip; bad options and bad
registrations are errors naming them."""

import math

import pytest
import torch
import torch.nn.functional as F

import linattn.torch as lt
from linattn.torch import feature_maps as _feature_maps

transformers = pytest.importorskip("transformers")
import linattn.hf as lh  # noqa: E402
from linattn.hf import backends as _backends  # noqa: E402
from test_cache import CONFIG, TOL, ids_of, model_on, padded  # noqa: E402

NAME = "softplus_test"


class SoftplusMap(lt.LearnedFeatureMap):
    """φ(x) = softplus(x·W_h) per head, W [heads, head_dim, feature_dim]: a map in torch alone."""

    options = {"feature_dim": 6}
    inits = ("random", "ones")

    def __init__(self, num_heads, head_dim, *, init, feature_dim, device=None, dtype=None):
        super().__init__()
        self.feature_dim = feature_dim
        factory = {"device": device, "dtype": dtype}
        w = (torch.randn(num_heads, head_dim, feature_dim, **factory) / math.sqrt(head_dim) if init == "random"
             else torch.ones(num_heads, head_dim, feature_dim, **factory))
        self.weight = torch.nn.Parameter(w)

    @property
    def dim(self):
        return self.feature_dim

    def forward(self, x):
        return F.softplus(torch.einsum("bhnd,hdf->bhnf", x, self.weight))


@pytest.fixture(autouse=True, scope="module")
def registered():
    lt.register_feature_map(NAME, SoftplusMap)  # the one registration line
    yield
    # Out of the process-wide registries again, so that other test files see linattn's own maps only.
    _feature_maps._LEARNED.pop(NAME)
    _backends.BACKENDS.pop(lh.backends.PREFIX + NAME)


@pytest.mark.parametrize("window", [0, 3])
def test_multihead_attention_trains_and_decodes_like_its_causal_forward(window):
    torch.manual_seed(0)
    m = lt.MultiheadAttention(16, 2, method=NAME, feature_dim=5, window=window).double()
    assert isinstance(m.query_map, SoftplusMap) and m.query_map.dim == 5
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    full = m(x, is_causal=True)
    full.square().sum().backward()
    assert m.query_map.weight.grad.abs().sum() > 0 and m.key_map.weight.grad.abs().sum() > 0
    state = m.eval().init_state(2)
    with torch.no_grad():
        steps = torch.stack([m.step(x[:, t], state) for t in range(11)], 1)
    # Float64 both ways: the same sums in another order, far below 1e-12 of the outputs.
    assert (steps - full.detach()).abs().max() <= 1e-12 * full.abs().max()
    assert state.state.shape == (2, 2, 5, 8) and state.arrays["exact_keys"].shape[2] == window


CASES = [{"feature_dim": 4}, {"feature_dim": 4, "window": 5}, {"feature_dim": 3, "window": 3, "sinks": 2, "decay": -0.1}]


@pytest.mark.parametrize("options", CASES)
def test_decoded_logits_equal_the_full_forward(options):
    model = model_on(lh.backends.PREFIX + NAME, options)
    ids = ids_of(2, 24)
    with torch.no_grad():
        full = model(ids).logits
        cache = lh.LinattnCache(model)
        pieces = [model(ids[:, :9], past_key_values=cache, use_cache=True).logits]
        pieces.append(model(ids[:, 9:12], past_key_values=cache, use_cache=True).logits)
        for t in range(12, 24):
            pieces.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    got = torch.cat(pieces, dim=1)
    # As test_cache's backends: each path rounds differently, a few ulps of every term.
    assert (got - full).abs().max() <= TOL * full.abs().max()


@pytest.mark.parametrize("options", CASES[1:])
def test_padded_prompts_generate_what_each_gets_alone(options):
    model = model_on(lh.backends.PREFIX + NAME, options)
    lengths, ids = [10, 6, 8], ids_of(3, 10)
    prompt, mask = padded(ids, lengths, "left")
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert isinstance(out.past_key_values, lh.LinattnCache)
    for r, length in enumerate(lengths):
        alone = model.generate(ids[r:r + 1, :length], max_new_tokens=5, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        assert torch.equal(out.sequences[r, 10:], alone.sequences[0, length:]), r
        got, want = torch.stack([l[r] for l in out.logits]), torch.stack([l[0] for l in alone.logits])
        assert (got - want).abs().max() <= TOL * want.abs().max()


def test_linearize_saves_and_loads_the_map(tmp_path):
    lh.register()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, attn_implementation="sdpa")).eval()
    lh.linearize(model, feature_map=NAME, window=4, sinks=1, feature_dim=3, init="ones")
    assert model.config._attn_implementation == "linattn_" + NAME
    assert model.config.linattn_options == {"window": 4, "sinks": 1, "feature_dim": 3, "init": "ones"}
    maps = {n: p for n, p in model.named_parameters() if p.requires_grad}
    owners = {next(part for part in n.split(".") if part.startswith("linattn_")) for n in maps}
    assert owners == {"linattn_%s_q" % NAME, "linattn_%s_k" % NAME, "linattn_window_gate"}
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in maps.items() if "window_gate" not in n)
    with torch.no_grad():
        for p in maps.values():
            p.add_(torch.randn(p.shape) * 0.3)
    ids = ids_of(1, 12)
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path)
    reloaded = lh.from_pretrained(transformers.LlamaForCausalLM, str(tmp_path)).eval()
    for n, p in maps.items():
        assert torch.equal(dict(reloaded.named_parameters())[n], p), n
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, before)
    # In a process where the map is not registered, the checkpoint says so.
    b = _backends.BACKENDS.pop(lh.backends.PREFIX + NAME)
    try:
        with pytest.raises(ValueError, match="backend 'linattn_softplus_test', which this process does not know"):
            lh.from_pretrained(transformers.LlamaForCausalLM, str(tmp_path))
    finally:
        _backends.BACKENDS[b.name] = b


def test_bad_options_and_registrations_are_errors_naming_them():
    with pytest.raises(TypeError, match="takes no option 'rank'"):
        lt.MultiheadAttention(16, 2, method=NAME, rank=2)
    with pytest.raises(ValueError, match="feature_dim must be an integer >= 1"):
        lt.MultiheadAttention(16, 2, method=NAME, feature_dim=0)
    with pytest.raises(ValueError, match="init must be one of 'random', 'ones', got 'identity'"):
        lt.MultiheadAttention(16, 2, method=NAME, init="identity")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, attn_implementation="sdpa"))
    with pytest.raises(TypeError, match="feature_map='softplus_test' takes no option rank"):
        lh.linearize(model, feature_map=NAME, rank=2)
    with pytest.raises(ValueError, match="feature_dim must be an integer >= 1"):
        lh.linearize(model, feature_map=NAME, feature_dim=-1)
    assert model.config._attn_implementation == "sdpa"  # refused before anything changed
    with pytest.raises(TypeError, match="feature_map='elu' takes no option rank"):
        lh.linearize(model, feature_map="elu", rank=2)
    lt.register_feature_map(NAME, SoftplusMap)  # again, the same class: nothing happens
    with pytest.raises(ValueError, match="'softplus_test' is registered already, as SoftplusMap"):
        lt.register_feature_map(NAME, lt.HedgehogFeatureMap)
    with pytest.raises(ValueError, match="'elu' is a fixed method's or map's name"):
        lt.register_feature_map("elu", SoftplusMap)
    with pytest.raises(ValueError, match="name must be a lowercase identifier"):
        lt.register_feature_map("Soft-plus", SoftplusMap)
    with pytest.raises(TypeError, match="cls must be a subclass of LearnedFeatureMap"):
        lt.register_feature_map("plain", torch.nn.Linear)

    class Clashing(SoftplusMap):
        options = {"feature_dim": 6, "eps": 0.1}

    class BadDefault(SoftplusMap):
        options = {"feature_dim": 0}

    with pytest.raises(ValueError, match="option 'eps' is a name the methods and backends take themselves"):
        lt.register_feature_map("clashing", Clashing)
    with pytest.raises(ValueError, match="register_feature_map: feature_dim must be an integer >= 1, got 0"):
        lt.register_feature_map("bad_default", BadDefault)
    assert set(lt.learned_feature_maps()) == {"hedgehog", NAME}  # nothing registered by a refused call
