"""Never a crash, a hang, a silent NaN or a silent acceptance, from Python: every registered
method at thread counts above and below batch·heads; sizes whose byte count overflows; values
near the dtype's limit; FAVOR+ at large norms; the decoding state used from two threads;
set_num_threads while other threads compute; Ctrl-C (in a child process); two Python threads
at once; repeated calls that do not grow memory."""
import gc
import os
import threading
import time

import numpy as np
import pytest

import linattn

METHODS = linattn.methods()


def _extra(info, heads, d, n, dtype, rng):
    """The extra tensors a method needs (projection; e and f), by name."""
    names = [o["name"] for o in info["options"] if o["positional"]]
    if "projection" in names:
        return {"projection": linattn.random_features(32, d, seed=3, dtype=dtype)}
    if "e" in names:
        e, f = linattn.linformer_projections(64, n, seed=3, dtype=dtype)
        return {"e": e, "f": f}
    return {}


def _call(info, q, k, v, extra, backward=False, dout=None, **opts):
    fn = getattr(linattn, info["function"] + ("_backward" if backward else ""))
    positional = [extra[o["name"]] for o in info["options"] if o["positional"]]
    args = [q, k, v, *positional] + ([dout] if backward else [])
    return fn(*args, **opts)


def _variants_gen():
    for info in METHODS:
        for causal in (False, True):
            if causal and info["no_causal"]:
                continue
            yield pytest.param(info, causal, id=info["name"] + ("-causal" if causal else ""))


def _variants():
    return list(_variants_gen())


@pytest.fixture
def threads():
    saved = linattn.get_num_threads()
    yield
    linattn.set_num_threads(saved)


@pytest.mark.parametrize("info,causal", _variants())
def test_every_thread_count_gives_the_same_result(info, causal, threads):
    """Threads {1, 2, 3, 8, 16} × batch·heads {1, 2, 3}, sequences longer than every block."""
    rng = np.random.default_rng(5)
    n, d = info["block_rows"] + 37, 16
    for b, h in ((1, 1), (1, 2), (3, 1)):
        q, k, v, dout = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(4))
        extra = _extra(info, h, d, n, np.float32, rng)
        results = []
        for t in (1, 2, 3, 8, 16):
            linattn.set_num_threads(t)
            out = _call(info, q, k, v, extra, causal=causal)
            grads = _call(info, q, k, v, extra, backward=True, dout=dout, causal=causal)
            results.append((t, out, grads))
        _, out1, grads1 = results[0]
        for t, out, grads in results[1:]:
            np.testing.assert_array_equal(out, out1, err_msg=f"{t} threads, B={b} H={h}")
            for i, (g, g1) in enumerate(zip(grads, grads1)):
                if i == 0 and info["name"] == "softmax" and b * h < t:
                    _check_reassociated_dq(g, g1, q, k, v, dout, causal)
                else:
                    np.testing.assert_array_equal(g, g1, err_msg=f"grad {i}, {t} threads, B={b} H={h}")


def _check_reassociated_dq(g, g1, q, k, v, dout, causal):
    """Exact attention's dq when batch·heads < threads: the key range of each (batch, head) is
    split across workers and the per-block products dS_b·K_b (identical at every thread count)
    are added in another association. Both sums are within γ_B·Σ_b|dS_b·K_b| of the exact sum
    (B key blocks of 128, Higham §4.2), so they differ by at most twice that, which is bounded
    by 2γ_B·scale·Σ_j |dS_ij|·|k_j| (dS in float64 from the definition)."""
    q64, k64, v64, g64 = (x.astype(np.float64) for x in (q, k, v, dout))
    n, d = q.shape[2], q.shape[3]
    scale = 1 / np.sqrt(d)
    s = scale * q64 @ np.swapaxes(k64, -1, -2)
    if causal:
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = g64 @ np.swapaxes(v64, -1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    blocks = -(-n // 128)
    u = np.finfo(np.float32).eps / 2
    gamma = blocks * u / (1 - blocks * u)
    bound = 2 * gamma * scale * (np.abs(ds) @ np.abs(k64)) * (1 + 1e-3)  # 1e-3: dS rounded in float32
    assert (np.abs(g.astype(np.float64) - g1) <= bound).all(), np.max(np.abs(g - g1) / np.maximum(bound, 1e-300))


@pytest.mark.parametrize("info,causal", _variants())
def test_values_near_float32_max_give_finite_scaled_results(info, causal):
    rng = np.random.default_rng(7)
    n, d = 40, 8
    q, k, v = (rng.standard_normal((1, 2, n, d)).astype(np.float32) for _ in range(3))
    extra = _extra(info, 2, d, n, np.float32, rng)
    v = np.ldexp(v, 31 - np.frexp(np.abs(v).max())[1] + 1).astype(np.float32)  # max |v| in [2^31, 2^32)
    small = _call(info, q, k, v, extra, causal=causal)
    big = _call(info, q, k, np.ldexp(v, 96).astype(np.float32), extra, causal=causal)  # up to ~3.4e38
    assert np.isfinite(big).all()
    np.testing.assert_array_equal(big, np.ldexp(small, 96).astype(np.float32))


@pytest.mark.parametrize("info,causal", _variants())
def test_huge_queries_and_keys_give_a_finite_result_or_a_value_error(info, causal):
    rng = np.random.default_rng(9)
    n, d = 30, 8
    q, k = ((rng.standard_normal((1, 2, n, d)) * 1e30).astype(np.float32) for _ in range(2))
    v, dout = (rng.standard_normal((1, 2, n, d)).astype(np.float32) for _ in range(2))
    extra = _extra(info, 2, d, n, np.float32, rng)
    for backward in (False, True):
        try:
            r = _call(info, q, k, v, extra, backward=backward, dout=dout, causal=causal)
        except ValueError as e:
            assert "too large" in str(e) or "overflow" in str(e), str(e)
            continue
        for x in r if backward else (r,):
            assert np.isfinite(x).all()


@pytest.mark.parametrize("kernel", ["positive", "hyperbolic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_favor_at_row_norms_20_to_100_is_finite_everywhere(kernel, causal, dtype):
    rng = np.random.default_rng(11)
    d, n = 64, 200
    for norm in (20, 50, 100):
        q, k = (rng.standard_normal((1, 2, n, d)) for _ in range(2))
        q *= norm / np.linalg.norm(q, axis=-1, keepdims=True)
        k *= norm / np.linalg.norm(k, axis=-1, keepdims=True)
        v, dout = (rng.standard_normal((1, 2, n, d)) for _ in range(2))
        q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
        w = linattn.random_features(128, d, seed=1, dtype=dtype)
        out = linattn.favor_attention(q, k, v, w, kernel=kernel, causal=causal)
        assert np.isfinite(out).all(), norm
        for g in linattn.favor_attention_backward(q, k, v, w, dout, kernel=kernel, causal=causal):
            assert np.isfinite(g).all(), norm
        state = linattn.recurrent_state(1, 2, d, d, feature_map="favor", projection=w, kernel=kernel)
        steps = np.stack([state.step(*(np.ascontiguousarray(x[:, :, t]) for x in (q, k, v)))
                          for t in range(20)], axis=2)
        assert np.isfinite(steps).all(), norm
        if causal:  # the decoding state gives the causal rows: both within the bound of the exact ones
            bound = _favor_output_bound(q, k, w, v, kernel, n)
            assert np.abs(steps.astype(np.float64) - out[:, :, :20]).max() <= 2 * bound, norm


def _favor_output_bound(q, k, w, v, kernel, n):
    """How far a FAVOR output computed in q's dtype can be from the exact one, to first order
    in the unit roundoff u (the model of tests/kernelized_bounds.h): every feature is within a
    relative η of its exact value, η = 2·max|δU| + 2γ_{d+3}·h + u·(4(max|U| + h) + 2L) + 8u with
    U = x̃·ωᵀ, x̃ = √scale·x, |δU| <= γ_{d+1}·|x̃|·|ω|ᵀ + u|U|, h = ‖x̃‖²/2 and L the largest
    log-scale; a weight φq·φk within 2η + γ_{m'}, and the output, a weighted mean of v rows
    formed from sums of n + m' + 4 terms, within 2·(2η + γ_{n+m'+4})·max|v|. At norm 100 in
    float32 that is about 10^-2: the exponents there are in the hundreds."""
    u = np.finfo(q.dtype).eps / 2
    gamma = lambda m: m * u / (1 - m * u)  # noqa: E731
    d = q.shape[-1]
    rows = np.concatenate([q.reshape(-1, d), k.reshape(-1, d)]).astype(np.float64) / np.sqrt(np.sqrt(d))
    w64 = w.astype(np.float64)
    U, abs_U = rows @ w64.T, np.abs(rows) @ np.abs(w64).T
    h = 0.5 * (rows ** 2).sum(-1)
    L = (np.abs(U).max(-1) + h).max()
    dU = gamma(d + 1) * abs_U + u * np.abs(U)
    eta = (2 * dU.max(-1) + 2 * gamma(d + 3) * h + u * (4 * (np.abs(U).max(-1) + h) + 2 * L) + 8 * u).max()
    m = w.shape[0] * (2 if kernel == "hyperbolic" else 1)
    return 2 * (2 * eta + gamma(n + m + 4)) * np.abs(v).max()


def test_focused_map_with_a_large_power_or_large_inputs():
    rng = np.random.default_rng(13)
    q, k, v, dout = (rng.standard_normal((1, 2, 50, 16)).astype(np.float32) for _ in range(4))
    for p, scale in ((50.0, 10.0), (3.0, 1e15), (200.0, 1.0)):
        out = linattn.linear_attention(q * scale, k * scale, v, feature_map="focused", focus_power=p)
        assert np.isfinite(out).all()
        for g in linattn.linear_attention_backward(q * scale, k * scale, v, dout, feature_map="focused",
                                                   focus_power=p):
            assert np.isfinite(g).all()


@pytest.mark.parametrize("call,name", [
    (lambda: linattn.linformer_projections(2**31, 2**31), "s_proj × n_max"),
    (lambda: linattn.random_features(2**62, 8), "num_features × head_dim"),
    (lambda: linattn.recurrent_state(2**31, 2**31, 8, 8), "batch × heads"),
    (lambda: linattn.chi_quantile_radii(2**62, 4), "num_features"),
])
def test_sizes_whose_bytes_overflow_are_value_errors_naming_the_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_allocations_beyond_memory_are_memory_errors_naming_the_arguments():
    with pytest.raises(MemoryError, match="s_proj × n_max = 1048576 × 1048576"):
        linattn.linformer_projections(2**20, 2**20)
    with pytest.raises(MemoryError, match="num_features × head_dim"):
        linattn.random_features(2**40, 64)


def test_scale_outside_the_dtype_is_refused():
    q = np.ones((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="outside the range of float32"):
        linattn.softmax_attention(q, q, q, scale=1e300)
    with pytest.raises(ValueError, match="scale must be finite"):
        linattn.efficient_attention(q, q, q, scale=float("inf"))


def test_set_num_threads_is_capped():
    with pytest.raises(ValueError, match=r"n must be in \[1, 1024\], got 100000"):
        linattn.set_num_threads(100000)


def test_measure_peak_rates_reports_positive_rates_and_refuses_bad_thread_counts():
    r = linattn.measure_peak_rates(1)
    assert set(r) == {"float32_fma_gflops", "bfloat16_dot_gflops"}
    assert r["float32_fma_gflops"] > 0
    # The bfloat16 rate is measured exactly where the bfloat16 products run (build_info names them).
    assert (r["bfloat16_dot_gflops"] > 0) == ("AVX512-BF16 (vdpbf16ps)" in linattn.build_info())
    for bad in (0, -1, 1025):
        with pytest.raises(ValueError, match="measure_peak_rates: threads must be in"):
            linattn.measure_peak_rates(bad)


def test_release_cached_memory_gives_back_the_blocks_freed_calls_left():
    linattn.release_cached_memory()
    q = np.random.default_rng(0).standard_normal((1, 4, 2048, 64), dtype=np.float32)
    out = linattn.softmax_attention(q, q, q)  # its workspace (the packed keys, 2 MiB) is freed on return
    del out
    assert linattn.release_cached_memory() >= 1 << 20  # the Python module is never built with the sanitizers
    assert linattn.release_cached_memory() == 0


def test_a_decoding_state_used_from_two_threads_is_refused_not_corrupted():
    d = 16
    state = linattn.recurrent_state(1, 4, d, d, feature_map="elu")
    rng = np.random.default_rng(3)
    big = [rng.standard_normal((1, 4, 4096, d)).astype(np.float32) for _ in range(3)]
    tok = [rng.standard_normal((1, 4, d)).astype(np.float32) for _ in range(3)]
    refused, done = [], []

    def prefill():
        for _ in range(5):
            try:
                state.prefill(*big)
                done.append(4096)
            except ValueError as e:
                refused.append(str(e))

    def steps():
        for _ in range(200):
            try:
                state.step(*tok)
                done.append(1)
            except ValueError as e:
                refused.append(str(e))

    a, b = threading.Thread(target=prefill), threading.Thread(target=steps)
    a.start(), b.start()
    a.join(), b.join()
    assert all("in use by another thread" in m for m in refused)
    assert state.tokens == sum(done)  # every call that ran counted; none half-applied


def test_set_num_threads_while_other_threads_compute(threads):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 1100, 16)).astype(np.float32) for _ in range(3))
    linattn.set_num_threads(1)
    want = linattn.nystrom_attention(q, k, v)
    stop = threading.Event()

    def toggle():
        i = 0
        while not stop.is_set():
            linattn.set_num_threads(1 + i % 16)
            i += 1

    t = threading.Thread(target=toggle)
    t.start()
    try:
        for _ in range(20):
            np.testing.assert_array_equal(linattn.nystrom_attention(q, k, v), want)
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("pool", ["own", "openmp"])
@pytest.mark.parametrize("threads_in_child", [1, 3])
def test_ctrl_c_interrupts_a_long_call(threads_in_child, pool):
    """SIGINT, sent in a child process (interrupt_child.py) once a call sized to take at least
    2 s is inside the library, ends that call with KeyboardInterrupt within a quarter of its
    predicted duration (the library polls for signals every 20 ms); the library works
    afterwards. The prediction comes from a measured call on the same machine and load, so the
    margin holds on any machine, idle or loaded. pool "openmp": the loops run on PyTorch's
    OpenMP team, as under linattn.torch."""
    import json
    import subprocess
    import sys
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interrupt_child.py")
    r = subprocess.run([sys.executable, child, str(threads_in_child)] + (["openmp"] if pool == "openmp" else []),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["pool"].split()[0] == pool, report
    last = report["attempts"][-1]
    assert last["outcome"] == "interrupted", report  # "late" 3 times: the signal never met a running call
    latency = last["end"] - last["signal"]
    assert latency < last["predicted_s"] / 4, report
    assert report["works_after"]


def test_calls_release_the_gil_and_run_side_by_side(threads):
    """A short call from the main thread finishes while a long one runs in another thread:
    neither the GIL nor a library-wide lock serialises them. The long call is sized from the
    measured short one to take at least 50 times as long, and the short one starts once the
    long one is inside the library (its workspace is allocated), so the order does not depend
    on the machine's speed or load; should the long call still end first, it is made longer
    and the check repeated. Results equal the serial ones."""
    linattn.set_num_threads(1)
    rng = np.random.default_rng(1)
    small = rng.standard_normal((1, 1, 256, 64)).astype(np.float32)
    want_small = linattn.softmax_attention(small, small, small)
    t_small = []
    for _ in range(3):
        t0 = time.perf_counter()
        linattn.softmax_attention(small, small, small)
        t_small.append(time.perf_counter() - t0)
    n = max(1024, int(256 * np.sqrt(50 * max(t_small) / min(t_small))) // 64 * 64)
    for _ in range(3):
        big = rng.standard_normal((1, 1, n, 64)).astype(np.float32)
        finished = {}

        def run_big():
            finished["big"] = linattn.softmax_attention(big, big, big)

        a = threading.Thread(target=run_big)
        a.start()
        while linattn.workspace_stats()["current_bytes"] == 0 and a.is_alive():
            time.sleep(1e-3)
        out_small = linattn.softmax_attention(small, small, small)
        big_was_running = "big" not in finished
        a.join()
        np.testing.assert_array_equal(out_small, want_small)
        np.testing.assert_array_equal(finished["big"], linattn.softmax_attention(big, big, big))
        if big_was_running:
            break
        n *= 2
    assert big_was_running, "the short call never finished while the long one ran"


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_repeated_calls_do_not_grow_memory():
    rng = np.random.default_rng(2)
    q, k, v, g = (rng.standard_normal((1, 2, 300, 16)).astype(np.float32) for _ in range(4))
    extras = {info["name"]: _extra(info, 2, 16, 300, np.float32, rng) for info in METHODS}

    def one_round():
        for info in METHODS:
            _call(info, q, k, v, extras[info["name"]])
            _call(info, q, k, v, extras[info["name"]], backward=True, dout=g)
        s = linattn.recurrent_state(1, 2, 16, 16)
        s.prefill(q, k, v)

    for _ in range(20):  # warm up: allocator pools, thread stacks
        one_round()
    gc.collect()
    before = _rss_bytes()
    for _ in range(200):
        one_round()
    gc.collect()
    grown = _rss_bytes() - before
    # 200 rounds of ~40 arrays of 38 KiB: a leak of one array per call would be ~300 MiB.
    assert grown < 16 * 2**20, grown
    assert linattn.workspace_stats()["current_bytes"] == 0
