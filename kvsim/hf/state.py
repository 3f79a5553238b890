"""The constant per-sequence state of linear-attention and mamba layers.
"""

from __future__ import annotations

from kvsim.hf.fields import Config
from kvsim.models import LayerKind, LayerSpec

def state_layer(cfg: Config, hidden_size: int) -> LayerSpec:
    """The constant per-sequence state of a linear layer: gated delta net (Qwen3-Next) or mamba (Jamba).

    Gated delta net (vLLM gated_delta_net_state_shape): conv state (conv_kernel - 1) x conv_dim with
    conv_dim = key_dim*num_key_heads*2 + value_dim*num_value_heads, plus recurrent num_value_heads x
    value_dim x key_dim. Mamba-2: conv (d_conv - 1) x (intermediate + 2 x n_groups x d_state), ssm
    n_heads x d_head x d_state. Mamba-1: conv state intermediate x (d_conv - 1), ssm state intermediate x d_state,
    intermediate = mamba_expand x hidden_size.
    """
    if cfg.get("linear_num_value_heads", default=None) is not None or cfg.get("full_attention_interval", default=None):
        nk = cfg.get_int("linear_num_key_heads")
        nv = cfg.get_int("linear_num_value_heads")
        dk = cfg.get_int("linear_key_head_dim")
        dv = cfg.get_int("linear_value_head_dim")
        kernel = cfg.get_int("linear_conv_kernel_dim")
        conv_dim = dk * nk * 2 + dv * nv
        elements = (kernel - 1) * conv_dim + nv * dv * dk
    elif cfg.get("mamba_n_heads", default=None) is not None:  # Mamba-2 (Bamba, Granite-4): vLLM mamba2_state_shape
        d_state = cfg.get_int("mamba_d_state")
        d_conv = cfg.get_int("mamba_d_conv")
        heads, head_dim = cfg.get_int("mamba_n_heads"), cfg.get_int("mamba_d_head")
        intermediate = cfg.get_int("mamba_expand") * hidden_size
        conv_dim = intermediate + 2 * cfg.get_int("mamba_n_groups", default=1) * d_state
        elements = (d_conv - 1) * conv_dim + heads * head_dim * d_state
    else:
        d_state = cfg.get_int("mamba_d_state")
        d_conv = cfg.get_int("mamba_d_conv")
        intermediate = cfg.get_int("mamba_expand") * hidden_size
        elements = intermediate * (d_conv - 1) + intermediate * d_state
    return LayerSpec(LayerKind.LINEAR_STATE, state_elements=elements)
