"""Causal linear attention's recurrent form on torch tensors, state in and state out: what
linattn.hf's generation cache decodes with, at a cost per token that does not depend on how
many tokens came before.

A LinearState holds, per batch row and head, the sums over the keys that entered it

    sums = Σ_j φ(k_j) v_jᵀ  [m', d_v],   normaliser = Σ_j φ(k_j)  [m'],

so a query reads num = φ(q)·sums, den = φ(q)·normaliser. Plain features (elu, relu, focused,
Hedgehog's, any non-negative map) are stored as they are (shift None). FAVOR's features are
exponentials, φ_r(x) = s_r·e^{L_r(x)}, and are stored on a per-feature scale c_r, the running
maximum of the key logits that entered (sums = Σ_j s_jr e^{L_jr − c_r} v_j), as the C++ kernels
keep them: every stored weight is <= 1 at any finite logit, so nothing overflows. A read
returns num and den on the scale e^{R}, R = max_r(L_q,r + c_r), which the caller combines with
its other terms (the sliding window's) before dividing. Every function returns new tensors and
leaves its inputs unchanged, so a state can be kept, copied or reordered (beam search) freely.

For bfloat16/float16 inputs the state is float32: features, logits and values are widened as
they enter, and reads return float32 (the caller rounds its output once)."""

from typing import NamedTuple, Optional

import torch

from ._ops import accumulator_dtype

__all__ = ["LinearState", "empty_state", "enter", "read", "decay"]


class LinearState(NamedTuple):
    sums: torch.Tensor                   # [B, H, m', d_v]
    normaliser: torch.Tensor             # [B, H, m']
    shift: Optional[torch.Tensor] = None  # [B, H, m'] (log form: FAVOR), None (plain features)

    @property
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self if t is not None)

    def map(self, fn):
        """The state with fn applied to each tensor (index_select for beam search, say)."""
        return LinearState(*(None if t is None else fn(t) for t in self))


def empty_state(batch, heads, features, value_dim, *, log_form, like):
    """The state of no keys: zeros, and for log form shifts of −inf (no key has set a scale)."""
    like = like.new_empty(0, dtype=accumulator_dtype(like.dtype))
    shift = like.new_full((batch, heads, features), float("-inf")) if log_form else None
    return LinearState(like.new_zeros((batch, heads, features, value_dim)), like.new_zeros((batch, heads, features)),
                       shift)


def enter(state, values, features=None, logits=None, factors=None, mask=None, log_weight=None):
    """The state after keys j = 1..n enter it: values [B, H, n, d_v] with their plain features
    [B, H, n, m'] or (log form) their logits L [B, H, n, m'] and, for FAVOR's trig map, factors
    s [B, H, n, m'] (φ = s·e^{L}; None means 1). mask [B, n] (bool, optional): only the keys
    where it is True enter (padding stays out; φ(0) ≠ 0, so zeroing the inputs would not do).
    log_weight [B, H, n] (optional): each key's term weighed by e^{log_weight} (a decay of its
    distance to the query that reads the state next)."""
    if values.shape[2] == 0:
        return state
    dtype = state.sums.dtype
    values, features, logits, factors = (None if t is None else t.to(dtype) for t in (values, features, logits, factors))
    if log_weight is not None:  # a factor of φ: a product with the features, a sum with the logits
        log_weight = log_weight.to(dtype)[..., None]
        if features is not None:
            features = features * torch.exp(log_weight)
        else:
            logits = logits + log_weight
    if mask is not None:  # where, not a product: whatever a masked position holds, inf or NaN, stays out
        keep = mask[:, None, :, None]
        values = torch.where(keep, values, torch.zeros((), dtype=dtype, device=values.device))
        if features is not None:
            features = torch.where(keep, features, torch.zeros((), dtype=dtype, device=features.device))
        if factors is not None:
            factors = torch.where(keep, factors, torch.zeros((), dtype=dtype, device=factors.device))
    if state.shift is None:
        # sums += Σ_j φ(k_j) v_jᵀ, normaliser += Σ_j φ(k_j)
        return LinearState(state.sums + torch.einsum("bhnm,bhnd->bhmd", features, values),
                           state.normaliser + features.sum(dim=2))
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None, :, None], float("-inf"))
    # c' = max(c, max_j L_j); the old sums move to the new scale by e^{c − c'} (0 while c = −inf).
    # A feature no key has reached yet keeps c' = −inf: measured from 0 instead, every term is 0.
    shift = torch.maximum(state.shift, logits.amax(dim=2))
    origin = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    decay = torch.exp(state.shift - origin)
    weights = torch.exp(logits - origin[:, :, None, :])
    if factors is not None:
        weights = weights * factors
    return LinearState(state.sums * decay[..., None] + torch.einsum("bhnm,bhnd->bhmd", weights, values),
                       state.normaliser * decay + weights.sum(dim=2), shift)


def decay(state, factor):
    """The state with every term times factor [B, H] (a decay step: e^{λ} per position)."""
    factor = factor.to(state.sums.dtype)
    return LinearState(state.sums * factor[..., None, None], state.normaliser * factor[..., None], state.shift)


def read(state, features=None, logits=None, factors=None):
    """One query per batch row and head against the state -> (num [B, H, d_v], den [B, H],
    R [B, H] or None). Plain: num = φ(q)·sums, den = φ(q)·normaliser (R None). Log form: the
    query's logits L_q [B, H, m'] (and factors): the true num and den are e^{R} times those
    returned, R = max_r(L_q,r + c_r), −inf (and num = den = 0) while no key has entered."""
    dtype = state.sums.dtype
    features, logits, factors = (None if t is None else t.to(dtype) for t in (features, logits, factors))
    if state.shift is None:
        return (torch.einsum("bhm,bhmd->bhd", features, state.sums),
                torch.einsum("bhm,bhm->bh", features, state.normaliser), None)
    total = logits + state.shift
    top = total.amax(dim=-1)
    weights = torch.exp(total - torch.where(torch.isfinite(top), top, torch.zeros_like(top))[..., None])
    if factors is not None:
        weights = weights * factors
    return (torch.einsum("bhm,bhmd->bhd", weights, state.sums), torch.einsum("bhm,bhm->bh", weights, state.normaliser),
            top)
