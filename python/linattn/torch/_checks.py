"""The argument checks and NumPy hand-over shared by the torch functions of the stateful
kernels (gated_linear_attention, gated_delta_rule, causal_conv1d): their formulas live in C++,
these layers pass tensors."""

import torch

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def array(t):
    """A NumPy view of a CPU float32/float64 tensor (a copy only when it is not contiguous)."""
    return None if t is None else t.detach().contiguous().numpy()


def check_tensors(fn, named, first, optional=(), state=()):
    """TypeError naming the argument unless every tensor of `named` (name -> value) is a CPU
    torch.Tensor of a float dtype, the dtype of named[first]; names in `optional` may be None,
    names in `state` may also be float32 when that dtype is 16-bit (a state is kept in float32)."""
    dtype = named[first].dtype if isinstance(named[first], torch.Tensor) else None
    for name, t in named.items():
        if t is None and name in optional:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: %s must be a torch.Tensor, got %s" % (fn, name, type(t).__name__))
        if t.device.type != "cpu":
            raise TypeError("%s: %s is on %s; linattn runs on the CPU only (move it with .cpu())" % (fn, name, t.device))
        if t.dtype not in FLOATS:
            raise TypeError("%s: %s must be float32, float64, bfloat16 or float16, got %s" % (fn, name, t.dtype))
        if t.dtype != dtype and not (name in state and t.dtype == torch.float32 and dtype in SIXTEEN_BIT):
            raise TypeError("%s: %s has dtype %s, %s has %s" % (fn, name, t.dtype, first, dtype))


def needs_graph(tensors):
    """Whether autograd must record the call: grad mode on and some input requiring a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def full_precision_inputs(fn, named, who):
    """The tensors (name, tensor or None) as contiguous CPU float32/float64 tensors of one dtype:
    TypeError naming fn and the argument otherwise; `who` says what takes only these (the
    feature maps, the state operations)."""
    from . import _same_dtype, _tensor  # linattn.torch's checks, defined before any call
    out = [None if t is None else _tensor(fn, n, t) for n, t in named]
    _same_dtype(fn, [(n, t) for (n, _), t in zip(named, out)])
    for (n, _), t in zip(named, out):
        if t is not None and t.dtype not in (torch.float32, torch.float64):
            raise TypeError("%s: %s has dtype %s; %s take torch.float32 or torch.float64" % (fn, n, t.dtype, who))
    return out


def constant(fn, name, t):
    """ValueError naming fn and the argument when t (a random projection) requires grad: it is a
    constant of the method, and no gradient flows to it."""
    if t is not None and t.requires_grad:
        raise ValueError("%s: %s has requires_grad=True, but it is a constant of the method (no gradient flows to "
                         "it); pass %s.detach()" % (fn, name, name))
