"""Generation timing of a causal LM with a cache, shared by bench/causal_lm.py and
bench/smollm2.py: prefill a context, then greedy steps one token at a time, as generate() does."""

import statistics
import time

import torch

import linattn.hf as lh


def cache_bytes(cache):
    """Bytes a cache holds: LinattnCache's states, or a DynamicCache's keys and values."""
    if isinstance(cache, lh.LinattnCache):
        return cache.nbytes
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


@torch.no_grad()
def generation(model, make_cache, context, new_tokens, ids):
    """Prefill `context` tokens of ids (a 1-D tensor, cycled), then decode new_tokens greedily
    one at a time: (median seconds per token, cache bytes after the context, seconds of the
    prefill). Only the last position's logits are made (logits_to_keep=1), as generate() asks:
    the vocabulary's product at every prompt position would be most of a long prefill."""
    x = ids.repeat(context // len(ids) + 1)[:context][None]
    cache = make_cache(model)
    t0 = time.perf_counter()
    logits = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    prefill = time.perf_counter() - t0
    size = cache_bytes(cache)
    times = []
    for _ in range(new_tokens):
        nxt = logits.argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        logits = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] if len(times) > 4 else times), size, prefill
