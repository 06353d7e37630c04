"""The collectives of the distributed layer: torch.distributed calls wrapped so autograd sees
their adjoints, the payload counter, and the agreement check every call starts with.

Every rank must make the same collectives in the same order, forward and backward, or the job
hangs. So a call never raises on one rank alone: local checks travel in the first collective
(`agree`), and every rank raises when any rank's check failed."""

import time

import torch
import torch.distributed as dist

# Payload bytes this process handed to collectives and sends, and how many calls; see traffic().
_TRAFFIC = {"bytes": 0, "messages": 0}


def traffic():
    """{"bytes", "messages"}: payload this process has handed to collectives and point-to-point
    sends since the last reset_traffic() (an all-reduce of X bytes counts X; the wire cost of a
    ring all-reduce is 2(P−1)/P·X)."""
    return dict(_TRAFFIC)


def reset_traffic():
    _TRAFFIC["bytes"] = _TRAFFIC["messages"] = 0


def _count(t):
    _TRAFFIC["bytes"] += t.numel() * t.element_size()
    _TRAFFIC["messages"] += 1


# How long a collective's tensors may stay in gloo's hands after it completed (see _handed_back)
# before that is an error, and how often to look meanwhile.
_HAND_BACK_LIMIT_S = 60.0
_HAND_BACK_POLL_S = 20e-6
_use_count = getattr(torch.Tensor, "_use_count", None)


def _collective(tensors, run):
    """run() (a blocking collective on tensors), then _handed_back(tensors)."""
    counts = [t._use_count() for t in tensors] if _use_count else None
    result = run()
    _handed_back(tensors, counts)
    return result


def _handed_back(tensors, counts):
    """Waits, with the GIL released, until gloo's worker threads have dropped their references
    to tensors (each back to its count before the collective).

    Why: a gloo worker destroys a finished Work on its own thread, and with it the last C++
    reference it held to each tensor; for a tensor that has a Python object, PyTorch then takes
    the GIL on that thread. If the interpreter has begun to exit by then, Python 3.11 ends the
    thread with pthread_exit, whose unwind crosses Work's noexcept destructor: std::terminate,
    and the process aborts after its work is done (docs/distributed.md, "Exiting cleanly").
    Waiting here means no linattn collective leaves such a drop pending when it returns."""
    if counts is None:  # a PyTorch without Tensor._use_count: nothing to wait on
        return
    deadline = None
    while any(t._use_count() > c for t, c in zip(tensors, counts)):
        now = time.monotonic()
        if deadline is None:
            deadline = now + _HAND_BACK_LIMIT_S
        elif now > deadline:
            raise RuntimeError("linattn.torch.distributed: torch.distributed still holds a collective's tensors "
                               "%.0f s after it completed" % _HAND_BACK_LIMIT_S)
        time.sleep(_HAND_BACK_POLL_S)  # releases the GIL, which the worker needs for the drop


class Group:
    """A process group with its rank and size (group None: the default group)."""

    def __init__(self, fn, group):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("%s: torch.distributed is not initialised; call torch.distributed.init_process_group "
                             "first (for one process, use linattn.torch.%s)" % (fn, fn.rsplit(".", 1)[-1]))
        self.fn = fn
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # send/recv address ranks of the default group
        self.global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)]

    def agree(self, local_size, fields, problem):
        """The sequence length of every rank, after checking that every rank passed the same
        fields (shapes, options, checksums of shared tensors) and that no rank's local check
        failed (problem: the exception that rank's check raised, or None). Every rank raises:
        that rank its own exception, the others ValueError."""
        row = torch.tensor([float(local_size), 0.0 if problem is None else 1.0] + [float(x) for x in fields],
                           dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in range(self.size)]
        _count(row)
        _collective([row, *rows], lambda: dist.all_gather(rows, row, group=self.group))
        table = torch.stack(rows)
        if problem is not None:
            raise problem
        bad = [r for r in range(self.size) if table[r, 1] != 0]
        if bad:
            raise ValueError("%s: rank %d's inputs were rejected (its error says why)" % (self.fn, bad[0]))
        ref = table[0, 2:]
        for r in range(1, self.size):
            same = (table[r, 2:] == ref) | (table[r, 2:].isnan() & ref.isnan())
            if not bool(same.all()):
                raise ValueError("%s: rank %d was called with other shapes or options than rank 0 (batch, heads, "
                                 "head dims, dtype, options, key_lengths and shared tensors must match on every "
                                 "rank; only the sequence block differs)" % (self.fn, r))
        return [int(x) for x in table[:, 0].tolist()]

    def all_reduce_max(self, x):
        """The elementwise maximum over ranks (no gradient: used for shifts that cancel)."""
        y = x.detach().clone()
        _count(y)
        _collective([y], lambda: dist.all_reduce(y, op=dist.ReduceOp.MAX, group=self.group))
        return y

    def all_reduce_sum(self, x):
        """Σ over ranks, differentiable: y is every rank's, so dx = Σ over ranks of dy."""
        return _AllReduceSum.apply(x, self)

    def all_gather(self, x):
        """[P, *x.shape]: every rank's x, differentiable (dx = Σ over ranks of d(result)[rank])."""
        return _AllGather.apply(x, self)

    def exchange(self, tensors, dst, src, shapes):
        """Sends tensors to rank dst and receives tensors of the given shapes from rank src,
        non-blocking; returns (received, wait)."""
        received = [torch.empty(s, dtype=t.dtype) for s, t in zip(shapes, tensors)]
        sent = [t.contiguous() for t in tensors]
        for t in sent:
            _count(t)
        counts = [t._use_count() for t in sent] if _use_count else None
        ops = [dist.P2POp(dist.isend, t, self.global_ranks[dst], self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.global_ranks[src], self.group) for r in received]
        works = dist.batch_isend_irecv(ops)
        del ops

        def wait():
            for w in works:
                w.wait()
            works.clear()  # a Work holds its tensors
            # Only the sent tensors: gloo keeps the latest receive buffer of a pair until the
            # next receive on it (PyTorch 2.15: its use count stays 2 until then), and lets it
            # go with the process group, in destroy_process_group().
            _handed_back(sent, counts)
            return received
        return wait


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        y = x.contiguous().clone()
        _count(y)
        _collective([y], lambda: dist.all_reduce(y, group=g.group))
        return y

    @staticmethod
    def backward(ctx, dy):
        # y = Σ_r x_r is used by every rank's loss, so ∂L/∂x_r = Σ_r' ∂L_r'/∂y.
        dx = dy.contiguous().clone()
        _count(dx)
        _collective([dx], lambda: dist.all_reduce(dx, group=ctx.g.group))
        return dx, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(g.size)]
        _count(x)
        _collective([x, *parts], lambda: dist.all_gather(parts, x, group=g.group))
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, dy):
        # result[r] = x_r on every rank: ∂L/∂x_r = Σ_r' ∂L_r'/∂result[r] (a reduce-scatter; gloo
        # has none, so an all-reduce of the whole gradient and this rank's slot).
        d = dy.contiguous().clone()
        _count(d)
        _collective([d], lambda: dist.all_reduce(d, group=ctx.g.group))
        return d[ctx.g.rank], None
