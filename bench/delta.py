"""The gated delta rule (linattn.torch.gated_delta_rule, float32) against what transformers runs
on a CPU without it: its own reference PyTorch functions (transformers' Qwen3-Next module,
`torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`, taken from under its
hub/fla dispatch: with fla installed, transformers would call fla's Triton kernels, which fail
on a CPU), on the same inputs ([batch, seq, heads, dim] for theirs, made contiguous before
timing) and threads. l2norm of q and k in the kernel, β uniform in [0, 1], log-gates uniform in
[−0.1, 0], as these models run it.

1. Kernels: forward, and forward + backward (gradients of q, k, v, g, β), at each length;
   the recurrent form only up to 2048 (its forward + backward takes 20 s there, 70 s at 4096).
   KDA (per-channel gates) the same against transformers' chunk_kimi_delta_attention, at
   --kda-lengths.
2. bfloat16 inputs against the same call in float32 (--bf16-length), with the CPU's measured
   bfloat16 dot and float32 FMA peaks.
3. The decoding step (one position from a state), linattn against the recurrent function.
4. A tiny random Qwen3.5 (and Kimi-Linear) model, whole: prefill of 8192 tokens and the median
   time of a decoding step after it (greedy, the models' own caches; each step timed alone, so
   the prefill's noise does not enter), with linattn (linattn.hf.register()) and with
   transformers' functions.

Timing: one warm-up, then the median of at least 5 runs and 1 s (2 runs from n = 16384;
bench/torch_bench.py's time_runs). All forms agree before any timing (relative error below
1e-4 of the output's largest value). FLOPs: the chunk algorithm's forward count per head and
position, 6·d_k·d_v + 4·64·d_k + 3·64·d_v (the state read, the state product and update; the
two 64-wide score products; the triangular solve and the intra-chunk product); the percentage
is of the measured float32 FMA peak on the same threads (linattn.measure_peak_rates).

    make bench-delta    # or: .venv/bin/python bench/delta.py --docs docs/methods/delta.md

Writes the measured section of docs/methods/delta.md (between its MEASURED markers)."""

import argparse
import importlib
import inspect
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402

import linattn  # noqa: E402
import linattn.torch as lt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_section  # noqa: E402
import torch_bench  # noqa: E402

CHUNK = 64


# transformers' functions of each gate form: (module folder, chunk function, recurrent function)
PEERS = {"head": ("qwen3_next", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
         "channel": ("kimi_linear", "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")}


def transformers_functions(gates="head"):
    """transformers' own PyTorch functions (under its hub/fla dispatch), from the module they live in:
    the chunk and recurrent forms, per-head gates (Gated DeltaNet) or per-channel gates (KDA)."""
    folder, *names = PEERS[gates]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module("transformers.models.%s.modeling_%s" % (folder, folder))
    from linattn.hf.delta import ORIGINALS
    return tuple(inspect.unwrap(ORIGINALS.get((module.__name__, n), getattr(module, n))) for n in names)


def flops_per_position(dk, dv):
    return 6 * dk * dv + 4 * CHUNK * dk + 3 * CHUNK * dv


def kernels(a, gates="head", lengths=None):
    """Forward and forward + backward at each length: per-head gates g [B, H, n] against
    transformers' Gated DeltaNet functions, or per-channel gates [B, H, n, d_k] against its KDA ones."""
    chunk, recurrent = transformers_functions(gates)
    rows = []
    for n in lengths or a.lengths:
        gen = torch.Generator().manual_seed(n)
        B, H, d = a.batch, a.heads, a.head_dim
        q, k, v = (torch.randn(B, H, n, d, generator=gen) for _ in range(3))
        g = -0.1 * torch.rand(*((B, H, n) if gates == "head" else (B, H, n, d)), generator=gen)
        beta = torch.rand(B, H, n, generator=gen)
        want = lt.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        theirs = tuple(x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))

        def ours(q, k, v, g, beta):
            return lt.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)

        def peer(fn):
            def call(q, k, v, g, beta):
                return fn(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=True)[0].transpose(1, 2)
            return call

        forms = {"linattn": ((q, k, v, g, beta), ours), "torch chunk": (theirs, peer(chunk))}
        if n <= a.recurrent_up_to:
            forms["torch recurrent"] = (theirs, peer(recurrent))
        for name, (inputs, fn) in forms.items():
            with torch.no_grad():
                got = fn(*inputs)
            err = float((got - want).abs().max() / want.abs().max())
            if err > 1e-4:
                raise SystemExit("%s disagrees with linattn at n = %d: relative error %.3g" % (name, n, err))
            leaves = [x.detach().requires_grad_() for x in inputs]

            def fwd():
                with torch.no_grad():
                    fn(*inputs)

            def fwd_bwd():
                for x in leaves:
                    x.grad = None
                out = fn(*leaves)
                out.backward(torch.ones_like(out))

            rows.append({"n": n, "form": name, "fwd": torch_bench.warm_median_seconds(fwd, n),
                         "bwd": torch_bench.warm_median_seconds(fwd_bwd, n)})
            print(rows[-1], flush=True)
    return rows


def bfloat16_forward(a):
    """linattn's forward on bfloat16 q, k, v, g, β against the same call on their float32 values."""
    n = a.bf16_length
    gen = torch.Generator().manual_seed(n)
    B, H, d = a.batch, a.heads, a.head_dim
    wide = [torch.randn(B, H, n, d, generator=gen) for _ in range(3)]
    wide += [-0.1 * torch.rand(B, H, n, generator=gen), torch.rand(B, H, n, generator=gen)]
    out = {"n": n}
    for name, inputs in (("float32", wide), ("bfloat16", [x.bfloat16() for x in wide])):
        def fwd():
            with torch.no_grad():
                lt.gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)
        out[name] = torch_bench.warm_median_seconds(fwd, n)
    return out


def decode_step(a):
    """One position from a state: linattn's call against transformers' recurrent function."""
    _, recurrent = transformers_functions()
    B, H, d = 1, a.heads, a.head_dim
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, 1, H, d, generator=gen) for _ in range(3))
    g, beta = -0.1 * torch.rand(B, 1, H, generator=gen), torch.rand(B, 1, H, generator=gen)
    state = torch.randn(B, H, d, d, generator=gen)
    from linattn.hf.delta import recurrent_gated_delta_rule
    out = {}
    for name, fn in (("linattn", recurrent_gated_delta_rule), ("torch recurrent", recurrent)):
        def step():
            with torch.no_grad():
                fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                   use_qk_l2norm_in_kernel=True)
        out[name] = torch_bench.warm_median_seconds(step, 1)
    return out


TINY = {
    "Qwen3.5": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
                     linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=1000)),
    "Kimi-Linear": ("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_rope_head_dim=32,
                         qk_nope_head_dim=32, v_head_dim=64, linear_head_dim=64, linear_num_heads=8,
                         layer_types=["linear_attention"] * 3 + ["full_attention"], vocab_size=1000,
                         num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)),
}


def models(a):
    """Prefill and per-token decoding of tiny random models, transformers' functions against linattn's."""
    import transformers
    import linattn.hf
    import linattn.hf.delta as delta
    rows = []
    for label, (folder, config_name, model_name, kwargs) in TINY.items():
        module = importlib.import_module("transformers.models.%s.modeling_%s" % (folder, folder))
        names = delta.replaced_names(module)
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
        ids = torch.randint(3, kwargs["vocab_size"], (1, a.prefill))
        row = {"model": label, "layers": kwargs["num_hidden_layers"], "layer_types": model.config.layer_types}
        for path in ("transformers", "linattn"):
            if path == "transformers":
                for theirs in names:
                    setattr(module, theirs, inspect.unwrap(delta.ORIGINALS.get((module.__name__, theirs),
                                                                               getattr(module, theirs))))
            else:
                linattn.hf.register()
            with torch.no_grad():
                model(ids[:, :128])  # warm-up
                t0 = time.perf_counter()
                out = model(ids, use_cache=True)  # the model's own cache
                prefill = time.perf_counter() - t0
                cache, tokens, steps = out.past_key_values, [], []
                for _ in range(a.new_tokens):  # greedy, one token at a time, each step timed
                    tokens.append(int(out.logits[0, -1].argmax()))
                    t0 = time.perf_counter()
                    out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
                    steps.append(time.perf_counter() - t0)
            row[path] = {"prefill": prefill, "per_token": statistics.median(steps)}
            row.setdefault("tokens", []).append(tokens)
            print(label, path, row[path], flush=True)
        rows.append(row)
    return rows


def kernel_table(rows, lengths, B, H, d, peak, peer):
    """Markdown rows: linattn's forward and forward + backward at each length against the peer's
    chunk and recurrent forms (named "<peer> chunk", "<peer> recurrent")."""
    lines = ["| n | linattn fwd | GFLOP/s (%% of peak) | %s chunk fwd | %s recurrent fwd | linattn fwd+bwd | "
             "%s chunk fwd+bwd | %s recurrent fwd+bwd |" % (peer, peer, peer, peer),
             "|---|---|---|---|---|---|---|---|"]
    by = {(row["n"], row["form"]): row for row in rows}

    def cell(n, form, key):
        row = by.get((n, form))
        if row is None:
            return "–"
        t, mine = row[key], by[(n, "linattn")][key]
        return "%.1f ms" % (1e3 * t) if form == "linattn" else "%.1f ms (%.1f×)" % (1e3 * t, t / mine)

    for n in lengths:
        gf = B * H * n * flops_per_position(d, d) / by[(n, "linattn")]["fwd"] / 1e9
        lines.append("| %d | %s | %.1f (%.0f%%) | %s | %s | %s | %s | %s |" % (
            n, cell(n, "linattn", "fwd"), gf, 100 * gf / peak, cell(n, "torch chunk", "fwd"),
            cell(n, "torch recurrent", "fwd"), cell(n, "linattn", "bwd"), cell(n, "torch chunk", "bwd"),
            cell(n, "torch recurrent", "bwd")))
    return lines


def report(r, command):
    a = r["args"]
    d, H, B = a["head_dim"], a["heads"], a["batch"]
    lines = ["",
             "Measured with `%s` on %d thread(s): batch %d, %d heads, d_k = d_v = %d, float32, l2norm in the kernel, "
             "β uniform in [0, 1], log-gates uniform in [−0.1, 0]; torch %s, transformers %s; CPU features: %s; "
             "linattn: %s; OPENBLAS_CORETYPE %s; float32 FMA peak %.0f GFLOP/s (measured). Medians after a "
             "warm-up (at least 5 runs and 1 s; 2 runs from n = 16384). GFLOP/s: the chunk algorithm's forward "
             "count over linattn's forward time."
             % (command, a["threads"], B, H, d, r["torch"], r["transformers"], r["features"], r["build"],
                r["coretype"] or "unset", r["peak"]), ""]
    lines += kernel_table(r["rows"], a["lengths"], B, H, d, r["peak"], "torch")
    lines += ["", "(×: the peer's time over linattn's; –: not run, the recurrent form's forward + backward takes over "
              "a minute there.)", "",
              "KDA (Kimi Linear: per-channel log-gates [B, H, n, d_k], the same sizes) against transformers' "
              "chunk_kimi_delta_attention (GFLOP/s counted as above, without the per-channel decays' work):", ""]
    lines += kernel_table(r["kda"], a["kda_lengths"], B, H, d, r["peak"], "torch KDA")
    bf = r["bf16"]
    if r["bf16_peak"]:  # measure_peak_rates gives 0 (or nothing) where the CPU has no such products
        products = ("this CPU's bfloat16 pair products (vdpbf16ps) peak at %.0f GFLOP/s against %.0f for float32 "
                    "FMAs (both measured)%s" % (r["bf16_peak"], r["peak"], ", so bfloat16 products would make it "
                                                "slower, not faster" if r["bf16_peak"] < r["peak"] else ""))
    else:
        products = "this CPU has no bfloat16 pair products (no AVX512-BF16) to compute them with"
    lines += ["", "bfloat16 (q, k, v, g, β bfloat16, the state float32) at n = %d: forward %.1f ms against %.1f ms in "
              "float32 (%.2f× float32's speed). linattn computes bfloat16 calls in float32, as transformers' "
              "fallbacks do; %s."
              % (bf["n"], 1e3 * bf["bfloat16"], 1e3 * bf["float32"], bf["float32"] / bf["bfloat16"], products), ""]
    step = r["decode"]
    lines += ["Decoding step (batch 1, %d heads, d_k = d_v = %d, one position from a state, l2norm): linattn "
              "%.3f ms, transformers' torch_recurrent_gated_delta_rule %.3f ms (%.1f×)."
              % (H, d, 1e3 * step["linattn"], 1e3 * step["torch recurrent"], step["torch recurrent"] / step["linattn"]),
              ""]
    lines += ["Whole tiny random models (float32, batch 1; hidden 256, 4 layers, the linear layers 8 value heads of "
              "d = 64; Qwen3.5: 3 Gated DeltaNet layers and 1 attention layer, grouped q/k (4 heads); Kimi-Linear: "
              "3 KDA layers and 1 MLA layer, MoE): prefill of %d tokens, then the median time of a decoding step "
              "(%d greedy tokens after it, one forward each with the models' own caches). The tokens generated "
              "are the same on both paths: %s." % (a["prefill"], a["new_tokens"], "yes" if all(
                  row["tokens"][0] == row["tokens"][1] for row in r["models"]) else "NO"), "",
              "| model | prefill, transformers | prefill, linattn | per token, transformers | per token, linattn |",
              "|---|---|---|---|---|"]
    for row in r["models"]:
        t, mine = row["transformers"], row["linattn"]
        lines.append("| %s | %.0f ms | %.0f ms (%.1f×) | %.2f ms | %.2f ms (%.1f×) |" % (
            row["model"], 1e3 * t["prefill"], 1e3 * mine["prefill"], t["prefill"] / mine["prefill"],
            1e3 * t["per_token"], 1e3 * mine["per_token"], t["per_token"] / mine["per_token"]))
    lines += ["", "(×: transformers' time over linattn's.)", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default="docs/methods/delta.md")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--recurrent-up-to", type=int, default=2048)
    ap.add_argument("--kda-lengths", type=int, nargs="+", default=[4096], help="per-channel gates (KDA)")
    ap.add_argument("--bf16-length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a test)")
    a = ap.parse_args()
    if a.quick:
        a.lengths, a.heads, a.head_dim, a.prefill, a.new_tokens = [70], 2, 8, 100, 3
        a.kda_lengths, a.bf16_length = [70], 70
    torch.set_num_threads(a.threads)
    linattn.set_num_threads(a.threads)
    import transformers
    peaks = linattn.measure_peak_rates(a.threads)
    r = {"rows": kernels(a), "kda": kernels(a, "channel", a.kda_lengths), "bf16": bfloat16_forward(a),
         "decode": decode_step(a), "models": models(a), "args": vars(a),
         "torch": torch.__version__, "transformers": transformers.__version__, "build": linattn.build_info(),
         "cpu": platform.processor() or platform.machine(), "features": torch_bench.cpu_features(),
         "peak": peaks["float32_fma_gflops"], "bf16_peak": peaks.get("bfloat16_dot_gflops"),
         "coretype": os.environ.get("OPENBLAS_CORETYPE")}
    args = " ".join(sys.argv[1:])
    section = report(r, "make bench-delta" if args == "--docs docs/methods/delta.md" else "bench/delta.py " + args)
    print(section)
    if a.docs and not a.quick:
        measured_section.write(a.docs, "delta.py", section)


if __name__ == "__main__":
    main()
