"""The gated delta rule and KDA over ranks (context parallelism): linattn.torch.gated_delta_rule
does the math on each segment, this module the collectives and the fold of the segments' maps.

The recurrence S_t = (I − β_t k_t k_tᵀ)·diag(e^{g_t})·S_{t−1} + β_t k_t v_tᵀ is affine in the
state, so a segment maps the state S_0 before it to

    S_end = T·S_0 + B,       o_t = o⁰_t + q̃_tᵀ·S_0

with B and o⁰ its own run from S_0 = 0, T [d_k, d_k] the product of its transitions and
q̃_t = scale·T_tᵀ q_t (T_t the product up to t). T and q̃ are one more run of the same kernel:
from S_0 = I with values 0 the state is T_t and the output scale·T_tᵀ q_t. Each rank runs its
segments twice (no collective), all-gathers every segment's [T | B] (d_k·(d_k + d_v) numbers per
batch row and head, whatever n), folds the segments before each of its own in sequence order,
S ← T·S + B, and adds q̃ᵀ·S_0. The backward is autograd's through these steps: the kernel's own
backward for each run, the all-gather's adjoint (_comm) for the states."""

import torch

from ..delta import gated_delta_rule as _local


def check(q, k, v, gates, beta, scale, l2norm):
    """Shapes, dtypes and options, by the kernel itself on no rows (the values are checked per
    segment by segment_maps, once the ranks agree on the sizes)."""
    _local(*(x[:, :, :0] for x in (q, k, v, gates, beta)), scale=scale, use_qk_l2norm_in_kernel=l2norm)


def segment_maps(segs_mine, q, k, v, gates, beta, scale, l2norm):
    """Per segment of this rank: (o⁰, q̃, [T | B]) — [B,H,len,d_v], [B,H,len,d_k] and
    [B,H,d_k,d_k+d_v]. Raises the kernel's errors (bad values) before any collective."""
    batch, heads, dk = v.shape[0], v.shape[1], q.shape[3]
    eye = torch.eye(dk, dtype=v.dtype).expand(batch, heads, dk, dk).contiguous()
    maps = []
    for s in segs_mine:
        qs, ks, gs, bs = s.rows(q), s.rows(k), s.rows(gates), s.rows(beta)
        o0, b = _local(qs, ks, s.rows(v), gs, bs, scale=scale, return_state=True, use_qk_l2norm_in_kernel=l2norm)
        zeros = v.new_zeros(batch, heads, s.length, dk)
        qt, t = _local(qs, ks, zeros, gs, bs, scale=scale, initial_state=eye, return_state=True,
                       use_qk_l2norm_in_kernel=l2norm)
        maps.append((o0, qt, torch.cat([t, b], -1)))
    return maps


def attention(g, segs, maps, dk):
    """This rank's rows of the output from its segments' maps (segment_maps) and every rank's
    (one all-gather)."""
    mine = segs[g.rank]
    every = g.all_gather(torch.stack([m[2] for m in maps]))  # [P, segments, B, H, d_k, d_k + d_v]
    order = sorted((s.start, r, j) for r, rank_segs in enumerate(segs) for j, s in enumerate(rank_segs))
    out = []
    for (o0, qt, _), s in zip(maps, mine):
        state = torch.zeros_like(every[0, 0, ..., dk:])
        for start, r, j in order:
            # The segments before this one, as a 0/1 weight rather than a selection, so that every
            # rank's backward reaches the all-gather (whose adjoint is a collective) even where no
            # segment comes before.
            w = 1.0 if start < s.start else 0.0
            t, b = every[r, j, ..., :dk], every[r, j, ..., dk:]
            state = state + w * (t @ state + b - state)
        out.append(o0 + qt @ state)
    return torch.cat(out, 2)
