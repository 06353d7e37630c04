"""linattn.hf.register(): what makes transformers run linattn. Its own module, not backends.py:
it installs the cache's generation hook, and the cache module imports backends (so backends
never imports the cache). transformers is imported when register() runs, not before: linattn.hf
itself does not need it."""

from . import backends as _backends

__all__ = ["register", "registered"]


_registered = False


def registered():
    """Whether register() has run in this process."""
    return _registered


def register():
    """Registers every backend of BACKENDS with transformers' AttentionInterface and, for the
    masks, AttentionMaskInterface (backends.mask); makes generate() use LinattnCache on the
    cached backends (cache.install_generation_hook) and a linattn model's config save atomic
    (backends.install_atomic_config_save); and runs the linear layers of transformers'
    gated-delta-rule and KDA models (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi Linear, ...) on
    linattn's kernels (linattn.hf.delta.install). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from .cache import install_generation_hook
    from .delta import install as install_delta_rule
    for name in _backends.BACKENDS:
        AttentionInterface.register(name, _backends.attention_function(name))
        AttentionMaskInterface.register(name, _backends.mask)
    install_generation_hook()
    _backends.install_atomic_config_save()
    install_delta_rule()
    global _registered
    _registered = True
