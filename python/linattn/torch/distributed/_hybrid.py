"""The sliding-window + linear hybrid over ranks (docs/methods/hybrid.md), in torch operations so
that autograd derives the backward:

    out_i = (γ_h Σ_{j∈W(i)} e^{s_ij − M_i} v_j + Σ_{j∉W(i)} φ(q_i)·φ(k_j) v_j)
            / (γ_h Σ_{j∈W(i)} e^{s_ij − M_i} + Σ_{j∉W(i)} φ(q_i)·φ(k_j) + eps)

The linear sums over every key query i sees (all keys; causal: j <= i) come from linear
attention's collectives (_kernelized.sums: one all-reduce of [S | z], or the all-gather of every
segment's for the causal prefix). The window's keys are this rank's rows plus a halo of the
neighbouring ranks' rows (one all-gather of every segment's edge rows of [k | v | φ(k)]); the
window's linear weights are taken back out of the sums, and its softmax weights put in.

Taking them out is a subtraction of non-negative terms where the single-process kernel sums only
the keys outside the window: the difference is at most the unit roundoff times
Σ_{all j} φ(q_i)·φ(k_j)(|v_j| + 1) / the denominator, the rounding of the sums linear attention
itself makes, and the denominator holds γ_h (the window's largest weight is 1) whenever the
window has a key."""

import torch

from . import _kernelized
from ._kernelized import key_mask


def attention(g, segs, q, k, v, fq, fk, lengths, causal, window, scale, gate, eps):
    """This rank's out [B,H,n,d_v]. fq, fk: this rank's features [B,H,n,m'] (≥ 0); gate:
    window_gate [H] or None (γ = 1)."""
    mine = segs[g.rank]
    n_total = sum(s.length for r in segs for s in r)
    # fq, fk are features already; the keys' are masked inside sums() by key_lengths.
    num_den = _kernelized.sums(g, segs, fq, fk, v, lengths, causal, _kernelized.Features("identity"))
    if window == 0:
        return torch.cat([_kernelized.ratio(x, eps) for x in num_den], 2)
    left, right = (window - 1, 0) if causal else (window, window)
    size = left + 1 + right
    d, dv = k.shape[-1], v.shape[-1]
    ones = v.new_ones(*v.shape[:3], 1)
    rows = []
    for s in mine:
        keys = torch.cat([s.rows(k), s.rows(v), s.rows(ones), s.rows(fk)], -1)
        mask = key_mask(lengths, s)
        rows.append(keys if mask is None else keys * mask)
    gamma = None if gate is None else torch.sigmoid(gate).view(1, -1, 1, 1)
    outs = []
    for s, x, (before, after), nd in zip(mine, rows, _kernelized.halos(g, segs, rows, left, right), num_den):
        win = torch.cat([before, x, after], 2).unfold(2, size, 1)  # [B,H,len,d+d_v+1+m',size]
        kw, v1w, fkw = win[..., :d, :], win[..., d:d + dv + 1, :], win[..., d + dv + 1:, :]
        # Key position of window slot t for the query at p: p − left + t; a key counts when it
        # lies in the sequence and below the item's key length.
        pos = torch.arange(s.start, s.stop).view(-1, 1) - left + torch.arange(size).view(1, -1)  # [len,size]
        valid = ((pos >= 0) & (pos < n_total)).view(1, 1, *pos.shape)
        if lengths is not None:
            valid = valid & (pos.view(1, 1, *pos.shape) < lengths.view(-1, 1, 1, 1))
        scores = torch.einsum("bhld,bhldt->bhlt", s.rows(q), kw) * scale
        scores = scores.masked_fill(~valid, float("-inf"))
        top = scores.amax(-1, keepdim=True)  # M_i: part of the model, so the gradient goes through it
        top = torch.where(torch.isfinite(top), top, 0)  # no key in the window: every weight is 0 anyway
        weights = torch.exp(scores - top).masked_fill(~valid, 0)
        if gamma is not None:
            weights = weights * gamma
        linear = torch.einsum("bhlm,bhlmt->bhlt", s.rows(fq), fkw).masked_fill(~valid, 0)
        nd = nd + torch.einsum("bhlt,bhlct->bhlc", weights - linear, v1w)
        outs.append(_kernelized.ratio(nd, eps))
    return torch.cat(outs, 2)
