"""linattn: attention whose cost grows linearly with sequence length, and exact softmax
attention, on NumPy arrays shaped [batch, heads, seq, head_dim] (float32, float64, or bfloat16
(ml_dtypes) and float16, computed in float32 and rounded once).

Every attention method comes as `<name>_attention(q, k, v, ...)` and its gradients as
`<name>_attention_backward(q, k, v, ..., dout, ...)`, made here from the library's method
registry (`methods()`), so the functions, their options, defaults and documentation are the
ones the C++ library declares."""

import inspect as _inspect

from . import _linattn
from ._options import renamed as _renamed
from ._options import former_spellings as _former_spellings
from ._linattn import (
    RecurrentState,
    build_info,
    causal_conv1d,
    causal_conv1d_backward,
    chi_quantile_radii,
    feature_logits,
    feature_logits_backward,
    features,
    features_backward,
    gated_delta_rule,
    gated_delta_rule_backward,
    gated_linear_attention,
    gated_linear_attention_backward,
    get_num_threads,
    linformer_projections,
    measure_peak_rates,
    random_features,
    recurrent_state,
    release_cached_memory,
    reset_workspace_peak,
    set_num_threads,
    share_openmp_runtime,
    thread_pool,
    use_own_threads,
    workspace_stats,
)

__version__ = _linattn.__version__

_ANNOTATIONS = {"bool": "bool", "int": "int", "float": "float", "str": "str",
                "lengths": "Sequence[int]", "tensor": "ndarray"}
_TENSOR = "ndarray"


def methods():
    """The registered methods: name, function, options (name, kind, default, doc), ..."""
    return _linattn._methods()


def _default(option):
    text = option["default"]
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    if text.startswith("'"):
        return text[1:-1]
    return float(text) if any(c in text for c in ".eEn") else int(text)


def _annotation(option):
    a = _ANNOTATIONS[option["kind"]]
    return "Optional[%s]" % a if option["optional"] else a


def _doc(info, backward):
    lines = []
    if backward:
        grads = ["dq", "dk", "dv"] + ["d_" + o["name"] if o["name"].endswith("weight") else "d" + o["name"]
                                      for o in info["options"] if o["has_gradient"]]
        lines.append("Gradients (%s) of sum(dout * %s(...)); parameter gradients only for the "
                     "parameters given." % (", ".join(grads), info["function"]))
        if info["saved"]:
            lines.append("Pass out and %s from %s(..., %s) to skip recomputing the forward."
                         % (", ".join(info["saved"]), info["function"],
                            ", ".join("return_%s=True" % s for s in info["saved"])))
    else:
        lines.append(info["summary"] + ".")
        lines.append("")
        lines.append("q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v], float32, float64, bfloat16 (ml_dtypes) "
                     "or float16 (all the same; 16-bit inputs run in float32 and the result is rounded once%s)"
                     " -> out [B,H,n_q,d_v]." % ("; bfloat16 multiplies in bfloat16 (AMX tiles or AVX512-BF16) "
                                                "where the CPU can, docs/precision.md"
                                                if info["name"] == "softmax" else ""))
    lines.append("")
    for o in info["options"]:
        choices = " (%s)" % ", ".join(o["choices"]) if o["choices"] else ""
        lines.append("%s: %s%s" % (o["name"], o["doc"], choices))
    if info["no_causal"]:
        lines.append("causal=True raises ValueError: " + info["no_causal"] + ".")
    lines.append("")
    lines.append("See " + info["docs"] + ".")
    return "\n".join(lines)


def _and(names):
    """'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _make(info, backward):
    P = _inspect.Parameter
    opts = info["options"]
    params = [P(x, P.POSITIONAL_OR_KEYWORD, annotation=_TENSOR) for x in ("q", "k", "v")]
    params += [P(o["name"], P.POSITIONAL_OR_KEYWORD, annotation=_TENSOR) for o in opts if o["positional"]]
    if backward:
        params.append(P("dout", P.POSITIONAL_OR_KEYWORD, annotation=_TENSOR))
    params += [P(o["name"], P.KEYWORD_ONLY, default=_default(o), annotation=_annotation(o))
               for o in opts if not o["positional"]]
    if info["saved"]:
        if backward:
            params += [P(s, P.KEYWORD_ONLY, default=None, annotation="Optional[ndarray]")
                       for s in ["out"] + info["saved"]]
        else:
            params += [P("return_" + s, P.KEYWORD_ONLY, default=False, annotation="bool")
                       for s in info["saved"]]
    signature = _inspect.Signature(params)
    tensor_names = [o["name"] for o in opts if o["kind"] == "tensor"]
    option_names = [o["name"] for o in opts if o["kind"] != "tensor"]
    name = info["name"]
    former, former_values = _former_spellings(opts)
    fn = info["function"] + ("_backward" if backward else "")

    def call(*args, **kwargs):
        a = signature.bind(*args, **_renamed(fn, kwargs, former, former_values=former_values))
        a.apply_defaults()
        a = a.arguments
        tensors = {t: a[t] for t in tensor_names}
        options = {o: a[o] for o in option_names}
        if backward:
            saved = {s: a[s] for s in ["out"] + info["saved"]} if info["saved"] else {}
            given = [s for s in saved if saved[s] is not None]
            if given and len(given) != len(saved):
                raise ValueError("%s_backward: pass %s (from the forward), or none of them"
                                 % (info["function"], _and(["out"] + info["saved"])))
            return _linattn._backward(name, a["q"], a["k"], a["v"], a["dout"], tensors, options, saved)
        want = [s for s in info["saved"] if a["return_" + s]]
        return _linattn._forward(name, a["q"], a["k"], a["v"], tensors, options, want)

    call.__name__ = call.__qualname__ = info["function"] + ("_backward" if backward else "")
    call.__signature__ = signature
    call.__doc__ = _doc(info, backward)
    call.__module__ = __name__
    return call


__all__ = [
    "RecurrentState", "build_info", "causal_conv1d", "causal_conv1d_backward", "chi_quantile_radii", "feature_logits",
    "feature_logits_backward", "features", "features_backward", "gated_delta_rule", "gated_delta_rule_backward",
    "gated_linear_attention", "gated_linear_attention_backward",
    "get_num_threads", "linformer_projections",
    "measure_peak_rates", "methods", "random_features", "recurrent_state", "release_cached_memory", "reset_workspace_peak", "set_num_threads",
    "share_openmp_runtime", "thread_pool", "use_own_threads",
    "workspace_stats",
]
from ._hedgehog import (hedgehog_attention, hedgehog_attention_backward, hedgehog_features,  # noqa: E402
                        hedgehog_features_backward)

__all__ += ["hedgehog_attention", "hedgehog_attention_backward", "hedgehog_features", "hedgehog_features_backward"]
for _info in methods():
    for _backward in (False, True):
        _fn = _make(_info, _backward)
        globals()[_fn.__name__] = _fn
        __all__.append(_fn.__name__)
del _info, _backward, _fn
