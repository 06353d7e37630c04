"""Arrays enter by dtype value, not dtype identity: float32/float64 arrays that went through
pickle, np.load, np.frombuffer, a memmap or a view are accepted everywhere; arrays in the other
byte order are refused with a TypeError that says how to convert them."""
import io
import pickle

import numpy as np
import pytest

import linattn


def _qkv(dtype, shape=(1, 2, 16, 8), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


def _unpickled(a):
    return pickle.loads(pickle.dumps(a))


def _from_npy(a, tmp_path):
    path = tmp_path / f"a{len(list(tmp_path.iterdir()))}.npy"
    np.save(path, a)
    return np.load(path)


def _from_npz(a, tmp_path):
    buf = io.BytesIO()
    np.savez(buf, a=a)
    buf.seek(0)
    return np.load(buf)["a"]


def _from_buffer(a):
    return np.frombuffer(a.tobytes(), dtype=np.dtype(a.dtype.str)).reshape(a.shape)


def _memmap(a, tmp_path):
    path = tmp_path / f"a{len(list(tmp_path.iterdir()))}.bin"
    m = np.memmap(path, dtype=a.dtype, mode="w+", shape=a.shape)
    m[...] = a
    m.flush()
    return np.memmap(path, dtype=np.dtype(a.dtype.str), mode="r", shape=a.shape)


def _strided_view(a):
    big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), dtype=a.dtype)
    big[..., ::2] = a
    return big[..., ::2]


ROUTES = {
    "pickle": lambda a, tmp: _unpickled(a),
    "npy": _from_npy,
    "npz": _from_npz,
    "frombuffer": lambda a, tmp: _from_buffer(a),
    "memmap": _memmap,
    "strided_view": lambda a, tmp: _strided_view(a),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_function_takes_arrays_whatever_their_history(route, dtype, tmp_path):
    q, k, v = _qkv(dtype)
    dout = _qkv(dtype, seed=1)[0]
    moved = [ROUTES[route](x, tmp_path) for x in (q, k, v, dout)]
    assert moved[0].dtype == dtype and moved[0] is not q
    Q, K, V, G = moved
    w = linattn.random_features(32, 8, dtype=dtype)
    W = ROUTES[route](w, tmp_path)
    e, f = linattn.linformer_projections(4, 16, dtype=dtype)
    E, F = ROUTES[route](e, tmp_path), ROUTES[route](f, tmp_path)
    conv = ROUTES[route](np.full((2, 3), 0.1, dtype=dtype), tmp_path)
    calls = [
        lambda q, k, v, g: linattn.softmax_attention(q, k, v),
        lambda q, k, v, g: linattn.softmax_attention_backward(q, k, v, g),
        lambda q, k, v, g: linattn.linear_attention(q, k, v, conv_weight=conv),
        lambda q, k, v, g: linattn.linear_attention_backward(q, k, v, g, conv_weight=conv),
        lambda q, k, v, g: linattn.favor_attention(q, k, v, W),
        lambda q, k, v, g: linattn.favor_attention_backward(q, k, v, W, g),
        lambda q, k, v, g: linattn.nystrom_attention(q, k, v, num_landmarks=4, conv_weight=conv),
        lambda q, k, v, g: linattn.nystrom_attention_backward(q, k, v, g, num_landmarks=4),
        lambda q, k, v, g: linattn.linformer_attention(q, k, v, E, F),
        lambda q, k, v, g: linattn.linformer_attention_backward(q, k, v, E, F, g),
        lambda q, k, v, g: linattn.efficient_attention(q, k, v),
        lambda q, k, v, g: linattn.efficient_attention_backward(q, k, v, g),
    ]
    for call in calls:
        want = call(q, k, v, dout)
        got = call(Q, K, V, G)
        for a, b in zip(want if isinstance(want, tuple) else (want,),
                        got if isinstance(got, tuple) else (got,)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_recurrent_state_takes_arrays_whatever_their_history(route, tmp_path):
    w = ROUTES[route](linattn.random_features(16, 8, dtype=np.float64), tmp_path)
    q, k, v = (ROUTES[route](x, tmp_path) for x in _qkv(np.float64, (1, 2, 5, 8)))
    state = linattn.recurrent_state(1, 2, 8, 8, feature_map="favor", projection=w)
    assert state.dtype == np.float64
    out = state.prefill(q, k, v)
    step = state.step(*(ROUTES[route](np.ascontiguousarray(x[:, :, 0]), tmp_path) for x in (q, k, v)))
    assert out.shape == (1, 2, 5, 8) and step.shape == (1, 2, 8)


@pytest.mark.parametrize("dtype", [np.float32, "float32", np.dtype("float32"),
                                   pickle.loads(pickle.dumps(np.dtype(np.float32)))])
def test_dtype_arguments_compare_by_value(dtype):
    w = linattn.random_features(4, 8, dtype=dtype)
    assert w.dtype == np.float32
    e, _ = linattn.linformer_projections(2, 4, dtype=dtype)
    assert e.dtype == np.float32
    s = linattn.recurrent_state(1, 1, 8, 8, dtype=dtype)
    assert s.dtype == np.float32


@pytest.mark.parametrize("dtype,name", [(">f4", "big-endian float32"), (">f8", "big-endian float64")])
def test_other_byte_order_is_refused_with_the_conversion(dtype, name):
    q, k, v = _qkv(np.float32)
    big = q.astype(dtype)
    with pytest.raises(TypeError, match=rf"q has dtype {name} .*astype\(numpy\.float"):
        linattn.softmax_attention(big, k, v)
    with pytest.raises(TypeError, match="machine's byte order"):
        linattn.random_features(4, 8, dtype=dtype)
    # The conversion the message names works.
    np.testing.assert_array_equal(linattn.softmax_attention(big.astype(np.float32), k, v),
                                  linattn.softmax_attention(q.astype(dtype).astype(np.float32), k, v))


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.longdouble, np.int16])
def test_other_dtypes_are_type_errors(dtype):
    q, k, v = _qkv(np.float32)
    with pytest.raises(TypeError, match=r"must have dtype float32, float64, bfloat16 \(ml_dtypes.bfloat16\) or float16"):
        linattn.softmax_attention(q.astype(dtype), k, v)
