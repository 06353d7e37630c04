"""linattn.torch.distributed against linattn.torch's single-process result, on 1, 2 and 4
processes (torch.multiprocessing spawn, gloo on the loopback interface): forward, every
gradient, causal and not, both layouts, uneven blocks, padding that ends inside, at and before
a rank's block; the payload counted; bad input raising on every rank.

Each world size is one spawn that runs every case (spawning costs seconds; the cases are
small); the processes write what they got to files and the tests here compare.

Tolerance (float64): a compared value is a sum of at most N = 2^16 rounded products (n = 37
positions, m' <= 2·16 features, d + d_v = 14, over two blocks of the ring or sums of states)
taken in another order than the single-process kernel, each product within u = 2^-53; with
the inputs' weights summing to at most κ = 2^4 times the result's largest magnitude, the
difference is below N·u·κ = 2^-33 times the largest magnitude of the reference tensor. float32
(two cases): the same with u = 2^-24 and N = 2^8 per value along the kernel's own blocks,
2^-12."""
import inspect
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import linattn
import linattn.torch as lt

B, H, N, D, DV = 2, 2, 37, 8, 6
# Contiguous blocks of uneven sizes; in 4 ranks, rank 1's single position makes rank 2's
# 3-row halo (K = 4, causal) span two ranks.
SIZES = {1: [37], 2: [25, 12], 4: [5, 1, 20, 11]}
THREADS = {1: 4, 2: 3, 4: 1}  # linattn threads per process: above and below B·H = 4
TOL64, TOL32 = 2.0 ** -33, 2.0 ** -12
POSITIONAL = ("projection", "e", "f", "query_weight", "query_bias", "key_weight", "key_bias", "g", "beta")
# per-position arguments: each rank passes its rows
ROWS = ("query_features", "key_features", "g", "beta")
# A run of every case takes seconds; these limits only turn a hang into a failure that says so.
COLLECTIVE_TIMEOUT_S = 300
SPAWN_LIMIT_S = 900

CASES = {
    "softmax": ("softmax_attention", dict(key_lengths=[37, 23]), "contiguous"),
    "softmax_causal": ("softmax_attention", dict(causal=True, key_lengths=[37, 4]), "contiguous"),
    "softmax_causal_zigzag": ("softmax_attention", dict(causal=True), "zigzag"),
    "softmax_scale_zigzag": ("softmax_attention", dict(scale=0.2, key_lengths=[30, 9]), "zigzag"),
    "softmax_causal_f32": ("softmax_attention", dict(causal=True, key_lengths=[37, 23], dtype=torch.float32),
                           "contiguous"),
    "elu": ("linear_attention", dict(key_lengths=[37, 23]), "contiguous"),
    "elu_causal": ("linear_attention", dict(causal=True, key_lengths=[37, 4]), "contiguous"),
    "relu_causal_zigzag": ("linear_attention", dict(feature_map="relu", causal=True), "zigzag"),
    "focused_causal_dwc": ("linear_attention", dict(feature_map="focused", causal=True, key_lengths=[37, 23],
                                                    dwc=4), "contiguous"),
    "focused_dwc_zigzag": ("linear_attention", dict(feature_map="focused", focus_power=5.0, key_lengths=[37, 23],
                                                    dwc=5), "zigzag"),
    "favor": ("favor_attention", dict(key_lengths=[37, 23]), "contiguous"),
    "favor_causal": ("favor_attention", dict(causal=True), "contiguous"),
    "favor_hyperbolic_causal_zigzag": ("favor_attention", dict(kernel="hyperbolic", causal=True,
                                                               key_lengths=[37, 4]), "zigzag"),
    "favor_trig": ("favor_attention", dict(kernel="trig", key_lengths=[37, 23]), "contiguous"),
    "favor_f32": ("favor_attention", dict(key_lengths=[37, 23], dtype=torch.float32), "contiguous"),
    "given_causal": ("linear_attention", dict(feature_map="given", causal=True, key_lengths=[37, 23],
                                                 positive=True), "contiguous"),
    "hedgehog": ("hedgehog_attention", dict(key_lengths=[37, 23], hedgehog=5), "contiguous"),
    "hedgehog_causal_zigzag": ("hedgehog_attention", dict(causal=True, key_lengths=[37, 4], hedgehog=3), "zigzag"),
    # Windows of 3 and 8 rows reach over rank 1's single row in 4 ranks, and over whole ranks.
    "hybrid_elu": ("hybrid_attention", dict(window=3, key_lengths=[37, 23], gate=True), "contiguous"),
    "hybrid_given_causal": ("hybrid_attention", dict(window=4, causal=True, key_lengths=[37, 4], given=6,
                                                     gate=True), "contiguous"),
    "hybrid_relu_causal_zigzag": ("hybrid_attention", dict(window=8, feature_map="relu", causal=True,
                                                           scale=0.5), "zigzag"),
    "hybrid_given_wide_zigzag": ("hybrid_attention", dict(window=8, key_lengths=[30, 9], given=4, gate=True),
                                 "zigzag"),
    "hybrid_no_window": ("hybrid_attention", dict(window=0, causal=True, key_lengths=[37, 23]), "contiguous"),
    "hybrid_focused_causal_zigzag": ("hybrid_attention", dict(window=4, feature_map="focused", focus_power=2.0,
                                                              causal=True, key_lengths=[37, 23], gate=True), "zigzag"),
    "hybrid_f32": ("hybrid_attention", dict(window=3, causal=True, key_lengths=[37, 23], gate=True,
                                            dtype=torch.float32), "contiguous"),
    # A nearly closed gate (γ = sigmoid(−16) ≈ 1e-7) with items no longer than the window: the
    # linear part must sum only the keys outside the window (a total minus the window's would
    # leave its rounding over a denominator of γ).
    "hybrid_closed_gate_f32": ("hybrid_attention", dict(window=8, causal=True, key_lengths=[37, 6], given=4,
                                                        gate=-16.0, dtype=torch.float32), "contiguous"),
    "hybrid_closed_gate_zigzag": ("hybrid_attention", dict(window=6, key_lengths=[37, 5], gate=-16.0), "zigzag"),
    # FAVOR's features: an unshifted window, each row shifted by R_i over ranks.
    "hybrid_favor": ("hybrid_attention", dict(window=3, key_lengths=[37, 23], gate=True, favor="positive"),
                     "contiguous"),
    "hybrid_favor_hyperbolic_causal_zigzag": ("hybrid_attention", dict(window=4, causal=True, key_lengths=[37, 4],
                                                                       favor="hyperbolic"), "zigzag"),
    "hybrid_favor_no_window_f32": ("hybrid_attention", dict(window=0, key_lengths=[37, 23], favor="positive",
                                                            dtype=torch.float32), "contiguous"),
    "efficient": ("efficient_attention", dict(key_lengths=[37, 4]), "contiguous"),
    "efficient_zigzag": ("efficient_attention", dict(scale=0.5), "zigzag"),
    "linformer": ("linformer_attention", dict(key_lengths=[37, 23], e_shape=(5, 40)), "contiguous"),
    "linformer_heads_zigzag": ("linformer_attention", dict(e_shape=(H, 5, 37)), "zigzag"),
    # The gated delta rule: per-head gates; KDA's per-channel gates with grouped q/k heads (one
    # key head for both value heads); float32 with keys of norm <= 1 and no l2norm in the kernel.
    "delta": ("gated_delta_rule", dict(use_qk_l2norm_in_kernel=True), "contiguous"),
    "delta_kda_grouped_zigzag": ("gated_delta_rule", dict(use_qk_l2norm_in_kernel=True, kda=True, grouped=True),
                                 "zigzag"),
    "delta_unit_keys_f32": ("gated_delta_rule", dict(scale=0.5, unit_keys=True, dtype=torch.float32), "contiguous"),
}


def inputs(name):
    """The whole sequence's inputs of a case (the same in every process): q, k, v, dout,
    keyword arguments (tensors included), and the names of parameters with gradients."""
    function, opts, _ = CASES[name]
    opts = dict(opts)
    dtype = opts.pop("dtype", torch.float64)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = 0.7 * r(B, H, N, D), 0.7 * r(B, H, N, D), r(B, H, N, DV)
    dout = r(B, H, N, DV)
    if function == "hybrid_attention":  # large scores, so that the window's row maximum matters
        q, k = 2 * q, 2 * k
    params = []
    if "dwc" in opts:
        opts["conv_weight"] = 0.5 * r(H, opts.pop("dwc"))
        params.append("conv_weight")
    if opts.pop("positive", False):  # features given as q and k
        q, k = q.exp(), k.exp()
    if "hedgehog" in opts:
        f = opts.pop("hedgehog")
        for side in ("query", "key"):
            opts[side + "_weight"], opts[side + "_bias"] = 0.5 * r(H, D, f), 0.5 * r(H, f)
            params += [side + "_weight", side + "_bias"]
    if "given" in opts:
        m = opts.pop("given")
        opts.update(feature_map="given", query_features=(0.5 * r(B, H, N, m)).exp(),
                    key_features=(0.5 * r(B, H, N, m)).exp())
        params += ["query_features", "key_features"]
    gate = opts.pop("gate", False)
    if gate is not False:
        opts["window_gate"] = r(H) if gate is True else torch.full((H,), gate, dtype=torch.float64)
        params.append("window_gate")
    if function == "favor_attention":
        opts["projection"] = torch.from_numpy(linattn.random_features(16, D, seed=3))
    if "favor" in opts:
        opts.update(feature_map="favor", kernel=opts.pop("favor"),
                    projection=torch.from_numpy(linattn.random_features(16, D, seed=3)))
        q, k = q / 2, k / 2  # FAVOR's estimate at the hybrid's larger scores would be noise
    if "e_shape" in opts:
        shape = opts.pop("e_shape")
        opts["e"], opts["f"] = 0.3 * r(*shape), 0.3 * r(*shape)
        params += ["e", "f"]
    if function == "gated_delta_rule":
        if opts.pop("grouped", False):
            q, k = q[:, :1], k[:, :1]
        if opts.pop("unit_keys", False):  # |k| <= 1: every transition a contraction without l2norm
            k = k / (1.5 * k.norm(dim=-1, keepdim=True))
        opts["g"] = -0.3 * torch.rand(*((B, H, N, D) if opts.pop("kda", False) else (B, H, N)), generator=gen,
                                      dtype=torch.float64)
        opts["beta"] = 2 * torch.rand(B, H, N, generator=gen, dtype=torch.float64)  # OLMo-hybrid's [0, 2]
        params += ["g", "beta"]
    cast = lambda x: x.to(dtype)  # noqa: E731
    opts = {key: cast(x) if isinstance(x, torch.Tensor) else x for key, x in opts.items()}
    return cast(q), cast(k), cast(v), cast(dout), opts, params


def run_case(name, fn, q, k, v, dout, opts, params):
    """out and the gradients of Σ out·dout, of q, k, v and the parameters."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    opts = dict(opts)
    trained = {p: opts[p].detach().requires_grad_() for p in params}
    opts.update(trained)
    takes = inspect.signature(fn).parameters
    positional = [opts.pop(p) for p in POSITIONAL
                  if p in opts and takes[p].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    out = fn(q, k, v, *positional, **opts)
    (out * dout).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            **{"d_" + p: t.grad for p, t in trained.items()}}


def _one_ulp_up(x, change):
    """x, or (change) a copy with its element [2, 5] one ulp larger."""
    if not change:
        return x
    y = x.clone()
    y[2, 5] = torch.nextafter(y[2, 5], torch.tensor(float("inf"), dtype=y.dtype))
    return y


def _errors(dist_mod, rank):
    """Bad input on one rank, or options that differ: every rank raises (nothing hangs)."""
    got = {}
    q = torch.randn(B, H, 4, D, dtype=torch.float64)
    e_shared = torch.randn(3, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64) / 4
    cases = {
        "dtype_on_rank_1": lambda: dist_mod.softmax_attention(q.float() if rank == 1 else q, q, q),
        "causal_differs": lambda: dist_mod.linear_attention(q, q, q, causal=rank == 1),
        "projection_differs": lambda: dist_mod.favor_attention(
            q, q, q, torch.from_numpy(linattn.random_features(8, D, seed=rank)).double()),
        "nan_on_last": lambda: dist_mod.efficient_attention(q, q, q * (float("nan") if rank == 3 else 1)),
        "given_nan_on_last": lambda: dist_mod.linear_attention(
            q.abs() * (float("nan") if rank == 3 else 1), q.abs(), q, feature_map="given"),
        "state_overflow_on_last": lambda: dist_mod.linear_attention(q, q, q * (1e306 if rank == 3 else 1)),
        "key_lengths_too_long": lambda: dist_mod.softmax_attention(q, q, q, key_lengths=[3, 100]),
        "efficient_causal": lambda: dist_mod.efficient_attention(q, q, q, causal=True),
        "nystrom": lambda: dist_mod.nystrom_attention(q, q, q),
        "zigzag_sizes": lambda: dist_mod.softmax_attention(*[torch.randn(B, H, 3 + 2 * rank, D)] * 3,
                                                           layout="zigzag"),
        "layout": lambda: dist_mod.softmax_attention(q, q, q, layout="striped"),
        "window_differs": lambda: dist_mod.hybrid_attention(q, q, q, window=1 + rank),
        "gate_differs": lambda: dist_mod.hybrid_attention(q, q, q, window=2, window_gate=torch.full(
            (H,), float(rank), dtype=torch.float64)),
        # one element of f one ulp apart on rank 1: the shared tensors' fingerprints differ
        "linformer_f_differs": lambda: dist_mod.linformer_attention(q, q, q, e_shared,
                                                                    _one_ulp_up(e_shared, rank == 1)),
        "negative_features": lambda: dist_mod.hybrid_attention(q, q, q, feature_map="given", query_features=q,
                                                               key_features=q.abs()),
        "hybrid_favor_trig": lambda: dist_mod.hybrid_attention(
            q, q, q, window=2, feature_map="favor", kernel="trig",
            projection=torch.from_numpy(linattn.random_features(8, D, seed=1)).double()),
        # a value only the kernel checks, on one rank: raised by the second agreement
        "delta_beta_on_last": lambda: dist_mod.gated_delta_rule(q, q, q, -q[..., 0].abs(), (
            3.0 if rank == 3 else 0.5) * torch.ones(B, H, 4, dtype=torch.float64)),
        "delta_heads": lambda: dist_mod.gated_delta_rule(q[:, :1].repeat(1, 3, 1, 1), q[:, :1].repeat(1, 3, 1, 1), q,
                                                         -q[..., 0].abs(), q[..., 0].abs().clamp(max=1)),
        "hedgehog_weight_shape": lambda: dist_mod.hedgehog_attention(
            q, q, q, torch.zeros(H, D + 1, 3, dtype=torch.float64), torch.zeros(H, 3, dtype=torch.float64),
            torch.zeros(H, D, 3, dtype=torch.float64), torch.zeros(H, 3, dtype=torch.float64)),
    }
    for key, call in cases.items():
        try:
            call()
            got[key] = None
        except Exception as e:  # noqa: BLE001 (the test reads the type)
            got[key] = (type(e).__name__, str(e))
    return got


def _traffic(dist_mod, world):
    """Payload bytes this rank sent for one forward and backward, by method and n."""
    got = {}
    for n_total in (16 * world, 64 * world):
        n = n_total // world
        q = torch.randn(B, H, n, D, dtype=torch.float64, requires_grad=True)
        for name, call in (("softmax", lambda: dist_mod.softmax_attention(q, q, q)),
                           ("elu", lambda: dist_mod.linear_attention(q, q, q)),
                           ("elu_causal", lambda: dist_mod.linear_attention(q, q, q, causal=True))):
            dist_mod.reset_traffic()
            out = call()
            forward = dist_mod.traffic()["bytes"]
            out.sum().backward()
            got[(name, n_total)] = (forward, dist_mod.traffic()["bytes"] - forward)
    return got


def _thread_counts(dist_mod):
    """Out and dq of the ring (causal, zig-zag) and of Linformer (whose last step is linattn's
    softmax) at batch·heads = 2 under 1, 3, 8 and 16 linattn threads."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 40, D, generator=gen, dtype=torch.float64) for _ in range(3))
    e = torch.randn(5, 40, generator=gen, dtype=torch.float64)
    part = lambda x: dist_mod.shard(x, layout="zigzag")  # noqa: E731
    got = {}
    for threads in (1, 3, 8, 16):
        linattn.set_num_threads(threads)
        for name, call in (("softmax", lambda a, b, c: dist_mod.softmax_attention(a, b, c, causal=True,
                                                                                   layout="zigzag")),
                           ("linformer", lambda a, b, c: dist_mod.linformer_attention(a, b, c, e, e,
                                                                                       layout="zigzag"))):
            ql = part(q).requires_grad_()
            out = call(ql, part(k), part(v))
            out.square().sum().backward()
            got[(name, threads)] = (out.detach(), ql.grad)
    return got


def _partial_inputs(seed=11):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=gen, dtype=torch.float64) for _ in range(3))
    w = torch.from_numpy(linattn.random_features(6, D, seed=1)).double()
    return q, k, v, w


PARTIAL_CALLS = {"elu": lambda mod, a, b, c, w: mod.linear_attention(a, b, c, causal=True),
                 "favor": lambda mod, a, b, c, w: mod.favor_attention(a, b, c, w, causal=True)}


def _partial_grads(dist_mod, rank, world):
    """torch.autograd.grad for some inputs only (k and v; q), causal elu and FAVOR+, contiguous
    blocks: this rank's gradients. autograd then runs only the nodes that lead to those inputs,
    so every rank must reach the states' all-gather through them alike (the last rank's segment
    has no key state of its own); a rank that skipped it would leave the others waiting."""
    q, k, v, w = _partial_inputs()
    bounds = [sum(SIZES[world][:r]) for r in range(world + 1)]
    got = {}
    for name, call in PARTIAL_CALLS.items():
        for wanted in ("kv", "q"):
            ql, kl, vl = (x[:, :, bounds[rank]:bounds[rank + 1]].clone().requires_grad_() for x in (q, k, v))
            out = call(dist_mod, ql, kl, vl, w)
            got[(name, wanted)] = torch.autograd.grad(out.square().sum(), (kl, vl) if wanted == "kv" else (ql,))
    return got


def worker(rank, world, store, outdir):
    import datetime

    import torch.distributed as dist
    import linattn.torch.distributed as ld
    torch.set_num_threads(1)
    linattn.set_num_threads(THREADS[world])
    # A FileStore, so no port can be taken between choosing and binding it; a collective that
    # waits longer than the timeout raises instead of hanging.
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    result = {"cases": {}, "errors": None, "traffic": None, "threads": None, "partial": None, "failure": None}
    try:
        for name, (function, _, layout) in CASES.items():
            q, k, v, dout, opts, params = inputs(name)
            if layout == "zigzag":
                part = lambda x: ld.shard(x, layout="zigzag")  # noqa: E731
            else:
                bounds = [sum(SIZES[world][:r]) for r in range(world + 1)]
                part = lambda x: x[:, :, bounds[rank]:bounds[rank + 1]]  # noqa: E731,B023
            fn = getattr(ld, function)
            opts = {key: part(x) if key in ROWS else x for key, x in opts.items()}
            opts["layout"] = layout
            result["cases"][name] = run_case(name, fn, part(q), part(k), part(v), part(dout), opts, params)
            result["cases"][name]["gathered"] = ld.gather(result["cases"][name]["out"], layout=layout)
        result["errors"] = _errors(ld, rank)
        result["traffic"] = _traffic(ld, world)
        result["threads"] = _thread_counts(ld)
        result["partial"] = _partial_grads(ld, rank, world)
    except Exception:  # noqa: BLE001 (reported by the test)
        result["failure"] = traceback.format_exc()
    torch.save(result, os.path.join(outdir, "rank%d.pt" % rank))
    dist.destroy_process_group()


def spawn(fn, args, nprocs):
    """mp.spawn with a deadline: processes still running after SPAWN_LIMIT_S are killed and
    the test fails saying so (a hang shows as a failure, never as a stuck test run)."""
    import time
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_LIMIT_S
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("%d processes still running after %d s" % (nprocs, SPAWN_LIMIT_S))


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: "world%d" % w)
def world(request, tmp_path_factory):
    """Every rank's results for one world size."""
    w = request.param
    outdir = str(tmp_path_factory.mktemp("world%d" % w))
    spawn(worker, (w, os.path.join(outdir, "store"), outdir), w)
    results = [torch.load(os.path.join(outdir, "rank%d.pt" % r), weights_only=False) for r in range(w)]
    for r, res in enumerate(results):
        assert res["failure"] is None, "rank %d: %s" % (r, res["failure"])
    return w, results


def _assemble(world, layout, parts):
    if layout == "zigzag":
        from linattn.torch.distributed._layout import unshard
        return unshard(parts, layout)
    return torch.cat(parts, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(world, name):
    w, results = world
    function, _, layout = CASES[name]
    q, k, v, dout, opts, params = inputs(name)
    ref = run_case(name, getattr(lt, function), q, k, v, dout, opts, params)
    tol = TOL32 if q.dtype == torch.float32 else TOL64
    for key, expected in ref.items():
        parts = [res["cases"][name][key] for res in results]
        shared = key.startswith("d_") and key[2:] not in ROWS  # a parameter: each rank has its share
        got = sum(parts) if shared else _assemble(w, layout, parts)
        scale = float(expected.abs().max())
        err = float((got - expected).abs().max())
        assert err <= tol * max(scale, 1e-300), "%s %s: max error %.3g, allowed %.3g" % (name, key, err, tol * scale)
    for res in results:  # gather() returns the whole output on every rank
        torch.testing.assert_close(res["cases"][name]["gathered"], _assemble(w, layout, [
            r["cases"][name]["out"] for r in results]), rtol=0, atol=0)


def test_errors_raised_on_every_rank(world):
    w, results = world
    everywhere = {"key_lengths_too_long", "efficient_causal", "nystrom", "layout", "negative_features",
                  "hedgehog_weight_shape", "hybrid_favor_trig", "delta_heads"}
    if w > 1:
        everywhere |= {"dtype_on_rank_1", "causal_differs", "projection_differs", "zigzag_sizes", "window_differs",
                       "gate_differs", "linformer_f_differs"}
    if w == 4:
        everywhere |= {"nan_on_last", "given_nan_on_last", "state_overflow_on_last", "delta_beta_on_last"}
    assert set(results[0]["errors"]) >= everywhere
    for key in everywhere:
        got = [res["errors"][key] for res in results]
        assert all(g is not None for g in got), (key, got)
        if key == "dtype_on_rank_1":
            assert got[1][0] == "TypeError" and "float64" in got[1][1]
            assert got[0][0] == "ValueError" and "rank 1" in got[0][1]
        elif key in ("nan_on_last", "given_nan_on_last"):
            assert got[3][0] == "ValueError" and "non-finite" in got[3][1]
            assert "rank 3" in got[0][1]
        elif key == "delta_beta_on_last":
            assert got[3][0] == "ValueError" and "beta must be in [0, 2]" in got[3][1]
            assert all(g[0] == "ValueError" and "rank 3" in g[1] for g in got[:3])
        elif key == "state_overflow_on_last":  # refused before any collective, so nothing hangs
            assert got[3][0] == "ValueError" and "too large for torch.float64" in got[3][1]
            assert "rank 3" in got[0][1]
        elif key in ("causal_differs", "projection_differs", "window_differs", "gate_differs", "linformer_f_differs"):
            assert all(g[0] == "ValueError" and "other shapes or options than rank 0" in g[1] for g in got[1:])
        elif key == "zigzag_sizes":
            assert all(g[0] == "ValueError" and "zigzag" in g[1] for g in got)
        else:
            words = {"key_lengths_too_long": "key_lengths must lie in [0, n]", "efficient_causal": "causal=True",
                     "nystrom": "not available", "layout": "layout must be one of",
                     "negative_features": "query_features must be >= 0",
                     "hedgehog_weight_shape": "query_weight has shape",
                     "delta_heads": "must be a multiple of q's and k's heads",
                     "hybrid_favor_trig": "kernel must be positive or hyperbolic"}[key]
            assert all(g[0] == "ValueError" and words in g[1] for g in got), got
    for key in set(results[0]["errors"]) - everywhere:  # valid on this world size: no error anywhere
        assert all(res["errors"][key] is None for res in results), key


def test_payload(world):
    """Kernelized attention sends the same bytes whatever n; the ring's grow with n, exactly as
    counted: the agreement row (40 float64) and P−1 blocks of k and v forward; in backward
    the same blocks, and P blocks of dk, dv."""
    w, results = world
    for res in results:
        t = res["traffic"]
        assert t[("elu", 16 * w)] == t[("elu", 64 * w)]
        assert t[("elu_causal", 16 * w)] == t[("elu_causal", 64 * w)]
        assert t[("elu_causal", 16 * w)][1] > 0  # backward's all-reduce runs on every rank
        for n_total in (16 * w, 64 * w):
            block = B * H * (n_total // w) * (D + D) * 8
            forward, backward = t[("softmax", n_total)]
            assert forward == 40 * 8 + (w - 1) * block
            assert backward == ((w - 1) + (w if w > 1 else 0)) * block


def test_thread_counts(world):
    """1, 3, 8 and 16 threads per process with batch·heads = 2: bitwise the same output and dq."""
    _, results = world
    for res in results:
        for (name, threads), (out, dq) in res["threads"].items():
            base_out, base_dq = res["threads"][(name, 1)]
            assert torch.equal(out, base_out) and torch.equal(dq, base_dq), (name, threads)


def test_gradients_of_some_inputs_only(world):
    """torch.autograd.grad asked for k and v only, or q only, gives every rank its rows of the
    single-process gradients (and returns: no rank waits in a collective the others skipped)."""
    w, results = world
    q, k, v, proj = _partial_inputs()
    bounds = [sum(SIZES[w][:r]) for r in range(w + 1)]
    for name, call in PARTIAL_CALLS.items():
        qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
        dq, dk, dv = torch.autograd.grad(call(lt, qa, ka, va, proj).square().sum(), (qa, ka, va))
        for rank, res in enumerate(results):
            rows = slice(bounds[rank], bounds[rank + 1])
            for wanted, want in (("kv", (dk, dv)), ("q", (dq,))):
                got = res["partial"][(name, wanted)]
                for g, x in zip(got, want):
                    err = float((g - x[:, :, rows]).abs().max())
                    assert err <= TOL64 * float(x.abs().max()), (name, wanted, rank, err)


def test_needs_an_initialised_group():
    import linattn.torch.distributed as ld
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="init_process_group"):
        ld.softmax_attention(q, q, q)


ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_example_under_torchrun():
    """examples/context_parallel.py on 2 ranks: the losses and parameters of three SGD steps
    equal one process's (the example asserts it, to 10^-10), and both ranks exit cleanly.
    torchrun --standalone binds its store to port 0 (the system picks a free one) and its
    workers share that store, so no port is chosen before it is bound."""
    import subprocess
    import sys
    for method in ("softmax", "favor"):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            os.path.join(ROOT, "examples", "context_parallel.py"), "--method", method, "--tokens", "96"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "the 2-rank parameters equal the one-process ones after 3 steps" in r.stdout


def test_benchmark_quick(tmp_path):
    """bench/distributed.py --quick writes its section of the page; it exits non-zero when a
    counted payload differs from the formula in docs/distributed.md."""
    import subprocess
    import sys
    page = tmp_path / "distributed.md"
    page.write_text("before\n<!-- MEASURED: written by bench/distributed.py -->\nold\n<!-- END MEASURED -->\nafter\n")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "distributed.py"), "--quick", "--out",
                        str(tmp_path / "out"), "--docs", str(page)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| softmax causal | 128 |" in text and "| Linformer s=256 | 64 |" in text


def test_random_feature_rows_are_bounded_by_their_norms_not_their_largest_entry():
    """The check that FAVOR's logits stay finite passes on the bound head_dim·max|x|² when it
    can, and otherwise reads the rows' norms: a row with one entry near float32's square root
    passes (its norm is that entry), a row of four such entries does not (0.5·‖x‖² overflows)."""
    from linattn.torch.distributed import _max_abs, _projection
    fn, w = "favor_attention", torch.eye(4)
    big = 1.5e19  # 0.5·4·big² = 4.5e38 > float32's largest, 0.5·big² = 1.1e38 below it
    one = torch.zeros(1, 1, 3, 4)
    one[0, 0, 1, 2] = big
    every = one.clone()
    every[0, 0, 1] = big
    small = torch.ones(1, 1, 3, 4)
    for q, k, ok in ((one, small, True), (small, one, True), (every, small, False), (small, every, False)):
        top = dict(zip("qk", _max_abs(q, k)))
        if ok:
            assert _projection(fn, w, "positive", ("positive",), 1.0, q, k, top) is w
        else:
            with pytest.raises(ValueError, match="a row of %s is too large for torch.float32 random features"
                                                 % ("q" if q is every else "k")):
                _projection(fn, w, "positive", ("positive",), 1.0, q, k, top)


def test_shared_tensor_fingerprint():
    """_checksum, the agreement check's numbers for a tensor every rank must pass alike: the
    definition (bytes, then h = Σ w_i + k·Σ (i+1)·w_i mod 2^64 over the bytes as 64-bit words,
    the last zero-padded, as two 32-bit halves), equal for equal bytes (a non-contiguous view as
    its contiguous copy), different for one ulp anywhere, for two values swapped, and for a
    dtype's other bytes."""
    import numpy as np
    from linattn.torch.distributed import _checksum

    def expected(t):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        words = np.frombuffer(raw + bytes(-len(raw) % 8), dtype=np.uint64)
        with np.errstate(over="ignore"):
            h1 = int(words.sum(dtype=np.uint64))
            h2 = int((words * np.arange(1, len(words) + 1, dtype=np.uint64)).sum(dtype=np.uint64))
        h = (h1 + 0x9E3779B97F4A7C15 * h2) % 2 ** 64
        return [float(len(raw)), float(h & 0xFFFFFFFF), float(h >> 32)]

    g = torch.Generator().manual_seed(3)
    for t in (torch.randn(7, 13, generator=g), torch.randn(2, 3, 5, generator=g, dtype=torch.float64),
              torch.randn(9, generator=g).bfloat16(), torch.zeros(0), torch.tensor(1.5)):
        assert _checksum(t) == expected(t), t.dtype
        assert _checksum(t.clone().requires_grad_()) == _checksum(t)
    assert _checksum(None) == [0.0, 0.0, 0.0]
    x = torch.randn(5, 9, generator=g)  # 180 bytes: the last word is half padding
    assert _checksum(x.t()) == _checksum(x.t().contiguous()) == expected(x.t())
    seen = {tuple(_checksum(x))}
    for i, j in ((0, 0), (2, 7), (4, 8)):  # first, middle, last (in the padded word)
        y = x.clone()
        y[i, j] = torch.nextafter(y[i, j], torch.tensor(float("inf")))
        seen.add(tuple(_checksum(y)))
    swapped = x.clone()
    swapped[1, 2], swapped[4, 3] = x[4, 3].item(), x[1, 2].item()
    seen.add(tuple(_checksum(swapped)))
    seen.add(tuple(_checksum(x.double())))
    assert len(seen) == 6
