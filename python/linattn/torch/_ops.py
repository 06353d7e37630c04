"""Each registered method as two PyTorch custom operators, made from the library's registry:

    linattn::<function>(q, k, v, <tensors>, key_lengths, <options>) -> (out, *saved)
    linattn::<function>_backward(q, k, v, <tensors>, key_lengths, dout, out, *saved, <options>)
        -> (dq, dk, dv, *parameter gradients)

with a fake implementation (shapes only, for torch.compile and meta tensors) and an autograd
formula that hands the forward's saved tensors (softmax: lse; kernelized: den, state) to the
backward, as exact attention keeps its log-sum-exp. Every argument is positional in the
schemas (register_autograd takes no keyword-only tensors); key_lengths is an int64 tensor [B]
or None, so varying lengths do not recompile a compiled model. A parameter gradient that has no
parameter (conv_weight not given) comes back as an empty tensor, turned into None here."""

import ml_dtypes
import numpy as np
import torch

from .. import _linattn

_LIB = torch.library.Library("linattn", "DEF")  # noqa: TOR901 (the namespace is ours)
_SCALARS = {"bool": "bool", "int": "int", "float": "float", "str": "str"}


def _array(t):
    """A NumPy view of a CPU tensor (a copy only when it is not contiguous); bfloat16 as
    ml_dtypes.bfloat16, which torch's .numpy() does not know."""
    if t is None:
        return None
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _tensor(a):
    """The tensor viewing a NumPy array the library returned (bfloat16 included)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def accumulator_dtype(dtype):
    """What dtype's values accumulate in, and what a forward saves: float32 for bfloat16/float16
    (as the C++ library's accumulator_t), dtype itself otherwise. MultiheadAttention's decoding
    and linattn.hf's cache use it too."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class MethodOps:
    """The two operators of one registered method and what the functional API needs of them."""

    def __init__(self, info):
        self.info = info
        self.name = info["name"]
        opts = info["options"]
        self.tensor_options = [o for o in opts if o["kind"] == "tensor"]
        self.scalar_options = [o for o in opts if o["kind"] in _SCALARS]
        self.has_lengths = any(o["kind"] == "lengths" for o in opts)
        self.gradient_options = [o["name"] for o in self.tensor_options if o["has_gradient"]]
        self.saved = list(info["saved"])
        tensors = ["Tensor q", "Tensor k", "Tensor v"]
        tensors += ["Tensor%s %s" % ("" if o["positional"] else "?", o["name"]) for o in self.tensor_options]
        if self.has_lengths:
            tensors.append("Tensor? key_lengths")
        scalars = ["%s%s %s" % (_SCALARS[o["kind"]], "?" if o["optional"] else "", o["name"])
                   for o in self.scalar_options]
        outputs = ["Tensor out"] + ["Tensor %s" % s for s in self.saved]
        grads = ["Tensor dq", "Tensor dk", "Tensor dv"] + ["Tensor d_%s" % g for g in self.gradient_options]
        saved_in = ["Tensor? out"] + ["Tensor? %s" % s for s in self.saved]
        fn = info["function"]
        _LIB.define("%s(%s) -> (%s)" % (fn, ", ".join(tensors + scalars), ", ".join(outputs)))
        _LIB.define("%s_backward(%s) -> (%s)" % (fn, ", ".join(tensors + ["Tensor dout"] + saved_in + scalars),
                                                 ", ".join(grads)))
        self.forward_op = getattr(torch.ops.linattn, fn).default
        self.backward_op = getattr(torch.ops.linattn, fn + "_backward").default
        self.n_tensors = 3 + len(self.tensor_options) + (1 if self.has_lengths else 0)
        torch.library.impl(_LIB, fn, "CPU")(self._forward_cpu)
        torch.library.impl(_LIB, fn + "_backward", "CPU")(self._backward_cpu)
        torch.library.register_fake("linattn::" + fn, self._forward_fake, lib=_LIB)
        torch.library.register_fake("linattn::" + fn + "_backward", self._backward_fake, lib=_LIB)
        torch.library.register_autograd("linattn::" + fn, self._backward_formula,
                                        setup_context=self._setup_context, lib=_LIB)

    # ---- argument lists ----------------------------------------------------------------------

    def _split(self, args):
        """(q, k, v), {tensor option: tensor or None}, key_lengths, rest of args."""
        q, k, v = args[:3]
        named = dict(zip([o["name"] for o in self.tensor_options], args[3:3 + len(self.tensor_options)]))
        lengths = args[self.n_tensors - 1] if self.has_lengths else None
        return (q, k, v), named, lengths, args[self.n_tensors:]

    def _options(self, scalars, lengths):
        options = {o["name"]: x for o, x in zip(self.scalar_options, scalars)}
        if self.has_lengths:
            options["key_lengths"] = None if lengths is None else lengths.tolist()
        return options

    # ---- CPU ---------------------------------------------------------------------------------

    def _forward_cpu(self, *args):
        (q, k, v), named, lengths, scalars = self._split(args)
        r = _linattn._forward(self.name, _array(q), _array(k), _array(v),
                              {n: _array(t) for n, t in named.items()}, self._options(scalars, lengths), self.saved)
        return tuple(_tensor(x) for x in r) if self.saved else _tensor(r)

    def _backward_cpu(self, *args):
        (q, k, v), named, lengths, rest = self._split(args)
        dout, saved, scalars = rest[0], rest[1:2 + len(self.saved)], rest[2 + len(self.saved):]
        saved = {n: _array(t) for n, t in zip(["out"] + self.saved, saved)} if self.saved else {}
        g = _linattn._backward(self.name, _array(q), _array(k), _array(v), _array(dout),
                               {n: _array(t) for n, t in named.items()}, self._options(scalars, lengths), saved)
        grads = [_tensor(x) for x in g[:3]]
        given = iter(g[3:])
        for name in self.gradient_options:
            grads.append(_tensor(next(given)) if named[name] is not None else q.new_empty(0))
        return tuple(grads)

    # ---- fake (shapes only) -----------------------------------------------------------------

    def _forward_fake(self, *args):
        (q, k, v), named, _, scalars = self._split(args)
        batch, heads, n_q, head_dim = q.shape
        value_dim = v.shape[3]
        out = [q.new_empty((batch, heads, n_q, value_dim))]
        for dims in self.info["saved_dims"]:
            sizes = {"batch": batch, "heads": heads, "n_q": n_q, "value_dim+2": value_dim + 2}
            if "features" in dims:
                shapes = {n: [int(s) for s in t.shape] for n, t in named.items() if t is not None}
                sizes["features"] = _linattn._feature_dim(self.name, int(head_dim), shapes,
                                                          self._options(scalars, None))
            out.append(q.new_empty([sizes[d] for d in dims], dtype=accumulator_dtype(q.dtype)))
        return tuple(out) if self.saved else out[0]

    def _backward_fake(self, *args):
        (q, k, v), named, _, _ = self._split(args)
        grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
        for name in self.gradient_options:
            t = named[name]
            grads.append(torch.empty_like(t) if t is not None else q.new_empty(0))
        return tuple(grads)

    # ---- autograd ----------------------------------------------------------------------------

    def _setup_context(self, ctx, inputs, output):
        ctx.inputs_len = len(inputs)
        # The saved outputs (lse, den, state) get no gradient: without this, autograd fills a
        # zero tensor for each before every backward, a torch parallel op whose OpenMP workers
        # then spin on the cores the backward needs (measured: +12% on a 2-core machine).
        ctx.set_materialize_grads(False)
        ctx.scalars = inputs[self.n_tensors:]
        outputs = output if self.saved else (output,)
        ctx.save_for_backward(*inputs[:self.n_tensors], *outputs)
        ctx.mark_non_differentiable(*outputs[1:])

    def _backward_formula(self, ctx, dout, *unused_saved_grads):
        saved = ctx.saved_tensors
        tensors, outputs = saved[:self.n_tensors], saved[self.n_tensors:]
        none = [None] * ctx.inputs_len
        if dout is None:
            return tuple(none)
        g = self.backward_op(*tensors, dout.contiguous(), *outputs, *ctx.scalars)
        grads = list(g[:3]) + [None] * (ctx.inputs_len - 3)
        for i, o in enumerate(self.tensor_options):
            if o["has_gradient"] and tensors[3 + i] is not None:
                grads[3 + i] = g[3 + self.gradient_options.index(o["name"])]
        return tuple(grads)


OPS = {info["name"]: MethodOps(info) for info in _linattn._methods()}
