"""Options as users pass them (Python or NumPy numbers, strings) -> plain Python values, checked
in one place: linattn.hf's backends, linearize, its training loops and MultiheadAttention's
counts, sizes, seeds and Hedgehog options call these, so a NumPy scalar is accepted and stored
as int/float (JSON-safe), a float or bool where an integer belongs is refused (never
truncated), and a bad value raises ValueError naming the caller and the argument before
anything is written."""

import functools
import math
import numbers
import warnings

from . import _linattn

# The largest integer a C++ int64_t option (and a torch custom op's `int`) holds.
INT64_MAX = 2 ** 63 - 1


def integer(fn, name, value, minimum=None, maximum=INT64_MAX):
    """value as a Python int in [minimum, maximum]; bool and non-integral numbers refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError("%s: %s must be an integer%s, got %r" % (fn, name, _range(minimum, maximum), value))
    value = int(value)
    if (minimum is not None and value < minimum) or value > maximum:
        raise ValueError("%s: %s must be an integer%s, got %r" % (fn, name, _range(minimum, maximum), value))
    return value


def real(fn, name, value, minimum=None, maximum=None, above=None):
    """value as a finite Python float, >= minimum, <= maximum and > above where given."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if ok:
        value = float(value)
        ok = (math.isfinite(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
              and (above is None or value > above))
    if not ok:
        bounds = [b for b in ("> %r" % above if above is not None else None,
                              ">= %r" % minimum if minimum is not None else None,
                              "<= %r" % maximum if maximum is not None else None) if b]
        raise ValueError("%s: %s must be a finite number%s, got %r"
                         % (fn, name, (" " + " and ".join(bounds)) if bounds else "", value))
    return value


def choice(fn, name, value, choices):
    """value, one of choices (strings)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError("%s: %s must be one of %s, got %r" % (fn, name, ", ".join(map(repr, choices)), value))
    return str(value)


def _range(minimum, maximum):
    if minimum is None:
        return " <= %d" % maximum if maximum != INT64_MAX else ""
    return " >= %d" % minimum if maximum == INT64_MAX else " in [%d, %d]" % (minimum, maximum)


# Options of MultiheadAttention and linattn.hf renamed so that each thing has one name in every
# layer (issue 43): {former name: name now}, accepted until the next release with a
# DeprecationWarning. The functions' own (linear_attention's dwc_weight, now conv_weight) are in
# the registry (OptionInfo::formerly).
RENAMED = {"dwc_kernel_size": "conv_kernel_size"}


_WARNED = set()


@functools.lru_cache(maxsize=None)
def _former_feature_maps():
    """linear_attention's feature_map values' former names, {old: now}, from the registry."""
    linear = next(m for m in _linattn._methods() if m["function"] == "linear_attention")
    return former_spellings(linear["options"])[1]["feature_map"]


def current_feature_map(fn, feature_map, stacklevel=4):
    """feature_map by its name now, for the functions the registry does not make (features, the
    state operations): a former name (linear_attention's "identity", now "given": the registry's
    former_choices) with a DeprecationWarning at the caller of fn's caller (stacklevel 4)."""
    return renamed(fn, {"feature_map": feature_map}, {}, stacklevel=stacklevel,
                   former_values={"feature_map": _former_feature_maps()})["feature_map"]


def former_spellings(options):
    """A registry method's options' former spellings: ({former name: name}, {name: {former value:
    value}}) (OptionInfo::formerly and former_choices: dwc_weight, feature_map="identity")."""
    return ({o["formerly"]: o["name"] for o in options if o["formerly"]},
            {o["name"]: dict(o["former_choices"]) for o in options if o["former_choices"]})


def renamed(fn, kwargs, former, stacklevel=3, once=False, former_values=None):
    """kwargs (a dict, changed in place and returned) with each option given by its former name
    (former: {old: new}) moved to its name now, and each value given by its former name
    (former_values: {option: {old value: value}}) changed to its name now, each with a
    DeprecationWarning attributed to the frame `stacklevel` up from here (3: the caller of fn;
    Python shows it by default when that is __main__); once: only the first time for this fn
    and name (options read at every forward). An option given by both names is a TypeError."""
    for old, new in former.items():
        if old not in kwargs:
            continue
        if new in kwargs:
            raise TypeError("%s: got %s and %s, its former name; pass %s only" % (fn, new, old, new))
        if not once or (fn, old) not in _WARNED:
            _WARNED.add((fn, old))
            warnings.warn("%s: %s is now called %s; the old name is accepted until the next release"
                          % (fn, old, new), DeprecationWarning, stacklevel=stacklevel)
        kwargs[new] = kwargs.pop(old)
    for name, values in (former_values or {}).items():
        old = kwargs.get(name)
        if not isinstance(old, str) or old not in values:
            continue
        if not once or (fn, name, old) not in _WARNED:
            _WARNED.add((fn, name, old))
            warnings.warn("%s: %s=%r is now called %r; the old name is accepted until the next release"
                          % (fn, name, old, values[old]), DeprecationWarning, stacklevel=stacklevel)
        kwargs[name] = values[old]
    return kwargs
