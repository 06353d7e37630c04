"""linattn: attention whose cost grows linearly with sequence length, and exact softmax
attention, on NumPy arrays shaped [batch, heads, seq, head_dim] (float32 or float64)."""

from ._linattn import (
    RecurrentState,
    chi_quantile_radii,
    favor_attention,
    favor_attention_backward,
    get_num_threads,
    linear_attention,
    linear_attention_backward,
    random_features,
    recurrent_state,
    reset_workspace_peak,
    set_num_threads,
    softmax_attention,
    softmax_attention_backward,
    workspace_stats,
)

__all__ = [
    "RecurrentState",
    "chi_quantile_radii",
    "favor_attention",
    "favor_attention_backward",
    "get_num_threads",
    "linear_attention",
    "linear_attention_backward",
    "random_features",
    "recurrent_state",
    "reset_workspace_peak",
    "set_num_threads",
    "softmax_attention",
    "softmax_attention_backward",
    "workspace_stats",
]
__version__ = "0.1.0"
