"""Converting all-MiniLM-L6-v2 to linear attention with learned feature maps (linattn.hf.linearize
and attention_transfer): how close its sentence embeddings stay to the original's, by length,
and retrieval recall, zero-shot and after stage 1, with the conversion's wall time: Hedgehog's
maps alone, the window alone (exact softmax within ±w, nothing beyond), and the hybrid of both.

    make linearize       # or: .venv/bin/python bench/linearize.py --out out/linearize --docs docs/linearize.md

Writes the measured section of docs/linearize.md (between its MEASURED markers) and the raw
results as JSON in --out. --quick runs a tiny version (the test's). Text: the English prose on
the machine (bench/models.py's passages: Python's documentation topics and Debian's READMEs);
the transfer trains on one half of the passages and every figure is measured on the other."""

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
import transformers  # noqa: E402

import linattn  # noqa: E402
import linattn.hf as lh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_section  # noqa: E402
import models  # noqa: E402  (passages, load, embed_all, recall, split_halves)

BUCKETS = [(1, 128), (129, 256), (257, 384), (385, 512)]


def evaluate(model, tok, texts, lengths, base, base_q, base_d):
    """Cosine of the embeddings to the original's (mean and worst, overall and per length
    bucket) and recall@1/@10 of the split-passage retrieval."""
    emb = models.embed_all(model, tok, texts)
    cos = (emb * base).sum(1)
    buckets = {}
    for lo, hi in BUCKETS:
        sel = torch.tensor([lo <= n <= hi for n in lengths])
        if bool(sel.any()):
            buckets["%d-%d" % (lo, hi)] = {"mean": float(cos[sel].mean()), "min": float(cos[sel].min()),
                                           "count": int(sel.sum())}
    queries, docs = models.split_halves(texts)
    return {"cos_mean": float(cos.mean()), "cos_min": float(cos.min()), "buckets": buckets,
            "recall": models.recall(models.embed_all(model, tok, queries), models.embed_all(model, tok, docs))}


def run(a):
    torch.set_num_threads(a.threads)
    linattn.set_num_threads(a.threads)
    lh.register()
    tok = transformers.AutoTokenizer.from_pretrained(models.MODEL_PATH)
    passages = models.passages(tok, a.passages, max_tokens=a.max_tokens)
    train = [t for _, t, _ in passages[: len(passages) // 2]]
    held = passages[len(passages) // 2:]
    texts, lengths = [t for _, t, _ in held], [n for _, _, n in held]
    original = models.load("sdpa")
    base = models.embed_all(original, tok, texts)
    queries, docs = models.split_halves(texts)
    base_q, base_d = models.embed_all(original, tok, queries), models.embed_all(original, tok, docs)
    rows = [{"label": "original (transformers sdpa)", **evaluate(original, tok, texts, lengths, base, base_q, base_d),
             "convert_s": 0.0}]
    def stage2(model, label, t_start):
        """Stage 2 (finetune: distillation against the original, LoRA) on a converted model."""
        t0 = time.perf_counter()
        losses = lh.finetune(model, original, tok, train, steps=a.finetune_steps, lr=a.finetune_lr,
                             batch_size=a.batch_size, max_length=a.train_tokens, progress=not a.quick)
        seconds = time.perf_counter() - t0
        rows.append({"label": label + ", stages 1 + 2 (%d distillation steps)" % a.finetune_steps,
                     **evaluate(model, tok, texts, lengths, base, base_q, base_d),
                     "convert_s": seconds + t_start, "distill_first": losses[0], "distill_last": losses[-1]})

    favor = models.load("linattn_favor", {"num_features": 256})
    rows.append({"label": "FAVOR+ m=256, zero-shot", **evaluate(favor, tok, texts, lengths, base, base_q, base_d),
                 "convert_s": 0.0})
    if a.finetune_steps:
        for p in favor.parameters():
            p.requires_grad_(False)
        stage2(favor, "FAVOR+ m=256 (no stage 1: nothing to transfer)", 0.0)
    configs = [("hedgehog", 0, f) for f in a.feature_dims] + [("window", a.window, 0)] + \
              [("hedgehog", a.window, f) for f in a.feature_dims]
    for feature_map, window, f in configs:
        label = {"hedgehog": "hedgehog f=%d" % f, "window": "window only"}[feature_map]
        if window and feature_map != "window":
            label += " + window"
        if window:
            label += " w=%d" % window
        model = lh.linearize(models.load("sdpa"), feature_map=feature_map, window=window, feature_dim=max(f, 1))
        rows.append({"label": label + ", zero-shot", **evaluate(model, tok, texts, lengths, base, base_q, base_d),
                     "convert_s": 0.0})
        seconds = 0.0
        if lh.learned_parameters(model):  # the window alone learns nothing in stage 1
            t0 = time.perf_counter()
            losses = lh.attention_transfer(model, tok, train, steps=a.steps, lr=a.lr, batch_size=a.batch_size,
                                           max_length=a.train_tokens, progress=not a.quick)
            seconds = time.perf_counter() - t0
            rows.append({"label": label + ", stage 1 (%d steps)" % a.steps,
                         **evaluate(model, tok, texts, lengths, base, base_q, base_d), "convert_s": seconds,
                         "layer_loss_first": [l[0] for l in losses], "layer_loss_last": [l[-1] for l in losses]})
        if a.finetune_steps:
            stage2(model, label, seconds)
    return {"rows": rows, "train_passages": len(train), "eval_passages": len(texts), "steps": a.steps, "lr": a.lr,
            "batch_size": a.batch_size, "max_tokens": a.max_tokens, "train_tokens": a.train_tokens,
            "finetune_steps": a.finetune_steps, "finetune_lr": a.finetune_lr, "window": a.window, "threads": a.threads,
            "torch": torch.__version__, "transformers": transformers.__version__}


def report(r, command):
    lines = ["",
             "Measured with `%s` (torch %s, transformers %s, %d threads): training on %d passages, every figure on "
             "%d held-out passages (up to %d tokens). Stage 1 (attention_transfer): %d Adam steps, lr %g; stage 2 "
             "(finetune: distillation of the last hidden states against the original, LoRA rank 8 on the query, "
             "key and value projections, the maps and gates trained too): %d steps, lr %g; batches of %d passages "
             "truncated to %d tokens. Conversion: the wall time of stages 1 and 2."
             % (command, r["torch"], r["transformers"], r["threads"], r["train_passages"], r["eval_passages"],
                r["max_tokens"], r["steps"], r["lr"], r["finetune_steps"], r["finetune_lr"], r["batch_size"],
                r["train_tokens"]), ""]
    buckets = ["%d-%d" % b for b in BUCKETS]
    lines.append("| model | cosine mean | worst | " + " | ".join("mean %s tokens" % b for b in buckets) +
                 " | recall@1 | recall@10 | conversion |")
    lines.append("|---" * (7 + len(buckets)) + "|")
    for row in r["rows"]:
        cells = [row["label"], "%.3f" % row["cos_mean"], "%.3f" % row["cos_min"]]
        cells += ["%.3f" % row["buckets"][b]["mean"] if b in row["buckets"] else "–" for b in buckets]
        cells += ["%.2f" % row["recall"][1], "%.2f" % row["recall"][10],
                  "%.0f s" % row["convert_s"] if row["convert_s"] else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for row in r["rows"]:
        if "layer_loss_last" in row:
            lines.append("%s: per-layer transfer loss (MSE against softmax) %s at the first step, %s at the last."
                         % (row["label"], ", ".join("%.3g" % x for x in row["layer_loss_first"]),
                            ", ".join("%.3g" % x for x in row["layer_loss_last"])))
    lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/linearize")
    ap.add_argument("--docs", default="docs/linearize.md")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a tiny version (the test's)")
    ap.add_argument("--passages", type=int, default=200, help="half trains, half is measured")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--feature-dims", type=int, nargs="+", default=[32])
    ap.add_argument("--window", type=int, default=32, help="the hybrid's and the window-only baseline's window")
    ap.add_argument("--train-tokens", type=int, default=512,
                    help="training batches truncated to this many tokens (the maps follow softmax at the lengths "
                         "they were fitted on: train at the longest the model will see)")
    ap.add_argument("--finetune-steps", type=int, default=100, help="stage 2 steps (0: no stage 2)")
    ap.add_argument("--finetune-lr", type=float, default=1e-4)
    a = ap.parse_args()
    if a.quick:
        a.passages, a.steps, a.batch_size, a.max_tokens, a.feature_dims, a.window = 12, 3, 2, 64, [4], 4
        a.train_tokens, a.finetune_steps = 64, 2
    os.makedirs(a.out, exist_ok=True)
    r = run(a)
    (Path(a.out) / "linearize.json").write_text(json.dumps(r, indent=1))
    args = " ".join(sys.argv[1:])
    section = report(r, "make linearize" if args == "--out out/linearize --docs docs/linearize.md"
                     else "bench/linearize.py " + args)
    print(section)
    measured_section.write(a.docs, "linearize.py", section, create=True)
    if any(not math.isfinite(row["cos_mean"]) for row in r["rows"]):
        raise SystemExit("a cosine is not finite")


if __name__ == "__main__":
    main()
