"""A causal language model converted to linear attention, and generation in constant memory
(docs/linearize.md, "A causal LM"): a character-level LlamaForCausalLM (rotary positions)
trained from scratch on Python's documentation topics, its bits per character next to unigram
and bigram baselines, then converted (linattn.hf.linearize: Hedgehog's maps, the window alone,
and the hybrid of both; stage 1 attention transfer, stage 2 logit distillation) with the bpc
gap at contexts 256, 1024 and 4096; and generation after 1k to 64k tokens of context: time
per token and cache bytes for the teacher on sdpa with transformers' DynamicCache, the same
model on linattn_softmax, and the converted models with linattn.hf.LinattnCache.

    make linearize    # runs bench/linearize.py, then this:
    .venv/bin/python bench/causal_lm.py --out out/linearize --docs docs/linearize.md

The teacher is trained once and cached under --out (causal_teacher/; delete it to retrain).
Writes its MEASURED section of docs/linearize.md, the plots docs/img/linearize_generation_*.png
and the raw results (causal_lm.json in --out). --quick: a tiny version (the test's)."""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import linattn  # noqa: E402
import linattn.hf as lh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import charlm  # noqa: E402  (text: Python's documentation topics, characters, 90% / 10% split)
import measured_section  # noqa: E402
from lm_generation import generation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ---- text --------------------------------------------------------------------------------------

class CharTokenizer:
    """What linattn.hf's attention_transfer and finetune call of a tokenizer, for characters:
    tokenizer(texts, padding=True, truncation=True, max_length=n, return_tensors="pt")."""

    padding_side = "right"

    def __init__(self, chars):
        self.code = {c: i for i, c in enumerate(chars)}

    def __call__(self, texts, padding=True, truncation=True, max_length=None, return_tensors="pt"):
        rows = [[self.code[c] for c in t][:max_length] for t in texts]
        n = max(map(len, rows))
        ids = torch.zeros((len(rows), n), dtype=torch.long)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return {"input_ids": ids, "attention_mask": mask}


def ngram_bits(train, val, vocab):
    """Cross-entropy (bits per character) on val of the unigram and the bigram model of train,
    add-one smoothed (every character of the vocabulary keeps a count)."""
    uni = torch.bincount(train, minlength=vocab).double() + 1
    uni_bits = float(-(uni / uni.sum()).log2()[val].mean())
    pairs = torch.bincount(train[:-1] * vocab + train[1:], minlength=vocab * vocab).double().view(vocab, vocab) + 1
    bi = pairs / pairs.sum(1, keepdim=True)
    bi_bits = float(-bi.log2()[val[:-1], val[1:]].mean())
    return uni_bits, bi_bits


# ---- the teacher -------------------------------------------------------------------------------

def llama_config(a, vocab):
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.heads, max_position_embeddings=2 * max(a.gen_contexts),
        rope_theta=10000.0, attention_dropout=0.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, attn_implementation="sdpa")


@torch.no_grad()
def bits_per_char(model, val, context, count):
    """Mean cross-entropy (bits) over every position of `count` evenly spaced validation
    windows of `context` characters."""
    model.eval()
    starts = torch.linspace(0, len(val) - context - 2, count).long().tolist()
    total = 0.0
    for s in starts:  # one window at a time: 4096-character windows stay small in memory
        x, y = val[s:s + context][None], val[s + 1:s + context + 1]
        total += float(F.cross_entropy(model(x).logits[0].float(), y))
    return total / len(starts) / math.log(2)


def teacher(a, chars, train):
    """The softmax teacher: loaded from --out when trained before with these settings, else
    trained for --teacher-seconds of wall time (AdamW, cosine decay) and saved."""
    path = Path(a.out) / ("causal_teacher_quick" if a.quick else "causal_teacher")
    settings = {k: getattr(a, k) for k in ("hidden", "layers", "heads", "train_context", "batch", "teacher_seconds",
                                           "teacher_lr", "seed")}
    meta = path / "training.json"
    if meta.exists() and json.loads(meta.read_text())["settings"] == settings:
        model = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
        return model, json.loads(meta.read_text())
    torch.manual_seed(a.seed)
    model = transformers.LlamaForCausalLM(llama_config(a, len(chars)))
    opt = torch.optim.AdamW(model.parameters(), lr=a.teacher_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(a.seed)
    n, steps, t0, curve = a.train_context, 0, time.perf_counter(), []
    model.train()
    while (elapsed := time.perf_counter() - t0) < a.teacher_seconds:
        lr = a.teacher_lr * min(1.0, (steps + 1) / 50) * 0.5 * (1 + math.cos(math.pi * elapsed / a.teacher_seconds))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train) - n - 1, (a.batch,), generator=gen)
        x = torch.stack([train[s:s + n] for s in starts.tolist()])
        y = torch.stack([train[s + 1:s + n + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        if steps % max(1, a.log_every) == 0:
            curve.append({"step": steps, "seconds": time.perf_counter() - t0, "train_bits": float(loss) / math.log(2)})
            if not a.quick:
                print("teacher step %d, %.0f s, train %.3f bpc" % (steps, curve[-1]["seconds"], curve[-1]["train_bits"]),
                      flush=True)
    model.eval()
    info = {"settings": settings, "steps": steps, "seconds": time.perf_counter() - t0, "curve": curve,
            "parameters": sum(p.numel() for p in model.parameters()), "tokens": steps * a.batch * n}
    model.save_pretrained(path)
    meta.write_text(json.dumps(info, indent=1))
    return model, info


# ---- conversion --------------------------------------------------------------------------------

def convert(a, original, tok, texts, feature_map, window):
    """linearize a copy of the original, then stage 1 when it has maps to learn:
    (model, seconds of stage 1)."""
    import copy
    model = lh.linearize(copy.deepcopy(original), feature_map=feature_map, window=window, feature_dim=a.feature_dim)
    seconds = 0.0
    if feature_map != "window":
        t0 = time.perf_counter()
        lh.attention_transfer(model, tok, texts, steps=a.steps, lr=a.lr, batch_size=a.transfer_batch,
                              max_length=a.train_context, progress=not a.quick)
        seconds = time.perf_counter() - t0
    return model.eval(), seconds


# ---- generation --------------------------------------------------------------------------------

def plots(r, img_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    img_dir.mkdir(parents=True, exist_ok=True)
    for key, ylabel, name in (("ms_per_token", "ms per new token", "time"), ("cache_mib", "cache (MiB)", "memory")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, rows in r["generation"].items():
            xs = [row["context"] for row in rows]
            ax.plot(xs, [row[key] for row in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(img_dir / ("linearize_generation_%s.png" % name), dpi=110)
        plt.close(fig)


# ---- the run -----------------------------------------------------------------------------------

def run(a):
    torch.set_num_threads(a.threads)
    linattn.set_num_threads(a.threads)
    lh.register()
    chars, train, val = charlm.text()
    uni, bi = ngram_bits(train, val, len(chars))
    original, info = teacher(a, chars, train)
    tok = CharTokenizer(chars)
    text = "".join(chars[i] for i in train.tolist())
    n = a.train_context
    step = max(1, (len(text) - n) // a.texts)
    texts = [text[i:i + n] for i in range(0, len(text) - n, step)][:a.texts]

    def bpc(model):
        return {c: bits_per_char(model, val, c, a.eval_windows) for c in a.contexts}

    rows = [{"label": "teacher (softmax, sdpa)", "bpc": bpc(original), "stage1_s": 0.0, "stage2_s": 0.0}]
    converted = {}
    for label, feature_map, window in (("hedgehog f=%d" % a.feature_dim, "hedgehog", 0),
                                       ("window only w=%d" % a.window, "window", a.window),
                                       ("hybrid f=%d + w=%d" % (a.feature_dim, a.window), "hedgehog", a.window)):
        model, t1 = convert(a, original, tok, texts, feature_map, window)
        stage = "zero-shot" if feature_map == "window" else "stage 1"
        rows.append({"label": "%s, %s" % (label, stage), "bpc": bpc(model), "stage1_s": t1, "stage2_s": 0.0})
        if a.finetune_steps:
            t0 = time.perf_counter()
            lh.finetune(model, original, tok, texts, steps=a.finetune_steps, lr=a.finetune_lr,
                        batch_size=a.transfer_batch, max_length=n, progress=not a.quick)
            t2 = time.perf_counter() - t0
            model.eval()
            rows.append({"label": "%s, stages 1 + 2" % label if feature_map != "window" else "%s, stage 2" % label,
                         "bpc": bpc(model), "stage1_s": t1, "stage2_s": t2})
        converted[label] = model

    def on_softmax(model):
        import copy
        m = copy.deepcopy(model)
        m.set_attn_implementation("linattn_softmax")
        return m

    def dynamic(model):
        return transformers.DynamicCache(config=model.config)

    systems = [("teacher, sdpa + DynamicCache", original, dynamic),
               ("teacher, linattn_softmax + DynamicCache", on_softmax(original), dynamic)]
    systems += [("%s + LinattnCache" % label, model, lh.LinattnCache) for label, model in converted.items()]
    gen = {}
    for label, model, make in systems:
        gen[label] = []
        for c in a.gen_contexts:
            sec, size, prefill = generation(model, make, c, a.new_tokens, val)
            gen[label].append({"context": c, "ms_per_token": 1e3 * sec, "cache_mib": size / 2**20,
                               "cache_bytes": size, "prefill_s": prefill})
            if not a.quick:
                print("%s, context %d: %.2f ms/token, cache %.1f MiB, prefill %.1f s" % (label, c, 1e3 * sec,
                                                                                       size / 2**20, prefill), flush=True)
    return {"teacher": info, "unigram_bits": uni, "bigram_bits": bi, "vocab": len(chars), "train_chars": len(train),
            "val_chars": len(val), "rows": rows, "generation": gen, "contexts": a.contexts,
            "gen_contexts": a.gen_contexts, "new_tokens": a.new_tokens, "threads": a.threads,
            "settings": {k: getattr(a, k) for k in ("hidden", "layers", "heads", "train_context", "batch",
                                                    "teacher_seconds", "teacher_lr", "feature_dim", "window", "steps",
                                                    "lr", "finetune_steps", "finetune_lr", "transfer_batch", "texts",
                                                    "eval_windows")},
            "cpu": linattn.build_info(), "torch": torch.__version__, "transformers": transformers.__version__}


def report(r, command):
    s, t = r["settings"], r["teacher"]
    ref = 1024 if 1024 in r["contexts"] else r["contexts"][-1]  # the context of the gap column
    lines = ["",
             "Measured with `%s` (torch %s, transformers %s, %d threads; %s)." % (
                 command, r["torch"], r["transformers"], r["threads"], r["cpu"]), "",
             "**The teacher.** LlamaForCausalLM with rotary positions, %d layers, hidden %d, %d heads, %d parameters, "
             "on characters (%d symbols) of Python's documentation topics: %d for training, %d held out. Trained from "
             "scratch for %.0f s (%d steps of %d × %d characters, AdamW lr %g, cosine decay). Bits per character on the "
             "held-out text (mean over every position of %d windows):" % (
                 s["layers"], s["hidden"], s["heads"], t["parameters"], r["vocab"], r["train_chars"], r["val_chars"],
                 t["seconds"], t["steps"], s["batch"], s["train_context"], s["teacher_lr"], s["eval_windows"]), "",
             "| model | " + " | ".join("bpc at %d" % c for c in r["contexts"]) + " | gap at %d | stage 1 | stage 2 |" % ref,
             "|---" * (len(r["contexts"]) + 4) + "|",
             "| unigram baseline | " + " | ".join("%.3f" % r["unigram_bits"] for _ in r["contexts"]) + " | | | |",
             "| bigram baseline | " + " | ".join("%.3f" % r["bigram_bits"] for _ in r["contexts"]) + " | | | |"]
    base = r["rows"][0]["bpc"]
    for row in r["rows"]:
        gap = row["bpc"][ref] / base[ref] - 1
        lines.append("| %s | %s | %+.1f%% | %s | %s |" % (
            row["label"], " | ".join("%.3f" % row["bpc"][c] for c in r["contexts"]), 100 * gap,
            "%.0f s" % row["stage1_s"] if row["stage1_s"] else "–", "%.0f s" % row["stage2_s"] if row["stage2_s"] else "–"))
    lines += ["",
              "Conversion: stage 1 (attention_transfer) %d steps, lr %g; stage 2 (finetune: KL of the next-character "
              "distributions against the teacher, LoRA rank 8 on q, k, v, the maps and gates trained too) %d steps, "
              "lr %g; batches of %d training slices of %d characters." % (
                  s["steps"], s["lr"], s["finetune_steps"], s["finetune_lr"], s["transfer_batch"], s["train_context"]),
              "",
              "**Generation.** Median time per new token (greedy, one token per forward as generate() runs, after %d "
              "new tokens; the first two left out) and the cache's size after the context (prefilled in one forward):"
              % r["new_tokens"], "",
              "| model | " + " | ".join("%d tokens: ms / MiB" % c for c in r["gen_contexts"]) +
              " | last ÷ first (time) | teacher ÷ this at %d |" % r["gen_contexts"][-1],
              "|---" * (len(r["gen_contexts"]) + 3) + "|"]
    teacher_rows = next(iter(r["generation"].values()))
    for label, rows in r["generation"].items():
        cells = ["%.2f / %.2f" % (row["ms_per_token"], row["cache_mib"]) for row in rows]
        lines.append("| %s | %s | %.2f | %.1f× |" % (label, " | ".join(cells),
                                                    rows[-1]["ms_per_token"] / rows[0]["ms_per_token"],
                                                    teacher_rows[-1]["ms_per_token"] / rows[-1]["ms_per_token"]))
    lines += ["", "Prefill seconds at %d tokens: %s." % (r["gen_contexts"][-1], "; ".join(
        "%s %.1f" % (label, rows[-1]["prefill_s"]) for label, rows in r["generation"].items())), "",
        "![time per token against context](img/linearize_generation_time.png)",
        "![cache size against context](img/linearize_generation_memory.png)", ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/linearize")
    ap.add_argument("--docs", default="docs/linearize.md")
    ap.add_argument("--img", default=None, help="plots' folder (default: docs/img beside --docs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a tiny version (the test's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--train-context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--teacher-seconds", type=float, default=720)
    ap.add_argument("--teacher-lr", type=float, default=2e-3)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--feature-dim", type=int, default=32)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200, help="stage 1 steps")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--finetune-steps", type=int, default=100, help="stage 2 steps (0: none)")
    ap.add_argument("--finetune-lr", type=float, default=1e-3)
    ap.add_argument("--transfer-batch", type=int, default=4)
    ap.add_argument("--texts", type=int, default=400, help="training slices for stages 1 and 2")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--gen-contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--new-tokens", type=int, default=12)
    a = ap.parse_args(argv)
    if a.quick:
        a.hidden, a.layers, a.heads, a.train_context, a.batch, a.teacher_seconds = 32, 2, 2, 64, 2, 3
        a.feature_dim, a.window, a.steps, a.finetune_steps, a.texts, a.log_every = 4, 8, 2, 2, 8, 5
        a.contexts, a.eval_windows, a.gen_contexts, a.new_tokens, a.transfer_batch = [32, 64], 2, [64, 256], 3, 2
    os.makedirs(a.out, exist_ok=True)
    r = run(a)
    (Path(a.out) / "causal_lm.json").write_text(json.dumps(r, indent=1))
    plots(r, Path(a.img) if a.img else Path(a.docs).parent / "img")
    args = " ".join(sys.argv[1:] if argv is None else argv)
    command = "make linearize" if args == "--out out/linearize --docs docs/linearize.md" \
        else "bench/causal_lm.py " + args
    section = report(r, command)
    print(section)
    measured_section.write(a.docs, "causal_lm.py", section)
    if any(not math.isfinite(v) for row in r["rows"] for v in row["bpc"].values()):
        raise SystemExit("a bpc is not finite")


if __name__ == "__main__":
    main()
