"""What bfloat16 and float16 cost each method: the distance of a 16-bit call's output and
gradients to float64, on the same float32 inputs, next to float32's own.

A user with float32 activations who casts them to bfloat16 loses the inputs' low bits (relative
2^-9 on average, 2^-8 at most) and gets the output rounded once more; the computation in
between runs in float32. So the error is mostly the inputs' rounding carried through the
method, which depends on how sharply it weights them (softmax logits scale as |q||k|).

    .venv/bin/python bench/precision.py --docs docs/precision.md      (make precision)

writes the table between docs/precision.md's MEASURED markers. Errors are max|x − x64| /
max|x64| over the whole tensor: B = 2, H = 4, n = 1024, d = 64, q, k, v ~ N(0, 1) (seeded)."""

import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

import linattn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_section  # noqa: E402

DTYPES = [("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)]


def cases(n, d, causal, heads):
    """(label, forward(q, k, v, *t), backward(q, k, v, dout, *t), extra tensors as float64)."""
    w = linattn.random_features(256, d, dtype=np.float64)
    e, f = linattn.linformer_projections(64, n, dtype=np.float64)
    conv = np.random.default_rng(9).standard_normal((heads, 3)) * 0.1
    c = {"causal": causal}
    out = [
        ("softmax", lambda q, k, v: linattn.softmax_attention(q, k, v, **c),
         lambda q, k, v, g: linattn.softmax_attention_backward(q, k, v, g, **c), []),
        ("elu", lambda q, k, v: linattn.linear_attention(q, k, v, **c),
         lambda q, k, v, g: linattn.linear_attention_backward(q, k, v, g, **c), []),
        ("focused p=3", lambda q, k, v, wc: linattn.linear_attention(q, k, v, feature_map="focused", conv_weight=wc, **c),
         lambda q, k, v, g, wc: linattn.linear_attention_backward(q, k, v, g, feature_map="focused", conv_weight=wc,
                                                                  **c), [conv]),
        ("favor+ m=256", lambda q, k, v, w: linattn.favor_attention(q, k, v, w, **c),
         lambda q, k, v, g, w: linattn.favor_attention_backward(q, k, v, w, g, **c), [w]),
        ("hybrid elu w=64", lambda q, k, v: linattn.hybrid_attention(q, k, v, window=64, **c),
         lambda q, k, v, g: linattn.hybrid_attention_backward(q, k, v, g, window=64, **c), []),
    ]
    if not causal:
        out += [
            ("nystrom l=64", lambda q, k, v, wc: linattn.nystrom_attention(q, k, v, num_landmarks=64, conv_weight=wc),
             lambda q, k, v, g, wc: linattn.nystrom_attention_backward(q, k, v, g, num_landmarks=64, conv_weight=wc),
             [conv]),
            ("linformer s=64", lambda q, k, v, e, f: linattn.linformer_attention(q, k, v, e, f),
             lambda q, k, v, g, e, f: linattn.linformer_attention_backward(q, k, v, e, f, g), [e, f]),
            ("efficient", lambda q, k, v: linattn.efficient_attention(q, k, v),
             lambda q, k, v, g: linattn.efficient_attention_backward(q, k, v, g), []),
        ]
    return out


def relative(x, ref):
    return float(np.abs(x.astype(np.float64) - ref).max() / np.abs(ref).max())


def measure(n=1024, d=64, batch=2, heads=4):
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((batch, heads, n, d)).astype(np.float32) for _ in range(4))
    rows = []
    for causal in (False, True):
        for label, fwd, bwd, extra in cases(n, d, causal, heads):
            args64 = [x.astype(np.float64) for x in (q, k, v)]
            ref_out = fwd(*args64, *extra)
            ref_grads = bwd(*args64, g.astype(np.float64), *extra)
            row = {"method": label + (" (causal)" if causal else "")}
            for name, dt in DTYPES:
                args = [x.astype(dt) for x in (q, k, v)]
                ex = [t.astype(dt) for t in extra]
                row[name + " out"] = relative(fwd(*args, *ex), ref_out)
                grads = bwd(*args, g.astype(dt), *ex)
                row[name + " dq"] = relative(grads[0], ref_grads[0])
                row[name + " dv"] = relative(grads[2], ref_grads[2])
            rows.append(row)
    return rows


def table(rows):
    cols = ["out", "dq", "dv"]
    head = "| method | " + " | ".join("%s %s" % (n, c) for n, _ in DTYPES for c in cols) + " |"
    lines = [head, "|" + "---|" * (1 + 3 * len(DTYPES))]
    for r in rows:
        lines.append("| %s | " % r["method"] + " | ".join("%.1e" % r["%s %s" % (n, c)] for n, _ in DTYPES for c in cols)
                     + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", help="the page whose MEASURED section gets the table")
    ap.add_argument("--n", type=int, default=1024)
    a = ap.parse_args()
    rows = measure(a.n)
    text = table(rows)
    print(text)
    if a.docs:
        body = ("Relative to max|x64| over the tensor; B = 2, H = 4, n = %d, d = 64, q, k, v, dout ~ N(0, 1) in "
                "float32, then cast (command: `make precision`).\n\n%s" % (a.n, text))
        measured_section.write(a.docs, "precision.py", body, create=False)


if __name__ == "__main__":
    main()
