"""Kernelized attention (elu, relu, focused, given features, FAVOR+) over ranks: linattn's state
operations (linattn.torch.state, C++ kernels with their backward) do the math, this module
only the collectives (whose adjoints _comm carries).

    out_i = φ(q_i)·S / (φ(q_i)·z + eps),  S = Σ_j φ(k_j) v_jᵀ [m', d_v],  z = Σ_j φ(k_j) [m']

over the keys query i sees. Non-causal: every rank sums its keys into a state [S | z | c] and
one all-reduce makes the whole sequence's; O(m'·d_v) per (batch, head), whatever n. Causal:
each segment's state is all-gathered and a segment runs causal_from_state from the sum of the
segments before it (an exclusive prefix over ranks).

FAVOR's per-feature shifts c (the largest key logit; linattn.torch.state) differ from rank to
rank: states add as c = max_i c_i, [S | z] = Σ_i [S_i | z_i]·exp(c_i − c), so the non-causal
path all-reduces the maxima first (m' numbers, no gradient) and the causal one gathers them
with the states, in one all-gather of [S | z | c]. The shifts carry no gradient: the result
does not depend on them.

The depthwise convolution of the focused map needs up to K−1 neighbouring rows of v from other
ranks: every segment's first and last K−1 rows are all-gathered (any row within K−1 of a
segment lies in those of the segment holding it).

The hybrid (_hybrid.py) still composes its linear part from the torch functions below
(FavorKeys, sums, ordered_sums), with the maps from linattn.torch.features / feature_logits (the
kernels' own): its sums skip each query's window, which the state operations do not express."""

import torch
import torch.nn.functional as F

from ... import _linattn
from .. import feature_maps as _feature_maps
from ..gated import gated_linear_attention as _gated_linear_attention
from .. import state as _state


def key_mask(lengths, seg):
    """[B,1,len,1] bool: which of the segment's positions are keys (below key_lengths), or None."""
    if lengths is None:
        return None
    pos = torch.arange(seg.start, seg.stop)
    return (pos.view(1, 1, -1, 1) < lengths.view(-1, 1, 1, 1))


class FavorKeys:
    """FAVOR's logits for the hybrid over ranks (linattn.torch.feature_logits, the kernels' own),
    and the whole sequence's key shift: c = the largest key logit per feature over all ranks'
    keys (fit)."""

    def __init__(self, projection, kernel, scale):
        self.projection, self.kernel, self.scale = projection, kernel, scale
        self.shift = None

    def logits(self, x, side):
        return _feature_maps.feature_logits(x, self.projection, kernel=self.kernel, scale=self.scale, side=side)

    def fit(self, g, k_segs, masks):
        with torch.no_grad():
            tops = []
            for k, mask in zip(k_segs, masks):
                L, _ = self.logits(k, "key")
                if mask is not None:
                    L = L.masked_fill(~mask, float("-inf"))
                tops.append(L.amax(2, keepdim=True))
            c = g.all_reduce_max(torch.stack(tops).amax(0))
            self.shift = torch.where(torch.isfinite(c), c, 0)  # −inf: no key at all (a 0 state)


def ratio(num_den, eps):
    """num / (den + eps) from [num | den]; 0 where the denominator is 0 (no key), as linattn."""
    den = num_den[..., -1:] + eps
    zero = den == 0
    return torch.where(zero, 0, num_den[..., :-1] / torch.where(zero, 1, den))


def causal_sums(fq, fk, v1, prefix):
    """[φ(q_i)·Σ_{j<=i} φ(k_j) v1_jᵀ] + φ(q_i)·prefix for one segment: [B,H,n,m'] x2,
    [B,H,n,c], prefix [B,H,m',c] -> [B,H,n,c]: the causal linear sums from a state, which is
    gated_linear_attention's chunked engine with no decay (gates of 0), scale 1 and the prefix as
    its initial state, forward and backward in C++."""
    no_decay = fq.new_zeros(fq.shape[:3])
    return _gated_linear_attention(fq, fk, v1, no_decay, scale=1.0, initial_state=prefix.contiguous())


def sums(g, segs, fq, fk, v, lengths, causal):
    """Per segment of this rank, [Σ_j fq_i·fk_j v_j | Σ_j fq_i·fk_j] [B,H,len,d_v+1] over the keys
    query i sees (every key; causal: j <= i), before the ratio; fq, fk: this rank's features."""
    mine = segs[g.rank]
    ones = v.new_ones(*v.shape[:3], 1)
    v1 = torch.cat([v, ones], -1)
    fk = [s.rows(fk) if mask is None else s.rows(fk) * mask for s, mask in ((s, key_mask(lengths, s)) for s in mine)]
    fq = [s.rows(fq) for s in mine]
    if not causal:
        states = [f.transpose(-1, -2) @ s.rows(v1) for f, s in zip(fk, mine)]  # [B,H,m',d_v+1] per segment
        total = g.all_reduce_sum(sum(states))
        return [f @ total for f in fq]
    return ordered_sums(g, segs, [fq], [fk], [[s.rows(v1) for s in mine]], [False])[0]


def ordered_sums(g, segs, fqs, fks, v1s, reverses):
    """For each stream t: per segment of this rank, the sums over every key at or before the
    query (reverses[t]: at or after it) of the whole sequence, [B,H,len,c]: the keys of the
    segments before (after) it through their states, the segment's own in chunks. fqs[t], fks[t],
    v1s[t]: per segment [B,H,len,m'], [B,H,len,m'], [B,H,len,c]. One all-gather for every stream."""
    mine = segs[g.rank]
    states = torch.stack([torch.stack([f.transpose(-1, -2) @ x for f, x in zip(fk, v1)])
                          for fk, v1 in zip(fks, v1s)])  # [streams, segments, B, H, m', c]
    every = g.all_gather(states)  # [P, streams, segments, B, H, m', c]
    starts = torch.tensor([[s.start for s in rank_segs] for rank_segs in segs], dtype=every.dtype)
    out = []
    for t, reverse in enumerate(reverses):
        sums = []
        for i, s in enumerate(mine):
            # The segments before (after) this one, as a 0/1 weight rather than a selection, so
            # that every rank's backward reaches the all-gather (whose adjoint is a collective)
            # even where no segment comes before.
            pick = (starts > s.start) if reverse else (starts < s.start)
            prefix = (every[:, t] * pick.to(every.dtype).view(*starts.shape, 1, 1, 1, 1)).sum((0, 1))
            fq, fk, v1 = fqs[t][i], fks[t][i], v1s[t][i]
            if reverse:  # the sums from the end: the causal form on the rows in reverse order
                flip = lambda x: x.flip(2)  # noqa: E731
                sums.append(flip(causal_sums(flip(fq), flip(fk), flip(v1), prefix)))
            else:
                sums.append(causal_sums(fq, fk, v1, prefix))
        out.append(sums)
    return out


def local_lengths(lengths, seg):
    """key_lengths [B] (of the whole sequence) as a segment's own: a list, or None."""
    if lengths is None:
        return None
    return (lengths - seg.start).clamp(0, seg.length).tolist()


def _all_reduce_state(g, st, favor):
    """The sum over ranks of a state [B,H,m',d_v+2]: FAVOR's shifts first (an all-reduce of
    maxima, no gradient), then [S | z] on the common shifts (an all-reduce of sums)."""
    if favor:
        with torch.no_grad():
            c = g.all_reduce_max(st[..., -1:].clone())
        st = _state.rescale_state(st, c)
    return torch.cat([g.all_reduce_sum(st[..., :-1]), st[..., -1:]], -1)


def total_state(g, states, favor):
    """The sum of this rank's segment states (a list of [B,H,m',d_v+2]) over its segments and
    over ranks; favor: the states have shifts to reconcile (FAVOR's, Efficient Attention's)."""
    mine = states[0] if len(states) == 1 else _state._sum_states(torch.stack(states))
    return _all_reduce_state(g, mine, favor)


def _feature_dim(head_dim, opts):
    """m', the feature count of a state: head_dim for the plain maps (and the given features'
    count for "given", their last dim); FAVOR's as the library's registry counts it."""
    if opts["feature_map"] != "favor":
        return head_dim
    return _linattn._feature_dim("favor", head_dim, {"projection": list(opts["projection"].shape)},
                                 {"kernel": opts["kernel"]})


class _EmptyState(torch.autograd.Function):
    """The state of no keys [B, H, m', d_v+2], a function of k and v in the autograd graph as
    the other segments' key states are, with no gradient to them: so every rank's backward
    reaches the all-gather of the states (whose adjoint is a collective) whenever the others'
    does, also when torch.autograd.grad or backward(inputs=...) asks only for some tensors."""

    @staticmethod
    def forward(ctx, k, v, shape, favor):
        return _state.empty_state(*shape, favor=favor, dtype=v.dtype)

    @staticmethod
    def backward(ctx, dstate):
        return None, None, None, None


def attention(g, segs, q, k, v, lengths, causal, opts):
    """This rank's out [B,H,n,d_v] (segs: every rank's segments; this rank's are segs[g.rank]);
    opts: linattn.torch.state's options (feature_map, projection, kernel, scale, eps,
    focus_power)."""
    mine = segs[g.rank]
    favor = opts["feature_map"] == "favor"
    if not causal:
        states = [_state.key_state(s.rows(k), s.rows(v), key_lengths=local_lengths(lengths, s), **opts)
                  for s in mine]  # [B, H, m', d_v+2] per segment
        return _state.apply_state(q, total_state(g, states, favor), **opts)
    # Causal: each segment's state, for the segments after it. The sequence's last segment has
    # none after it: the empty state stands in, without a pass over its keys (_EmptyState).
    n_total = max(s.stop for rank_segs in segs for s in rank_segs)
    states = []
    for s in mine:
        if s.stop == n_total:
            shape = (q.shape[0], q.shape[1], _feature_dim(q.shape[3], opts), v.shape[3])
            states.append(_EmptyState.apply(k, v, shape, favor))
        else:
            states.append(_state.key_state(s.rows(k), s.rows(v), key_lengths=local_lengths(lengths, s), **opts))
    states = torch.stack(states)  # [segments, B, H, m', d_v+2]
    # FAVOR's shifts travel with the states (they take no gradient: add_states detaches them);
    # the plain maps' are all 0.
    if favor:
        every = g.all_gather(states)  # [P, segments, B, H, m', d_v+2]
    else:
        every = g.all_gather(states[..., :-1])
        every = torch.cat([every, every.new_zeros(*every.shape[:-1], 1)], -1)
    every = every.flatten(0, 1)
    starts = torch.tensor([s.start for rank_segs in segs for s in rank_segs])
    outs = []
    for s in mine:
        # The segments before this one, as 0/1 weights rather than a selection, so that every
        # rank's backward reaches the all-gather (whose adjoint is a collective) even where no
        # segment comes before.
        prefix = _state._sum_states(every, starts < s.start)
        out, _ = _state.causal_from_state(s.rows(q), s.rows(k), s.rows(v), prefix,
                                          key_lengths=local_lengths(lengths, s), **opts)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def halos(g, segs, xs, left, right):
    """The rows of the whole sequence just before and after each of this rank's segments:
    xs [B,H,len,c] per segment (this rank's rows) -> [(before [B,H,left,c], after [B,H,right,c])]
    per segment, zeros outside the sequence. One all-gather of every segment's first and last
    max(left, right) rows: a row within that distance of a segment lies in those of the segment
    holding it. Every rank must call it (with the same left and right)."""
    mine = segs[g.rank]
    edge = max(left, right)
    if edge == 0:
        empty = xs[0].new_zeros(*xs[0].shape[:2], 0, xs[0].shape[-1])
        return [(empty, empty) for _ in mine]

    def edges(x):  # first and last `edge` rows, zero-padded on the inside when x is shorter
        short = edge - x.shape[2]
        front = F.pad(x[:, :, :edge], (0, 0, 0, max(short, 0)))
        back = F.pad(x[:, :, -edge:], (0, 0, max(short, 0), 0))
        return torch.cat([front, back], 2)
    rows = g.all_gather(torch.cat([edges(x) for x in xs], 2))  # [P, B, H, S·2·edge, c]
    per_rank = rows.shape[3]
    B, H, c = xs[0].shape[0], xs[0].shape[1], xs[0].shape[-1]
    flat = torch.cat([rows.permute(1, 2, 0, 3, 4).reshape(B, H, -1, c),
                      xs[0].new_zeros(B, H, 1, c)], 2)  # last row: zeros
    zero_row = flat.shape[2] - 1
    n_total = sum(s.length for r in segs for s in r)

    def index(p):  # row of flat holding global position p
        if p < 0 or p >= n_total:
            return zero_row
        for r, rank_segs in enumerate(segs):
            for j, s in enumerate(rank_segs):
                if s.start <= p < s.stop:
                    base = r * per_rank + j * 2 * edge
                    return base + (p - s.start if p - s.start < edge else edge + p - (s.stop - edge))
        raise AssertionError(p)

    out = []
    for s in mine:
        positions = list(range(s.start - left, s.start)) + list(range(s.stop, s.stop + right))
        h = flat.index_select(2, torch.tensor([index(p) for p in positions], dtype=torch.long))
        out.append((h[:, :, :left], h[:, :, left:]))
    return out


def depthwise_conv(g, segs, v, weight, lengths, causal):
    """out[i] = Σ_t w[h,t]·v[i+t−left] over the whole sequence (v is 0 outside it and at padded
    positions); left = K−1 (causal) or (K−1)/2. Returns this rank's rows [B,H,n,d_v]."""
    K = weight.shape[1]
    left = K - 1 if causal else (K - 1) // 2
    right = K - 1 - left
    mine = segs[g.rank]
    vm = [s.rows(v) if lengths is None else s.rows(v) * key_mask(lengths, s) for s in mine]
    outs = []
    for x, (before, after) in zip(vm, halos(g, segs, vm, left, right)):  # halo rows are masked as vm's
        windows = torch.cat([before, x, after], 2).unfold(2, K, 1)  # [B,H,len,d_v,K]
        outs.append(torch.einsum("bhldk,hk->bhld", windows, weight))
    return torch.cat(outs, 2)
