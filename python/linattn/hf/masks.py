"""Attention masks of transformers models -> linattn's key_lengths. linattn applies key padding
(and the causal pattern) only, so a mask is accepted when it keeps a prefix of the keys in every
row; anything else (left padding, packed sequences, sliding windows, additive biases such as
ALiBi) raises ValueError: attending to the wrong keys silently is worse."""

import torch as _torch


def key_lengths(name, mask, batch, n_q, n_k, causal):
    """The model's attention mask -> key_lengths [batch] (None: nothing masked). Accepted: boolean
    (True = attend) or additive float (0 = attend, -inf or the dtype's minimum = masked) masks of
    shape [batch or 1, heads or 1, n_q, >= n_k] that keep a prefix of the keys in every row,
    intersected with the causal pattern (bottom-right aligned) when causal."""
    if mask is None:
        return None
    if not isinstance(mask, _torch.Tensor) or mask.dim() != 4:
        raise ValueError("%s: expected a 4-D attention mask [batch, heads, n_q, n_k], got %r"
                         % (name, getattr(mask, "shape", type(mask))))
    mask = mask[..., :n_k]
    if mask.dtype == _torch.bool:
        keep = mask
    elif mask.dtype.is_floating_point:
        keep = mask == 0
        dropped = mask[~keep]
        if dropped.numel() and not bool((dropped <= _torch.finfo(mask.dtype).min / 2).all()):
            raise ValueError("%s: the attention mask adds a bias (values other than 0 and -inf); linattn applies "
                             "only key-padding (and causal) masks" % name)
    else:
        raise ValueError("%s: attention mask of dtype %s; expected bool or floating" % (name, mask.dtype))
    if mask.shape[2] not in (1, n_q) or mask.shape[0] not in (1, batch):
        raise ValueError("%s: attention mask of shape %s for %d queries and batch %d"
                         % (name, tuple(mask.shape), n_q, batch))
    keep = keep.expand(batch, keep.shape[1], n_q, n_k)
    lengths = keep[:, 0, -1, :].sum(dim=-1)  # the last query sees every valid key, causal or not
    positions = _torch.arange(n_k, device=keep.device)
    want = (positions[None, :] < lengths[:, None])[:, None, None, :]
    if causal:
        rows = _torch.arange(n_q, device=keep.device)[:, None] + (n_k - n_q)
        want = want & (positions[None, :] <= rows)[None, None]
    if not _torch.equal(keep, want.expand_as(keep)):
        raise ValueError("%s: the attention mask is not %s key-padding mask with the padding at the end of each "
                         "sequence (left padding, packed sequences, sliding windows and custom masks cannot be "
                         "expressed as key_lengths); pad on the right" % (name, "a causal" if causal else "a"))
    if bool((lengths == n_k).all()):
        return None
    return lengths.to(_torch.int64)
