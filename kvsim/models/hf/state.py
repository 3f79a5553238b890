"""The constant per-sequence state of linear-attention, mamba and RWKV layers, as vLLM 0.33 shapes it.

Shapes follow vllm/model_executor/layers/mamba/mamba_utils.py (MambaStateShapeCalculator): a conv state and a
recurrent (ssm / temporal) state per layer; the recurrent part may be kept in another dtype (`ssm_dtype`).
"""

from __future__ import annotations

from kvsim.models.hf.fields import Config
from kvsim.models.spec import LayerKind, LayerSpec

_SSM_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def state(conv: int, ssm: int, ssm_dtype: str | None = None) -> LayerSpec:
    """A LINEAR_STATE layer of `conv` + `ssm` elements, the ssm part in `ssm_dtype` (None: the model's dtype)."""
    return LayerSpec(LayerKind.LINEAR_STATE, state_elements=conv + ssm, ssm_elements=ssm if ssm_dtype else 0, ssm_dtype=ssm_dtype)


def ssm_dtype(cfg: Config, field: str, default: str | None = None) -> str | None:
    """The recurrent state's dtype named by config field `field` ('float32' -> 'fp32'), else `default`."""
    value = cfg.get(field, default=None)
    if value is None or value == "auto":
        return default
    if value not in _SSM_DTYPES:
        from kvsim.errors import KvsimError

        raise KvsimError(f"expected one of {', '.join(_SSM_DTYPES)}, got {value!r}", source=cfg.source, field=field)
    return _SSM_DTYPES[value]


def mamba2(*, intermediate: int, n_groups: int, heads: int, head_dim: int, d_state: int, d_conv: int, dtype: str | None = None) -> LayerSpec:
    """vLLM mamba2_state_shape: conv (d_conv - 1) x (intermediate + 2 n_groups d_state), ssm heads x head_dim x d_state."""
    return state((d_conv - 1) * (intermediate + 2 * n_groups * d_state), heads * head_dim * d_state, dtype)


def mamba1(*, intermediate: int, d_state: int, d_conv: int, dtype: str | None = None) -> LayerSpec:
    """vLLM mamba1_state_shape: conv intermediate x (d_conv - 1), ssm intermediate x d_state."""
    return state(intermediate * (d_conv - 1), intermediate * d_state, dtype)


def mamba_intermediate(cfg: Config, hidden_size: int) -> int:
    """A mamba mixer's width: mamba_d_ssm when given (mamba_expand then unused), else mamba_expand x hidden_size."""
    explicit = cfg.get_int("mamba_d_ssm", default=None)
    if explicit is not None:
        cfg.consult("mamba_expand")
        return explicit
    return cfg.get_int("mamba_expand") * hidden_size


def state_layer(cfg: Config, hidden_size: int, dtype: str | None = None) -> LayerSpec:
    """The state layer of a generic hybrid config: gated delta net (Qwen3-Next, Qwen3.5) or mamba (Jamba, Granite-4).

    Gated delta net (vLLM gated_delta_net_state_shape): conv state (conv_kernel - 1) x conv_dim with
    conv_dim = key_dim*num_key_heads*2 + value_dim*num_value_heads, plus recurrent num_value_heads x
    value_dim x key_dim. Mamba-2 (`mamba_n_heads` present): intermediate = mamba_expand x hidden_size (or
    mamba_d_ssm). Mamba-1: intermediate = mamba_expand x hidden_size.
    """
    if cfg.get("linear_num_value_heads", default=None) is not None or cfg.get("full_attention_interval", default=None):
        nk = cfg.get_int("linear_num_key_heads")
        nv = cfg.get_int("linear_num_value_heads")
        dk = cfg.get_int("linear_key_head_dim")
        dv = cfg.get_int("linear_value_head_dim")
        kernel = cfg.get_int("linear_conv_kernel_dim")
        return state((kernel - 1) * (dk * nk * 2 + dv * nv), nv * dv * dk, dtype)
    if cfg.get("mamba_n_heads", default=None) is not None:  # Mamba-2 (Granite-4.0-H, Bamba)
        return mamba2(
            intermediate=mamba_intermediate(cfg, hidden_size),
            n_groups=cfg.get_int("mamba_n_groups", default=1),
            heads=cfg.get_int("mamba_n_heads"),
            head_dim=cfg.get_int("mamba_d_head"),
            d_state=cfg.get_int("mamba_d_state"),
            d_conv=cfg.get_int("mamba_d_conv"),
            dtype=dtype,
        )
    return mamba1(
        intermediate=cfg.get_int("mamba_expand") * hidden_size,
        d_state=cfg.get_int("mamba_d_state"),
        d_conv=cfg.get_int("mamba_d_conv"),
        dtype=dtype,
    )
