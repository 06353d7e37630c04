"""Character-level language models trained from scratch with each attention method, for the same
wall-time budget: validation bits per character against training time (docs/models.md).

The model is examples/train_char_lm.py's CharLM (pre-LayerNorm blocks around
linattn.torch.MultiheadAttention, learned positions), so the study trains what the example
shows; the text is Python's documentation topics (pydoc_data, shipped with the interpreter).

    .venv/bin/python bench/charlm.py --out out/models [--budget 150] [--quick]"""

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import linattn  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "train_char_lm", Path(__file__).resolve().parents[1] / "examples" / "train_char_lm.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
CharLM = example.CharLM

# (label, MultiheadAttention method, its options)
DEFAULT_CONFIGS = [
    ("exact", "softmax", {}),
    ("FAVOR+ orthogonal m=128", "favor", {"num_features": 128, "features": "orthogonal"}),
    ("FAVOR+ quantile m=128", "favor", {"num_features": 128, "features": "quantile"}),
    ("elu+1", "elu", {}),
    ("focused p=3, conv 5", "focused", {"conv_kernel_size": 5}),
]
PROMPT = "The for statement"


def text():
    """Python's documentation topics in key order, and the split: 90% train, 10% validation."""
    import pydoc_data.topics
    t = "\n\n".join(v for _, v in sorted(pydoc_data.topics.topics.items()))
    chars = sorted(set(t))
    code = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([code[c] for c in t])
    cut = int(0.9 * len(ids))
    return chars, ids[:cut], ids[cut:]


def windows(data, starts, context):
    x = torch.stack([data[s:s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + context + 1] for s in starts.tolist()])
    return x, y


@torch.no_grad()
def bits_per_char(model, val, context, count):
    """Mean cross-entropy (bits) of `count` evenly spaced validation windows: the same for every model."""
    model.eval()
    starts = torch.linspace(0, len(val) - context - 2, count).long()
    x, y = windows(val, starts, context)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    model.train()
    return float(loss) / math.log(2)


def check_recurrent(model, ids):
    """The recurrent path (MultiheadAttention.step, layer by layer) gives the full causal forward's
    logits: max difference ≤ 2^-12 of the largest logit (float32 rounding through a few layers;
    a wrong state or position is O(1))."""
    model.eval()
    with torch.no_grad():
        full = model(ids)[0]
        states = [b.attn.init_state(1) for b in model.blocks]
        rows = []
        for t in range(ids.shape[1]):
            x = model.embed(ids[:, t]) + model.pos[t]
            for b, s in zip(model.blocks, states):
                x = b.step(x, s)
            rows.append(model.head(x)[0])
    diff = (torch.stack(rows) - full).abs().max()
    assert diff <= 2.0 ** -12 * full.abs().max(), "recurrent decoding differs from the causal forward by %g" % diff
    return float(diff)


def train(label, method, options, data, budget_s, context, d_model, n_layers, n_heads, batch_size, lr=2e-3,
          seed=0, evals=12, eval_windows=16, progress=print):
    """Trains one model for budget_s seconds of training time (evaluations excluded)."""
    chars, train_ids, val = data
    torch.manual_seed(seed)
    model = CharLM(len(chars), method, dim=d_model, heads=n_heads, layers=n_layers, context=context, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    warmup = 30
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    g = torch.Generator().manual_seed(seed)
    curve = [(0.0, bits_per_char(model, val, context, eval_windows))]
    spent, steps, next_eval = 0.0, 0, budget_s / evals
    while spent < budget_s:
        t = time.perf_counter()
        x, y = windows(train_ids, torch.randint(0, len(train_ids) - context - 1, (batch_size,), generator=g), context)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        spent += time.perf_counter() - t
        steps += 1
        if spent >= next_eval or spent >= budget_s:
            curve.append((spent, bits_per_char(model, val, context, eval_windows)))
            next_eval += budget_s / evals
            progress("%-26s %6.0f s  step %5d  validation %.3f bpc" % (label, spent, steps, curve[-1][1]))
    model.eval()
    prompt = [chars.index(c) for c in PROMPT]
    recurrent = method != "softmax"
    sample = model.sample(prompt, 120, recurrent, torch.Generator().manual_seed(seed))
    return {"name": label, "method": method, "options": options,
            "params": sum(p.numel() for p in model.parameters()), "steps": steps,
            "tokens_seen": steps * batch_size * context, "train_s": spent, "curve": curve,
            "final_bpc": curve[-1][1], "tokens_per_s": steps * batch_size * context / spent,
            "sample": PROMPT + "".join(chars[i] for i in sample), "decoding": "recurrent" if recurrent else "full forward"}


def run(out_dir, budget_s=150, context=1024, d_model=128, n_layers=2, n_heads=4, batch_size=8, threads=2, seed=0,
        progress=print, configs=None):
    """Trains every config for budget_s; writes charlm_bpc.png and charlm.json in out_dir."""
    torch.set_num_threads(threads)
    linattn.set_num_threads(threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = text()
    results = [train(label, method, options, data, budget_s, context, d_model, n_layers, n_heads, batch_size,
                     seed=seed, progress=progress)
               for label, method, options in (configs or DEFAULT_CONFIGS)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([t for t, _ in r["curve"]], [b for _, b in r["curve"]], marker=".", label=r["name"])
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("validation bits per character")
    ax.set_ylim(top=min(8.0, max(r["curve"][1][1] if len(r["curve"]) > 1 else 8.0 for r in results) + 0.5))
    ax.set_title("char-LM from scratch: context %d, d_model %d, %d layers, %g s each, %d threads"
                 % (context, d_model, n_layers, budget_s, threads), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "charlm_bpc.png", dpi=110)
    plt.close(fig)
    (out_dir / "charlm.json").write_text(json.dumps(results, indent=1))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/models")
    ap.add_argument("--budget", type=float, default=150)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 s per model, context 128, d_model 32, 1 layer")
    a = ap.parse_args()
    if a.quick:
        run(a.out, budget_s=3, context=128, d_model=32, n_layers=1, n_heads=2, batch_size=4, threads=a.threads)
    else:
        run(a.out, budget_s=a.budget, context=a.context, threads=a.threads)


if __name__ == "__main__":
    sys.exit(main())
