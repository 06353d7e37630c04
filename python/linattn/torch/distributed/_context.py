"""Efficient Attention and Linformer over ranks: both reach the keys only through a sum over
positions, so one all-reduce of a [d or s, ·] matrix per (batch, head) gives every rank the
whole sequence's.

Efficient:  G = Σ_j softmax_j(k_j·scale)ᵀ v_j  (softmax over positions, per feature), made
            finite by the whole sequence's largest logit per feature (an all-reduce of
            maxima; it cancels), then out = softmax over features of (q·scale) times G.
Linformer:  K' = Σ_j E[:, j] k_jᵀ, V' = Σ_j F[:, j] v_jᵀ over the valid keys (each rank
            uses its own columns of E and F), then linattn's exact softmax attention of the
            queries over the s projected keys."""

import torch

from .. import softmax_attention
from ._kernelized import key_mask, ratio


def _masked(x, mask):
    return x if mask is None else torch.where(mask, x, 0)


def efficient(g, segs, q, k, v, lengths, scale):
    mine = segs[g.rank]
    masks = [key_mask(lengths, s) for s in mine]
    logits = [s.rows(k) * scale if m is None else (s.rows(k) * scale).masked_fill(~m, float("-inf"))
              for s, m in zip(mine, masks)]
    top = g.all_reduce_max(torch.stack([x.amax(2, keepdim=True) for x in logits]).amax(0))
    top = torch.where(torch.isfinite(top), top, 0)  # no key at all: G = 0
    ones = v.new_ones(*v.shape[:3], 1)
    context = sum(torch.exp(x - top).transpose(-1, -2) @ _masked(torch.cat([s.rows(v), s.rows(ones)], -1), m)
                  for x, s, m in zip(logits, mine, masks))  # [B,H,d,d_v+1]
    G = ratio(g.all_reduce_sum(context), 0.0)
    return torch.softmax(q * scale, -1) @ G


def linformer(g, segs, q, k, v, e, f, lengths, scale):
    d = k.shape[-1]
    kv = torch.cat([k, v], -1)
    projected = 0
    for s in segs[g.rank]:
        x = _masked(s.rows(kv), key_mask(lengths, s))
        projected = projected + torch.cat([e[..., s.start:s.stop] @ x[..., :d], f[..., s.start:s.stop] @ x[..., d:]], -1)
    projected = g.all_reduce_sum(projected)  # [B,H,s,d+d_v]
    return softmax_attention(q, projected[..., :d].contiguous(), projected[..., d:].contiguous(), scale=scale)
