"""linattn.hf.delta: transformers' linear-attention LLMs on linattn's gated delta rule.

Qwen3-Next, Qwen3.5 (and its MoE), OLMo-hybrid and Qwen4-exp run the gated delta rule (Gated
DeltaNet), Kimi Linear, GLM-5-next and Bailing-hybrid run KDA (the delta rule with per-channel
gates). Their modeling modules call module-level functions (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, chunk_kimi_delta_attention, recurrent_kimi_delta_attention)
which transformers binds to flash-linear-attention's Triton kernels when `fla` is installed
(they fail on a CPU) or else to slow reference PyTorch. install() (called by
linattn.hf.register()) rebinds those names, in every modeling module of transformers that
defines them (imported already, or later: an import hook), to the functions below: the same signatures and results ([batch, seq, heads,
dim] in, the output in the query's dtype, the state float32 or the inputs' float64), computed by
linattn.torch.gated_delta_rule (forward and backward in C++). generate() keeps the models' own
caches: the state goes in and out through initial_state / output_final_state as before.
The short causal convolutions in front of these layers (causal_conv1d_fn, causal_conv1d_update,
in the same modules) run on linattn.torch.causal_conv1d too."""

import importlib.abc as _importlib_abc
import sys as _sys

import torch

from ..torch.conv1d import causal_conv1d
from ..torch.delta import gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "chunk_kda", "recurrent_kda", "causal_conv1d_fn",
           "causal_conv1d_update", "install", "replaced_names"]

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


def _compute_dtype(x):
    """As transformers' fallbacks: 16-bit (and float32) computed in float32, float64 kept."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _run(fn, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs):
    _not_packed(fn, kwargs)
    for name, t in (("query", query), ("key", key), ("value", value), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: %s must be a torch.Tensor, got %s" % (fn, name, type(t).__name__))
    if query.dim() != 4 or value.dim() != 4:
        raise ValueError("%s: query and value must be [batch, seq, heads, dim], got %s and %s"
                         % (fn, tuple(query.shape), tuple(value.shape)))
    dtype = _compute_dtype(query)
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


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' causal_conv1d_fn on linattn: hidden_states [B, C, T], weight [C, W], bias
    [C] or None; returns act(causal depthwise convolution) [B, C, T] in hidden_states' dtype."""
    _not_packed("causal_conv1d_fn", kwargs)
    dtype = _compute_dtype(weight)  # transformers' computes in the weight's dtype
    out = causal_conv1d(hidden_states.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
                        activation=activation)
    return out.to(hidden_states.dtype)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    """transformers' causal_conv1d_update on linattn: the new positions hidden_states [B, C, T]
    after conv_state [B, C, S] (S >= W − 1: the last inputs), which is updated in place to the
    last S inputs, as transformers does; returns the outputs [B, C, T]."""
    dtype = _compute_dtype(weight)
    state_len, width = conv_state.shape[-1], weight.shape[-1]
    if state_len < width - 1:
        raise ValueError("causal_conv1d_update: conv_state holds %d positions; the kernel of width %d needs %d"
                         % (state_len, width, width - 1))
    tail = conv_state[..., state_len - (width - 1):]
    out = causal_conv1d(hidden_states.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
                        initial_state=tail.to(dtype), activation=activation)
    conv_state.copy_(torch.cat([conv_state, hidden_states.to(conv_state.dtype)], dim=-1)[..., -state_len:])
    return out.to(hidden_states.dtype)


def replaced_names(module):
    """{transformers' name: linattn's} for the functions of `module` that install() replaces: the
    delta-rule and KDA functions it has and, in a module with one of them, its causal
    convolutions (other models' convolutions are not touched)."""
    names = {theirs: ours for table in (_DELTA_RULE, _KDA) for theirs, ours in table.items() if hasattr(module, theirs)}
    if names:
        names.update({theirs: ours for theirs, ours in _CONV.items() if hasattr(module, theirs)})
    return names


def _is_modeling_module(name):
    parts = name.split(".")
    return len(parts) == 4 and parts[:2] == ["transformers", "models"] and parts[3] == "modeling_" + parts[2]


def _patch(module):
    for theirs, ours in replaced_names(module).items():
        current = getattr(module, theirs)
        if current is not globals()[ours]:
            ORIGINALS[(module.__name__, theirs)] = current
            setattr(module, theirs, globals()[ours])


class _Loader:
    """A modeling module's own loader, which patches the module once it has run."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, attr):  # get_source, get_code, ...: the original loader's
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)


class _PatchOnImport(_importlib_abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of transformers' modeling modules as they are
    imported, so a model imported after register() runs on linattn too, and register() imports
    none of them."""

    def find_spec(self, fullname, path, target=None):
        if not _is_modeling_module(fullname):
            return None
        for finder in _sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install():
    """Rebinds the delta-rule and KDA functions (and their modules' causal convolutions) of
    transformers' modeling modules to linattn's: those imported already, and every one imported
    later (an import hook). Idempotent."""
    for name, module in list(_sys.modules.items()):
        if module is not None and _is_modeling_module(name):
            _patch(module)
    if not any(isinstance(finder, _PatchOnImport) for finder in _sys.meta_path):
        _sys.meta_path.insert(0, _PatchOnImport())
