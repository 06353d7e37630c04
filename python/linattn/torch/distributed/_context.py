"""Efficient Attention and Linformer over ranks: both reach the keys only through a sum over
positions, so one all-reduce of a [d or s, ·] matrix per (batch, head) gives every rank the
whole sequence's.

Efficient:  G = Σ_j softmax_j(k_j·scale)ᵀ v_j  (softmax over positions, per feature): each
            rank's context state [S | z | c] (the C++ efficient_key_state, with c its largest
            logit per feature), the sum over ranks on the largest shifts (an all-reduce of
            maxima, then of sums), then out = softmax over features of (q·scale) times S/z
            (efficient_apply_state).
Linformer:  K' = Σ_j E[:, j] k_jᵀ, V' = Σ_j F[:, j] v_jᵀ over the valid keys (each rank
            uses its own columns of E and F: the C++ linformer_project), then linattn's exact
            softmax attention of the queries over the s projected keys."""

from .. import softmax_attention
from .. import state as _state
from ._kernelized import local_lengths, total_state


def efficient(g, segs, q, k, v, lengths, scale):
    """Each segment's context state (linattn.torch.state.efficient_key_state: the kernelized
    states' layout, its shifts the largest logit per feature), their sum over this rank's
    segments and over ranks as the shifts require, then the queries against it."""
    states = [_state.efficient_key_state(s.rows(k), s.rows(v), scale=scale, key_lengths=local_lengths(lengths, s))
              for s in segs[g.rank]]
    return _state.efficient_apply_state(q, total_state(g, states, True), scale=scale)


def linformer(g, segs, q, k, v, e, f, lengths, scale):
    """Each segment's projection (linattn.torch.state.linformer_project: its keys at their own
    columns of e and f), their sum over ranks, then the queries' softmax attention over it."""
    d = k.shape[-1]
    projected = sum(_state.linformer_project(s.rows(k), s.rows(v), e, f, offset=s.start,
                                             key_lengths=local_lengths(lengths, s)) for s in segs[g.rank])
    projected = g.all_reduce_sum(projected)  # [B,H,s,d+d_v]
    return softmax_attention(q, projected[..., :d].contiguous(), projected[..., d:].contiguous(), scale=scale)
