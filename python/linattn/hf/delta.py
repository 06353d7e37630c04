"""linattn.hf.delta: transformers' linear-attention LLMs on linattn's gated delta rule.

Qwen3-Next, Qwen3.5 (and its MoE), OLMo-hybrid and Qwen4-exp run the gated delta rule (Gated
DeltaNet), Kimi Linear, GLM-5-next and Bailing-hybrid run KDA (the delta rule with per-channel
gates). Their modeling modules call module-level functions (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, chunk_kimi_delta_attention, recurrent_kimi_delta_attention)
which transformers binds to flash-linear-attention's Triton kernels when `fla` is installed
(they fail on a CPU) or else to slow reference PyTorch. install() (called by
linattn.hf.register()) rebinds those names, in every modeling module of this transformers that
defines them, to the functions below: the same signatures and results ([batch, seq, heads,
dim] in, the output in the query's dtype, the state float32 or the inputs' float64), computed by
linattn.torch.gated_delta_rule (forward and backward in C++). generate() keeps the models' own
caches: the state goes in and out through initial_state / output_final_state as before.
The short causal convolutions in front of these layers (causal_conv1d_fn, causal_conv1d_update,
in the same modules) run on linattn.torch.causal_conv1d too."""

import functools as _functools
import importlib as _importlib
import os as _os
import warnings as _warnings

import torch

from ..torch.conv1d import causal_conv1d
from ..torch.delta import gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "chunk_kda", "recurrent_kda", "causal_conv1d_fn",
           "causal_conv1d_update", "install", "patched_modules"]

# transformers' function names -> linattn's
_DELTA_RULE = {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
               "torch_recurrent_gated_delta_rule": "recurrent_gated_delta_rule"}
_KDA = {"chunk_kimi_delta_attention": "chunk_kda", "recurrent_kimi_delta_attention": "recurrent_kda"}
# replaced only in modules with one of the above (other models' convolutions are not looked at)
_CONV = {"causal_conv1d_fn": "causal_conv1d_fn", "causal_conv1d_update": "causal_conv1d_update"}

# (module name, function name) -> transformers' own function, kept when install() replaces it
ORIGINALS = {}


def _not_packed(fn, kwargs):
    for packed in ("cu_seqlens", "seq_idx"):
        if kwargs.get(packed) is not None:
            raise ValueError("%s: %s is not supported: linattn keeps no packed sequences apart (pass one sequence "
                             "per batch row)" % (fn, packed))


def _run(fn, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs):
    _not_packed(fn, kwargs)
    for name, t in (("query", query), ("key", key), ("value", value), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: %s must be a torch.Tensor, got %s" % (fn, name, type(t).__name__))
    if query.dim() != 4 or value.dim() != 4:
        raise ValueError("%s: query and value must be [batch, seq, heads, dim], got %s and %s"
                         % (fn, tuple(query.shape), tuple(value.shape)))
    # As transformers' fallbacks: 16-bit (and float32) inputs computed in float32, float64 kept.
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))
    gates = g.transpose(1, 2).to(dtype)
    out, state = gated_delta_rule(q, k, v, gates, beta.transpose(1, 2).to(dtype),
                                  initial_state=None if initial_state is None else initial_state.to(dtype),
                                  return_state=True, use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel))
    return out.transpose(1, 2).contiguous().to(query.dtype), (state if output_final_state else None)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' torch_chunk_gated_delta_rule on linattn: query, key [B, T, H_k, d_k], value
    [B, T, H, d_v], g and beta [B, T, H], initial_state [B, H, d_k, d_v]; returns (output
    [B, T, H, d_v], final state or None). chunk_size is accepted for the signature (linattn's
    chunk is 64)."""
    return _run("chunk_gated_delta_rule", query, key, value, g, beta, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, kwargs)


def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' torch_recurrent_gated_delta_rule (the decoding step, any length) on linattn."""
    return _run("recurrent_gated_delta_rule", query, key, value, g, beta, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, kwargs)


def chunk_kda(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' chunk_kimi_delta_attention (fla's chunk_kda) on linattn: as
    chunk_gated_delta_rule with per-channel log-gates g [B, T, H, d_k]."""
    return _run("chunk_kda", query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                kwargs)


def recurrent_kda(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel=False,
                  **kwargs):
    """transformers' recurrent_kimi_delta_attention (fla's fused_recurrent_kda) on linattn."""
    return _run("recurrent_kda", query, key, value, g, beta, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, kwargs)


def _conv_dtype(fn, activation, weight):
    if activation not in (None, "silu", "swish"):
        raise ValueError("%s: activation must be None, \"silu\" or \"swish\", got %r" % (fn, activation))
    # As transformers' fallbacks compute in the weight's dtype: 16-bit computed in float32 here.
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' causal_conv1d_fn on linattn: hidden_states [B, C, T], weight [C, W], bias
    [C] or None; returns act(causal depthwise convolution) [B, C, T] in hidden_states' dtype."""
    _not_packed("causal_conv1d_fn", kwargs)
    dtype = _conv_dtype("causal_conv1d_fn", activation, weight)
    out = causal_conv1d(hidden_states.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
                        activation=activation)
    return out.to(hidden_states.dtype)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    """transformers' causal_conv1d_update on linattn: the new positions hidden_states [B, C, T]
    after conv_state [B, C, S] (S >= W − 1: the last inputs), which is updated in place to the
    last S inputs, as transformers does; returns the outputs [B, C, T]."""
    dtype = _conv_dtype("causal_conv1d_update", activation, weight)
    state_len, width = conv_state.shape[-1], weight.shape[-1]
    if state_len < width - 1:
        raise ValueError("causal_conv1d_update: conv_state holds %d positions; the kernel of width %d needs %d"
                         % (state_len, width, width - 1))
    tail = conv_state[..., state_len - (width - 1):]
    out = causal_conv1d(hidden_states.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
                        initial_state=tail.to(dtype), activation=activation)
    conv_state.copy_(torch.cat([conv_state, hidden_states.to(conv_state.dtype)], dim=-1)[..., -state_len:])
    return out.to(hidden_states.dtype)


@_functools.lru_cache(maxsize=None)
def patched_modules():
    """The modeling modules of the installed transformers that define one of the functions
    replaced here, found by their source text (so no module is imported that does not need it):
    a tuple of (module name, {transformers' name: linattn's name})."""
    import transformers.models as models
    root = models.__path__[0]
    found = []
    for folder in sorted(_os.listdir(root)):
        path = _os.path.join(root, folder, "modeling_%s.py" % folder)
        if not _os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        names = {ours: theirs for table in (_DELTA_RULE, _KDA) for ours, theirs in table.items()
                 if "def %s(" % ours in text}
        if names:
            names.update({ours: theirs for ours, theirs in _CONV.items() if "def %s(" % ours in text})
            found.append(("transformers.models.%s.modeling_%s" % (folder, folder), names))
    return tuple(found)


def install():
    """Rebinds the delta-rule functions of every modeling module in patched_modules() to
    linattn's (idempotent). A module that fails to import (a model this environment cannot
    load) is skipped with a warning that names it."""
    for module_name, names in patched_modules():
        try:
            module = _importlib.import_module(module_name)
        except Exception as error:  # a model whose optional dependencies are missing
            _warnings.warn("linattn.hf.register: %s not patched (import failed: %s)" % (module_name, error),
                           RuntimeWarning, stacklevel=3)
            continue
        for theirs, ours in names.items():
            ORIGINALS.setdefault((module_name, theirs), getattr(module, theirs))
            setattr(module, theirs, globals()[ours])
