"""Which positions of the sequence each rank holds.

layout "contiguous": rank r holds one block, positions [Σ_{r'<r} n_r', Σ_{r'<=r} n_r'), of any
sizes (every block >= 1 position). layout "zigzag": the sequence is cut into 2P chunks (the
first n mod 2P one position longer) and rank r holds chunks r and 2P−1−r, in that order, so
that under a causal mask every rank has the same work (Brandon et al., "Striped Attention",
and the zig-zag of ring-flash-attn)."""

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    start: int  # first global position
    length: int
    offset: int  # first row in the rank's local tensor

    @property
    def stop(self):
        return self.start + self.length

    def rows(self, x):
        """This segment's rows of a rank's local [B, H, n_local, ...] tensor."""
        return x[:, :, self.offset:self.offset + self.length]


def chunk_sizes(n, parts):
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def segments(layout, sizes, rank):
    """The segments rank holds, given every rank's local length (sizes)."""
    P = len(sizes)
    if layout == "contiguous":
        return [Segment(sum(sizes[:rank]), sizes[rank], 0)]
    chunks = chunk_sizes(sum(sizes), 2 * P)
    starts = [sum(chunks[:i]) for i in range(2 * P)]
    a, b = rank, 2 * P - 1 - rank
    return [Segment(starts[a], chunks[a], 0), Segment(starts[b], chunks[b], chunks[a])]


def check_sizes(fn, layout, sizes):
    """An error message when the ranks' lengths do not fit the layout, else None."""
    if min(sizes) < 1:
        return "%s: every rank needs at least one position; rank %d has 0" % (fn, sizes.index(min(sizes)))
    if layout == "zigzag":
        P = len(sizes)
        chunks = chunk_sizes(sum(sizes), 2 * P)
        want = [chunks[r] + chunks[2 * P - 1 - r] for r in range(P)]
        if sizes != want:
            return ("%s: layout='zigzag' needs rank r to hold chunks r and 2P-1-r of the sequence cut into 2P "
                    "near-equal chunks (use linattn.torch.distributed.shard): for n = %d on %d ranks the blocks are "
                    "%s, got %s" % (fn, sum(sizes), P, want, sizes))
    return None


def shard_of(x, rank, size, layout, dim=2):
    """Rank's part of the whole-sequence tensor x along dim, in the layout."""
    if layout == "contiguous":
        return x.tensor_split(size, dim=dim)[rank].contiguous()
    chunks = x.tensor_split(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def unshard(parts, layout, dim=2):
    """The whole-sequence tensor from every rank's part (parts[r] from rank r)."""
    if layout == "contiguous":
        return torch.cat(parts, dim=dim)
    P = len(parts)
    n = sum(p.shape[dim] for p in parts)
    chunks = chunk_sizes(n, 2 * P)
    first = [p.narrow(dim, 0, chunks[r]) for r, p in enumerate(parts)]
    second = [p.narrow(dim, chunks[r], p.shape[dim] - chunks[r]) for r, p in enumerate(parts)]
    return torch.cat(first + second[::-1], dim=dim)
