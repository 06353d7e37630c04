"""Train a small character language model with linattn.torch.MultiheadAttention on text that
Python itself ships (the source of the standard library's `textwrap`, `string` and `shlex`
modules), for exact, FAVOR+ and elu attention; print the loss going down, then decode a sample,
with the recurrent (constant-memory) path for the linear methods.

Usage: .venv/bin/python examples/train_char_lm.py [--steps 300] [--methods softmax,favor,elu]
A few minutes on 2 cores at the defaults; tests/test_example.py runs it for a few steps."""
import argparse
import inspect
import shlex
import string
import textwrap
import time

import torch

import linattn.torch as lt


def corpus():
    return "".join(inspect.getsource(m) for m in (textwrap, string, shlex))


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal attention, then an MLP."""

    def __init__(self, dim, heads, method, **opts):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = lt.MultiheadAttention(dim, heads, method, **opts)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x), is_causal=True)
        return x + self.mlp(self.norm2(x))

    def step(self, x_t, state):
        x_t = x_t + self.attn.step(self.norm1(x_t), state)
        return x_t + self.mlp(self.norm2(x_t))


class CharLM(torch.nn.Module):
    def __init__(self, vocab, method, dim=64, heads=4, layers=2, context=128, **opts):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(context, dim))
        self.blocks = torch.nn.ModuleList(Block(dim, heads, method, **opts) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx):  # [B, n] -> logits [B, n, vocab]
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    @torch.no_grad()
    def sample(self, prompt, length, recurrent, generator):
        """Samples up to `length` tokens (within the context the positions cover); recurrent: one
        token at a time through the blocks' decoding states."""
        idx = list(prompt)
        length = min(length, self.pos.shape[0] - len(prompt))
        if recurrent:
            states = [b.attn.init_state(1) for b in self.blocks]
            for t in range(len(prompt) + length - 1):
                x = self.embed(torch.tensor([idx[t]])) + self.pos[t]
                for b, s in zip(self.blocks, states):
                    x = b.step(x, s)
                if t >= len(prompt) - 1:
                    probs = torch.softmax(self.head(x)[0], -1)
                    idx.append(int(torch.multinomial(probs, 1, generator=generator)))
        else:
            for _ in range(length):
                logits = self(torch.tensor([idx[-self.pos.shape[0]:]]))[0, -1]
                idx.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
        return idx[len(prompt):]


def train(method, text, steps, batch=16, context=128, seed=0, log=print):
    torch.manual_seed(seed)
    chars = sorted(set(text))
    code = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([code[c] for c in text])
    opts = {"num_features": 64} if method == "favor" else {}
    model = CharLM(len(chars), method, context=context, **opts)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + context] for s in starts])
        y = torch.stack([data[s + 1:s + context + 1] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            log("%-8s step %4d  loss %.3f  (%.0f s)" % (method, step, losses[-1], time.perf_counter() - start))
    model.eval()
    recurrent = method != "softmax"
    prompt = [code[c] for c in "def "]
    sample = model.sample(prompt, 80, recurrent, torch.Generator().manual_seed(seed))
    log("%-8s sample (%s): %r" % (method, "recurrent" if recurrent else "full forward",
                                  "def " + "".join(chars[i] for i in sample)))
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--methods", default="softmax,favor,elu")
    args = p.parse_args()
    text = corpus()
    print("corpus: %d characters, %d distinct" % (len(text), len(set(text))))
    for method in args.methods.split(","):
        losses = train(method, text, args.steps)
        head, tail = sum(losses[:10]) / min(10, len(losses)), sum(losses[-10:]) / min(10, len(losses))
        print("%-8s mean loss of the first 10 steps %.3f, of the last 10 %.3f" % (method, head, tail))


if __name__ == "__main__":
    main()
