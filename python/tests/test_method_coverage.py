"""Every registered method (and learned feature map) is reachable from every layer that names
methods one by one: MultiheadAttention's method names, the Hugging Face backends and
linattn.torch.distributed. A method added to the registry and forgotten in one of them fails
here, unless the list below says why it is absent (docs/adding-a-method.md)."""

import pytest

import linattn
import linattn.torch as lt
from linattn.torch import modules

transformers = pytest.importorskip("transformers")
import linattn.hf as lh  # noqa: E402
import linattn.torch.distributed as ltd  # noqa: E402

# Where a method is deliberately absent, and why.
ABSENT = {
    ("MultiheadAttention", "hybrid"): "reached through method='hedgehog' with window > 0 (learned maps)",
}


def registered():
    return {m["name"]: m["function"] for m in linattn.methods()}


def test_every_method_is_in_multihead_attention():
    names = {registered_name for registered_name, _ in modules._METHODS.values()}
    for name in registered():
        assert name in names or ("MultiheadAttention", name) in ABSENT, \
            "method %r has no MultiheadAttention method name (linattn/torch/modules.py _METHODS)" % name


def test_every_method_has_a_hugging_face_backend():
    functions = {b.function for b in lh.BACKENDS.values()}
    for name, function in registered().items():
        assert function in functions or ("hf", name) in ABSENT, \
            "method %r has no linattn.hf backend (linattn/hf/backends.py BACKENDS)" % name
    # and the learned maps (Hedgehog's, and any registered): a backend each
    assert "hedgehog" in lt.learned_feature_maps() and hasattr(lt, "hedgehog_attention")
    for name, cls in lt.learned_feature_maps().items():
        b = lh.BACKENDS["linattn_" + name]
        assert isinstance(b, lh.backends.Learned) and b.cls is cls, name


def test_every_method_is_in_distributed():
    for name, function in registered().items():
        assert function in ltd.__all__ or ("distributed", name) in ABSENT, \
            "method %r is missing from linattn.torch.distributed" % name
    # and the learned maps: Hedgehog's, with linattn.torch's signature, and in NumPy
    import inspect
    assert {"hedgehog_attention", "hedgehog_attention_backward", "hedgehog_features"} <= set(linattn.__all__)
    assert "hedgehog_attention" in ltd.__all__
    for function in ("hedgehog_attention", "hybrid_attention"):  # linattn.torch's signature, then group, layout
        single = list(inspect.signature(getattr(lt, function)).parameters)
        assert list(inspect.signature(getattr(ltd, function)).parameters) == single + ["group", "layout"], function


def test_the_absent_list_names_only_real_gaps():
    # An entry for a method that has since been added is stale: remove it.
    names = {registered_name for registered_name, _ in modules._METHODS.values()}
    for (layer, name), why in ABSENT.items():
        assert name in registered(), (layer, name)
        if layer == "MultiheadAttention":
            assert name not in names, (layer, name, why)
        if layer == "distributed":
            assert registered()[name] not in ltd.__all__, (layer, name, why)
