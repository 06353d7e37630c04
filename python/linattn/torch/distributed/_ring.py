"""Exact softmax attention over ranks: ring attention (Liu et al., 2023).

Each rank keeps its queries; the key/value blocks travel round the ring (rank r sends to r+1),
one step per rank, the next block's transfer overlapping this block's work. Each (query
segment, key segment) pair is one call of linattn's softmax kernel, which returns the pair's
output o and log-sum-exp l; pairs are merged as online softmax does:
    lse = log(e^lse + e^l),  out = e^(lse_old − lse)·out + e^(l − lse)·o.
Under a causal mask, a key segment after the query segment is skipped, the query's own segment
is causal, an earlier one is full.

Backward (as flash attention's, with the merged out and lse): for every pair, linattn's softmax
backward given the final out and lse yields exactly that pair's share of dq, dk, dv, since
P_ij = exp(s_ij − lse_i) and D_i = Σ_c dout_ic·out_ic are those of the whole row. dq stays on
the rank; each block's dk, dv accumulate as the block makes a second trip round the ring, and
arrive at its owner after P steps."""

import torch

from .._ops import OPS

_FORWARD = OPS["softmax"].forward_op
_BACKWARD = OPS["softmax"].backward_op


def _pairs(causal, q_segs, k_segs):
    """(query segment, key segment, causal) for every pair that has work."""
    for qs in q_segs:
        for ks in k_segs:
            if not causal or ks.stop <= qs.start:
                yield qs, ks, False
            elif ks.start == qs.start:
                yield qs, ks, True


def _key_lengths(lengths, ks):
    """key_lengths of one key segment: how many of its positions are below each item's length."""
    if lengths is None:
        return None
    return (lengths - ks.start).clamp(0, ks.length)


def _merge(out, lse, o, l):
    """Folds (o, l) into (out, lse) in place; rows with no key so far keep lse = −inf."""
    new = torch.logaddexp(lse, l)
    finite = new > float("-inf")
    a = torch.where(finite, torch.exp(lse - new), 0).unsqueeze(-1)
    b = torch.where(finite, torch.exp(l - new), 0).unsqueeze(-1)
    out.mul_(a).add_(b * o)
    lse.copy_(new)


def _pass_on(g, segs, src, tensors):
    """Sends tensors [B,H,n_src,·] of block src to the next rank and receives the same tensors
    of block src−1 from the previous one; returns the wait for them."""
    n_prev = sum(s.length for s in segs[(src - 1) % g.size])
    shapes = [(*t.shape[:2], n_prev, t.shape[-1]) for t in tensors]
    return g.exchange(tensors, (g.rank + 1) % g.size, (g.rank - 1) % g.size, shapes)


class RingSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lengths, causal, scale, g, segs):
        # q [B,H,n,d], k [B,H,n,d], v [B,H,n,dv] (this rank's); segs[r]: rank r's segments.
        B, H, n, _ = q.shape
        out = q.new_zeros(B, H, n, v.shape[-1])
        lse = q.new_full((B, H, n), float("-inf"))
        block = (k, v)
        for step in range(g.size):
            src = (g.rank - step) % g.size
            if step + 1 < g.size:  # the next block is on its way while this one is used
                wait = _pass_on(g, segs, src, block)
            for qs, ks, pair_causal in _pairs(causal, segs[g.rank], segs[src]):
                kl = _key_lengths(lengths, ks)
                if kl is not None and not bool(kl.any()):
                    continue
                o, l = _FORWARD(qs.rows(q).contiguous(), ks.rows(block[0]).contiguous(),
                                ks.rows(block[1]).contiguous(), kl, pair_causal, scale)
                _merge(qs.rows(out), qs.rows(lse), o, l)
            if step + 1 < g.size:
                block = tuple(wait())
        ctx.save_for_backward(q, k, v, out, lse, lengths)
        ctx.causal, ctx.scale, ctx.g, ctx.segs = causal, scale, g, segs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, lengths = ctx.saved_tensors
        g, segs = ctx.g, ctx.segs
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        block = (k, v)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # the accumulators travelling with the block
        for step in range(g.size):
            src = (g.rank - step) % g.size
            if step + 1 < g.size:
                wait = _pass_on(g, segs, src, block)
            for qs, ks, pair_causal in _pairs(ctx.causal, segs[g.rank], segs[src]):
                kl = _key_lengths(lengths, ks)
                if kl is not None and not bool(kl.any()):
                    continue
                rows = lambda x: qs.rows(x).contiguous()  # noqa: E731
                gq, gk, gv = _BACKWARD(rows(q), ks.rows(block[0]).contiguous(), ks.rows(block[1]).contiguous(), kl,
                                       rows(dout), rows(out), qs.rows(lse).contiguous(), pair_causal, ctx.scale)
                qs.rows(dq).add_(gq)
                ks.rows(dk).add_(gk)
                ks.rows(dv).add_(gv)
            # The block's gradients go on to the next rank, which uses the block next; after the
            # last step they reach the block's owner.
            if g.size == 1:
                break
            dk, dv = _pass_on(g, segs, src, (dk, dv))()
            if step + 1 < g.size:
                block = tuple(wait())
        return dq, dk, dv, None, None, None, None, None
