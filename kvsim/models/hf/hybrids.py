"""Mamba hybrids with their own layouts (Nemotron-H, Falcon-H1, Zamba2) and attention-free models (Mamba,
Mamba-2, RWKV): which layers keep a state, which keep KV, by vLLM 0.33's model files.
"""

from __future__ import annotations

from typing import Callable

from kvsim.errors import KvsimError
from kvsim.models.hf.attention import attention_layer
from kvsim.models.hf.fields import Config
from kvsim.models.hf.state import mamba1, mamba2, mamba_intermediate, ssm_dtype, state
from kvsim.models.spec import LayerKind, LayerSpec

# Nemotron-H's hybrid_override_pattern, one character a layer (vLLM nemotron_h.py ALL_DECODER_LAYER_TYPES).
_NEMOTRON_H = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _nemotron_h(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """Nemotron-H / Nemotron-3: `M` mamba-2, `*` attention, `-` MLP and `E` MoE (no cache). The mamba state is
    mamba2 with intermediate mamba_num_heads x mamba_head_dim; vLLM keeps its ssm part in the config's
    mamba_ssm_cache_dtype, float32 when it gives none (NemotronHForCausalLMConfig)."""
    pattern = cfg.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or len(pattern) != num_layers or set(pattern) - set(_NEMOTRON_H):
        raise KvsimError(
            f"expected {num_layers} characters of {''.join(_NEMOTRON_H)}, got {pattern!r}",
            source=cfg.source,
            field="hybrid_override_pattern",
        )
    heads, head_dim = cfg.get_int("mamba_num_heads"), cfg.get_int("mamba_head_dim")
    mamba = mamba2(
        intermediate=heads * head_dim,
        n_groups=cfg.get_int("n_groups"),
        heads=heads,
        head_dim=head_dim,
        d_state=cfg.get_int("ssm_state_size"),
        d_conv=cfg.get_int("conv_kernel"),
        dtype=ssm_dtype(cfg, "mamba_ssm_cache_dtype", "fp32"),
    )
    cfg.consult("attention_head_dim")  # vLLM sizes attention from head_dim (or hidden / heads), not this key
    attention = attention_layer(cfg, hidden_size, num_heads) if "*" in pattern else None
    if attention is None:  # no attention layer: its shape keys describe nothing this config builds
        cfg.consult("head_dim", "num_key_value_heads")
    none = LayerSpec(LayerKind.NO_CACHE)
    return [mamba if c == "M" else attention if c == "*" else none for c in pattern]


# transformers' FalconH1Config class default for a config.json without the key (an explicit null means
# mamba_expand x hidden_size instead).
_FALCON_H1_D_SSM = 1024


def _falcon_h1(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """Falcon-H1 (vLLM falcon_h1.py): every layer runs attention and a mamba-2 mixer side by side, so each
    keeps KV and a state. The mixer's width d_ssm is vLLM's: mamba_d_ssm, or mamba_expand x hidden_size when it
    is null; a config.json without the key gets FalconH1Config's default 1024. The heads must span that width
    (mamba_n_heads x mamba_d_head == d_ssm, as FalconH1Config validates): otherwise the config is refused."""
    attention = attention_layer(cfg, hidden_size, num_heads)
    if "mamba_d_ssm" in cfg.data:
        intermediate = mamba_intermediate(cfg, hidden_size)
    else:
        cfg.consult("mamba_expand")
        intermediate = _FALCON_H1_D_SSM
    heads = cfg.get_int("mamba_n_heads")
    # transformers' FalconH1Config: mamba_d_head "auto" is the mixer width over its heads
    head_dim = intermediate // heads if cfg.get("mamba_d_head") == "auto" else cfg.get_int("mamba_d_head")
    if heads * head_dim != intermediate:
        given = "mamba_d_ssm" if cfg.data.get("mamba_d_ssm") else (
            "mamba_expand x hidden_size (mamba_d_ssm null)" if "mamba_d_ssm" in cfg.data else "FalconH1Config's default mamba_d_ssm")
        raise KvsimError(
            f"mamba_n_heads x mamba_d_head = {heads} x {head_dim} = {heads * head_dim} contradicts the SSM width "
            f"{intermediate} ({given}); transformers' FalconH1Config rejects such a config and vLLM's mixer would not "
            "load it, so no size would be right",
            source=cfg.source,
            field="mamba_d_ssm",
        )
    mamba = mamba2(
        intermediate=intermediate,
        n_groups=cfg.get_int("mamba_n_groups", default=1),
        heads=heads,
        head_dim=head_dim,
        d_state=cfg.get_int("mamba_d_state"),
        d_conv=cfg.get_int("mamba_d_conv"),
    )
    return [layer for _ in range(num_layers) for layer in (attention, mamba)]


def _zamba2(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """Zamba2 (vLLM zamba2.py): every layer has a mamba-2 mixer; `hybrid` layers of layers_block_type also run
    the shared transformer block, whose attention keeps its own KV per layer: num_attention_heads KV heads
    (vLLM builds it as MHA) of attention_head_dim."""
    types = cfg.get("layers_block_type")
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {"mamba", "hybrid"}:
        raise KvsimError(f"expected {num_layers} of mamba / hybrid", source=cfg.source, field="layers_block_type")
    hybrid = [i for i, kind in enumerate(types) if kind == "hybrid"]
    if cfg.get("hybrid_layer_ids", default=hybrid) != hybrid:
        raise KvsimError(f"disagrees with layers_block_type (hybrid at {hybrid})", source=cfg.source, field="hybrid_layer_ids")
    cfg.consult("num_key_value_heads")  # vLLM builds Zamba2's attention as MHA, whatever this says
    mamba = mamba2(
        intermediate=cfg.get_int("mamba_expand") * hidden_size,
        n_groups=cfg.get_int("mamba_ngroups", default=1),
        heads=cfg.get_int("n_mamba_heads"),
        head_dim=cfg.get_int("mamba_headdim"),
        d_state=cfg.get_int("mamba_d_state"),
        d_conv=cfg.get_int("mamba_d_conv"),
    )
    attention = LayerSpec(LayerKind.FULL, num_kv_heads=num_heads, head_dim=cfg.get_int("attention_head_dim"))
    layers = []
    for kind in types:
        layers += [mamba, attention] if kind == "hybrid" else [mamba]
    return layers


def _mamba(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """Mamba-1 / FalconMamba (vLLM mamba.py): no attention; a mamba1 state of intermediate_size per layer."""
    layer = mamba1(
        intermediate=cfg.get_int("intermediate_size", default=None) or cfg.get_int("expand") * hidden_size,
        d_state=cfg.get_int("state_size"),
        d_conv=cfg.get_int("conv_kernel"),
    )
    return [layer] * num_layers


def _mamba2(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """Mamba-2 / Codestral Mamba (vLLM mamba2.py): no attention; a mamba2 state per layer."""
    layer = mamba2(
        intermediate=cfg.get_int("intermediate_size", default=None) or cfg.get_int("expand") * hidden_size,
        n_groups=cfg.get_int("n_groups", default=1),
        heads=cfg.get_int("num_heads"),
        head_dim=cfg.get_int("head_dim"),
        d_state=cfg.get_int("state_size"),
        d_conv=cfg.get_int("conv_kernel"),
    )
    return [layer] * num_layers


def _rwkv(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """RWKV-4 (transformers RwkvModel; vLLM 0.33 does not serve RWKV): five hidden_size vectors a layer, the
    attention's numerator, denominator and max in float32, the two shifted inputs in the model's dtype.

    RWKV-5/6/7 (`rwkv5`, `rwkv6`, `rwkv7`) keep a matrix state per head instead (head_size x head_size): read by
    this reader, and refused by name rather than sized as RWKV-4."""
    model_type = str(cfg.get("model_type", default="rwkv")).lower()
    if model_type != "rwkv":
        raise KvsimError(
            f"not modelled: {model_type} keeps a head_size x head_size matrix state per head, which kvsim does not "
            "size (only RWKV-4, model_type 'rwkv'); vLLM 0.33 serves no RWKV model",
            source=cfg.source,
            field="model_type",
        )
    return [state(2 * hidden_size, 3 * hidden_size, "fp32")] * num_layers


READERS: dict[str, Callable[[Config, int, int, int], list[LayerSpec]]] = {
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "zamba2": _zamba2,
    "mamba": _mamba,
    "mamba2": _mamba2,
    "rwkv": _rwkv,
}
