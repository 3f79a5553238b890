"""Attention layers from a config: KV heads, head size, MLA latent.
"""

from __future__ import annotations

from kvsim.errors import KvsimError
from kvsim.hf.fields import Config
from kvsim.models import LayerKind, LayerSpec

def attention_layer(cfg: Config, hidden_size: int, num_heads: int) -> LayerSpec:
    """The attention layer every attention position of the model uses (full kind; sliding copies it)."""
    if cfg.get("kv_lora_rank", default=None) is not None:
        latent = cfg.get_int("kv_lora_rank") + cfg.get_int("qk_rope_head_dim")
        return LayerSpec(LayerKind.MLA, latent_dim=latent)
    return LayerSpec(LayerKind.FULL, num_kv_heads=_num_kv_heads(cfg, num_heads), head_dim=_head_dim(cfg, hidden_size, num_heads))


def _num_kv_heads(cfg: Config, num_heads: int) -> int:
    """KV heads: Falcon's multi_query means ONE head unless new_decoder_architecture; missing means MHA."""
    if cfg.get("new_decoder_architecture", default=False):
        return cfg.get_int("num_kv_heads", "n_head_kv", "num_key_value_heads")
    if cfg.get("multi_query", default=False):
        return 1
    return cfg.get_int("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", default=num_heads)


def _head_dim(cfg: Config, hidden_size: int, num_heads: int) -> int:
    """An explicit head_dim wins (Qwen3, Gemma set it); otherwise hidden_size / num_attention_heads."""
    explicit = cfg.get_int("head_dim", "kv_channels", default=None)  # kv_channels: ChatGLM / GLM-4
    if explicit is not None:
        return explicit
    if hidden_size % num_heads:
        raise KvsimError(
            f"no head_dim, and hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}",
            source=cfg.source,
            field="head_dim",
        )
    return hidden_size // num_heads
