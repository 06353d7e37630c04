"""The sliding-window + linear hybrid over ranks (docs/methods/hybrid.md), in torch operations so
that autograd derives the backward:

    out_i = (γ_h Σ_{j∈W(i)} e^{s_ij − M_i} v_j + Σ_{j∉W(i)} φ(q_i)·φ(k_j) v_j)
            / (γ_h Σ_{j∈W(i)} e^{s_ij − M_i} + Σ_{j∉W(i)} φ(q_i)·φ(k_j) + eps)

The linear part sums only the keys outside the window, as the single-process kernel does (a
sum over every key minus the window's would cancel: its error, u·Σ_{j∈W} φ(q_i)·φ(k_j)·|v_j|
over a denominator as small as γ_h, grows without bound as the gate closes). Causal, those are
the keys j <= i − w: the causal sums of the queries against the key stream delayed by w rows.
Not causal, the keys j <= i − w − 1 and j >= i + w + 1: the same with a delay of w + 1, plus
the sums from the end against the stream advanced by w + 1. The segments before (after) a
segment come in through their states (one all-gather for both streams); the delayed and
advanced rows and the window's keys come from a halo of the neighbouring ranks' rows of
[k | v | 1 | φ(k)] (one all-gather of every segment's first and last w (+1) rows).

FAVOR's features estimate e^{q·k} itself, so there the window is unshifted and each row is put
on one scale R_i instead (attention's favor argument), with key features shifted by the whole
sequence's largest key logit per feature, as the kernelized path over ranks does."""

import math

import torch

from . import _kernelized
from ._kernelized import key_mask


def attention(g, segs, q, k, v, fq, fk, lengths, causal, window, scale, gate, eps, favor=None):
    """This rank's out [B,H,n,d_v]. fq, fk: this rank's features [B,H,n,m'] (≥ 0); gate:
    window_gate [H] or None (γ = 1). favor: (L_q, c) for FAVOR's features, whose weights
    estimate e^{s} itself: then fq is None, fk = exp(L_k − c) with c [B,H,1,m'] the whole
    sequence's largest key logit per feature, and every term of row i is shifted by
    R_i = max(M_i, max_r(L_q,ir + c_r)) (detached: a shift of the whole row, eps included, so
    it changes nothing but the range); the window's weights are e^{s − R_i}, not e^{s − M_i}."""
    mine = segs[g.rank]

    def favor_rows(Lq, top=None):
        """FAVOR's query features exp(L_q + c − R) and eps·e^{−R} for rows Lq, window maxima top."""
        lin = (Lq + favor[1]).detach().amax(-1, keepdim=True)
        R = lin if top is None else torch.maximum(lin, top.detach())
        # φ = exp(L)/√m' on each side; eps·e^{−R} as e^{log eps − R} (eps = 0: 0 at any R, never 0·inf)
        eps_rows = torch.exp(math.log(eps) - R) if eps > 0 else torch.zeros_like(R)
        return torch.exp(Lq + favor[1] - R) / Lq.shape[-1], eps_rows, R

    if window == 0:  # plain linear attention; the gate scales nothing
        if favor is not None:
            fq, eps_rows, _ = favor_rows(favor[0])
        num_den = _kernelized.sums(g, segs, fq, fk, v, lengths, causal)
        out = torch.cat([_kernelized.ratio(x, eps if favor is None else s.rows(eps_rows))
                         for x, s in zip(num_den, mine)], 2)
        return out if gate is None else out + 0 * gate.sum()  # a zero gradient for the gate, as in one process
    n_total = sum(s.length for r in segs for s in r)
    shift = window if causal else window + 1  # the linear part's nearest keys: i − shift (and i + shift)
    left, right = (window - 1, 0) if causal else (window, window)  # the window: keys i − left .. i + right
    size = left + 1 + right
    d, dv = k.shape[-1], v.shape[-1]
    ones = v.new_ones(*v.shape[:3], 1)
    rows = []
    for s in mine:
        keys = torch.cat([s.rows(k), s.rows(v), s.rows(ones), s.rows(fk)], -1)
        mask = key_mask(lengths, s)
        rows.append(keys if mask is None else keys * mask)
    # ext: the global rows a − shift .. b + shift − 1 (b + 0 causal) of a segment [a, b); local row i is ext row i + shift
    ext = [torch.cat([before, x, after], 2)
           for x, (before, after) in zip(rows, _kernelized.halos(g, segs, rows, shift, 0 if causal else shift))]
    # The window of each segment: scores over its slots, and the row shift (M_i; FAVOR: R_i).
    windows = []
    for s, x in zip(mine, ext):
        win = x[:, :, shift - left:shift - left + s.length + size - 1].unfold(2, size, 1)  # [B,H,len,d+d_v+1+m',size]
        kw, v1w = win[..., :d, :], win[..., d:d + dv + 1, :]
        # Key position of window slot t for the query at p: p − left + t; a key counts when it
        # lies in the sequence and below the item's key length.
        pos = torch.arange(s.start, s.stop).view(-1, 1) - left + torch.arange(size).view(1, -1)  # [len,size]
        valid = ((pos >= 0) & (pos < n_total)).view(1, 1, *pos.shape)
        if lengths is not None:
            valid = valid & (pos.view(1, 1, *pos.shape) < lengths.view(-1, 1, 1, 1))
        scores = torch.einsum("bhld,bhldt->bhlt", s.rows(q), kw) * scale
        scores = scores.masked_fill(~valid, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        if favor is None:  # M_i: part of the model, so the gradient goes through it
            fq_seg, eps_seg = s.rows(fq), eps
            top = torch.where(torch.isfinite(top), top, 0)  # no key in the window: every weight is 0 anyway
        else:
            fq_seg, eps_seg, top = favor_rows(s.rows(favor[0]), top)
        windows.append((scores, valid, v1w, top, fq_seg, eps_seg))
    split = lambda x: (x[..., d + dv + 1:], x[..., d:d + dv + 1])  # noqa: E731 (φ(k), [v | 1])
    delayed = [split(x[:, :, :s.length]) for x, s in zip(ext, mine)]  # rows i − shift
    fqs = [[w[4] for w in windows]]
    fks, v1s, reverses = [[f for f, _ in delayed]], [[x for _, x in delayed]], [False]
    if not causal:
        advanced = [split(x[:, :, 2 * shift:2 * shift + s.length]) for x, s in zip(ext, mine)]  # rows i + shift
        fqs.append(fqs[0])
        fks.append([f for f, _ in advanced])
        v1s.append([x for _, x in advanced])
        reverses.append(True)
    linear = _kernelized.ordered_sums(g, segs, fqs, fks, v1s, reverses)
    gamma = None if gate is None else torch.sigmoid(gate).view(1, -1, 1, 1)
    outs = []
    for i, (scores, valid, v1w, top, _, eps_seg) in enumerate(windows):
        nd = linear[0][i] if causal else linear[0][i] + linear[1][i]
        weights = torch.exp(scores - top).masked_fill(~valid, 0)
        if gamma is not None:
            weights = weights * gamma
        outs.append(_kernelized.ratio(nd + torch.einsum("bhlt,bhlct->bhlc", weights, v1w), eps_seg))
    return torch.cat(outs, 2)
