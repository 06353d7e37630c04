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
    mask = mask[..., :n_k] if isinstance(mask, _torch.Tensor) else mask
    keep = keep_of(name, mask)
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
                         "expressed as key_lengths); pad on the right (generate() with LinattnCache also serves left "
                         "padding)" % (name, "a causal" if causal else "a"))
    if bool((lengths == n_k).all()):
        return None
    return lengths.to(_torch.int64)


def keep_of(name, mask):
    """A 4-D attention mask as booleans, True = attend: boolean masks as they are, additive
    float masks kept where 0 (ValueError for a bias other than 0 and the dtype's minimum / -inf)."""
    if not isinstance(mask, _torch.Tensor) or mask.dim() != 4:
        raise ValueError("%s: expected a 4-D attention mask [batch, heads, n_q, n_k], got %r"
                         % (name, getattr(mask, "shape", type(mask))))
    if mask.dtype == _torch.bool:
        return mask
    if mask.dtype.is_floating_point:
        keep = mask == 0
        dropped = mask[~keep]
        if dropped.numel() and not bool((dropped <= _torch.finfo(mask.dtype).min / 2).all()):
            raise ValueError("%s: the attention mask adds a bias (values other than 0 and -inf); linattn applies "
                             "only key-padding (and causal) masks" % name)
        return keep
    raise ValueError("%s: attention mask of dtype %s; expected bool or floating" % (name, mask.dtype))


def used_keys(name, mask, n_k):
    """The number of key slots before the first one that every query of every row masks and
    after which all are masked: a static cache's empty slots at the end (n_k when none, or no
    mask). Those slots hold no token, and dropping them lets causal masks align bottom-right."""
    if not isinstance(mask, _torch.Tensor) or mask.dim() != 4 or not (mask.dtype == _torch.bool or
                                                                      mask.dtype.is_floating_point):
        return n_k  # key_lengths raises for it
    keep = keep_of(name, mask[..., :n_k])
    kept = keep.flatten(0, 2).any(dim=0)  # [n_k]: a key some query attends
    if bool(kept[-1]) if kept.numel() else True:
        return n_k
    where = kept.nonzero()
    return int(where[-1]) + 1 if where.numel() else n_k


def fits(name, mask, batch, n_q, n_k, causal):
    """Whether key_lengths can express the mask as it is (bottom-right aligned when causal)."""
    try:
        key_lengths(name, mask, batch, n_q, n_k, causal)
    except ValueError:
        return False
    return True
