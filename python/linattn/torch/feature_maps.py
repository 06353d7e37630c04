"""Learned feature maps for linear attention, as small torch modules. Each maps q or k
[batch, heads, seq, head_dim] to non-negative features [batch, heads, seq, m'], which
linattn's kernel takes as they are (linear_attention(..., feature_map="identity")); torch
differentiates the map, the kernel gives the gradients of its features.

    fq, fk = HedgehogFeatureMap(heads, head_dim, 32), HedgehogFeatureMap(heads, head_dim, 32)
    out = linear_attention(fq(q), fk(k), v, feature_map="identity", causal=True)

hedgehog_attention() does exactly that, with the maps' parameters as arguments."""

import torch

__all__ = ["HedgehogFeatureMap", "hedgehog_features"]


def _check_parameters(fn, x, weight, bias):
    """ValueError/TypeError naming fn and the argument when weight [H, d, f] or bias [H, f]
    does not fit x [B, H, n, d]."""
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: %s must be a torch.Tensor, got %s" % (fn, name, type(t).__name__))
        if t.dtype != x.dtype:
            raise TypeError("%s: %s has dtype %s, but the input has %s" % (fn, name, t.dtype, x.dtype))
    if x.dim() != 4:
        raise ValueError("%s: the input must be [batch, heads, seq, head_dim], got shape %s" % (fn, list(x.shape)))
    H, d = x.shape[1], x.shape[3]
    if weight.dim() != 3 or weight.shape[0] != H or weight.shape[1] != d or weight.shape[2] < 1:
        raise ValueError("%s: weight has shape %s; expected [heads = %d, head_dim = %d, feature_dim >= 1]"
                         % (fn, list(weight.shape), H, d))
    if bias.dim() != 2 or bias.shape[0] != H or bias.shape[1] != weight.shape[2]:
        raise ValueError("%s: bias has shape %s; expected [heads = %d, feature_dim = %d]"
                         % (fn, list(bias.shape), H, weight.shape[2]))


def hedgehog_features(x, weight, bias):
    """φ(x) = [softmax(x·W_h + b_h), softmax(−(x·W_h + b_h))] over the feature axis, per head h
    (Hedgehog, Zhang et al., ICLR 2024): x [B, H, n, d], weight [H, d, f], bias [H, f] ->
    [B, H, n, 2f]. Each half sums to 1, so φ(q)·φ(k) lies in (0, 2] whatever the inputs' size:
    the kernel's sums cannot overflow. softmax shifts by the row maximum, so any finite logit
    is safe."""
    _check_parameters("hedgehog_features", x, weight, bias)
    u = torch.einsum("bhnd,hdf->bhnf", x, weight) + bias[None, :, None, :]
    return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)


class HedgehogFeatureMap(torch.nn.Module):
    """Hedgehog's learned feature map of one side (queries or keys) of every head:
    φ(x) = [softmax(x·W_h + b_h), softmax(−(x·W_h + b_h))], W [heads, head_dim, feature_dim],
    b [heads, feature_dim]; m' = 2·feature_dim features.

    init: "identity" (default) sets W_h to the first feature_dim columns of the identity (the
    rest zero when feature_dim > head_dim) and b to 0, LoLCATs' choice for attention transfer:
    before training, φ follows the coordinates of x, a start the fit moves from; "random":
    W with Kaiming-uniform rows, as Hedgehog's paper. scale multiplies x first (the model's
    1/√d or 1, say); it is a constant, not a parameter."""

    def __init__(self, num_heads, head_dim, feature_dim, *, init="identity", scale=1.0, device=None, dtype=None):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("feature_dim", feature_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError("HedgehogFeatureMap: %s must be an integer >= 1, got %r" % (name, value))
        if init not in ("identity", "random"):
            raise ValueError("HedgehogFeatureMap: init must be 'identity' or 'random', got %r" % (init,))
        if not (isinstance(scale, (int, float)) and 0 < float(scale) < float("inf")):
            raise ValueError("HedgehogFeatureMap: scale must be a finite number > 0, got %r" % (scale,))
        factory = {"device": device, "dtype": dtype}
        self.num_heads, self.head_dim, self.feature_dim = num_heads, head_dim, feature_dim
        self.scale = float(scale)
        self.weight = torch.nn.Parameter(torch.empty(num_heads, head_dim, feature_dim, **factory))
        self.bias = torch.nn.Parameter(torch.zeros(num_heads, feature_dim, **factory))
        with torch.no_grad():
            if init == "identity":
                self.weight.copy_(torch.eye(head_dim, feature_dim, **factory).expand(num_heads, -1, -1))
            else:
                for h in range(num_heads):
                    torch.nn.init.kaiming_uniform_(self.weight[h])

    @property
    def dim(self):
        """m', the number of features: 2·feature_dim."""
        return 2 * self.feature_dim

    def forward(self, x):
        """x [batch, heads, seq, head_dim] -> φ(x) [batch, heads, seq, 2·feature_dim]."""
        return hedgehog_features(x * self.scale if self.scale != 1.0 else x, self.weight, self.bias)

    def extra_repr(self):
        return "num_heads=%d, head_dim=%d, feature_dim=%d, scale=%g" % (self.num_heads, self.head_dim,
                                                                        self.feature_dim, self.scale)
