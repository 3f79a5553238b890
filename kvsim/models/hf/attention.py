"""Attention layers from a config: KV heads, K and V head sizes, MLA latent, sparse-attention indexer keys."""

from __future__ import annotations

from kvsim.errors import KvsimError
from kvsim.models.hf.fields import Config
from kvsim.models.spec import LayerKind, LayerSpec


# vLLM's DeepSeek-V3.2 indexer quantizes its keys to fp8 in blocks of 128 with one fp32 scale per block
# (vllm/models/deepseek_v32/attention.py: head_dim + head_dim // 128 * 4 bytes, dtype uint8).
_INDEXER_QUANT_BLOCK = 128


def attention_layer(cfg: Config, hidden_size: int, num_heads: int, *, indexer: bool = False) -> LayerSpec:
    """The attention layer every attention position of the model uses (full kind; sliding copies it).

    MLA (kv_lora_rank): one latent of kv_lora_rank + qk_rope_head_dim per token; `v_head_dim` is then the
    attention output's head size, not cached. `indexer`: DeepSeek-V3.2 / GLM-5 layers also cache index keys.
    Otherwise K and V per KV head, V of `v_head_dim` when the config gives one.
    """
    if cfg.get("kv_lora_rank", default=None) is not None:
        latent = cfg.get_int("kv_lora_rank") + cfg.get_int("qk_rope_head_dim")
        index = 0
        if indexer:
            dim = cfg.get_int("index_head_dim")
            index = dim + dim // _INDEXER_QUANT_BLOCK * 4
        cfg.consult("num_key_value_heads", "v_head_dim", "head_dim", "qk_head_dim")  # MLA caches the latent only
        return LayerSpec(LayerKind.MLA, latent_dim=latent, index_bytes=index)
    head_dim = _head_dim(cfg, hidden_size, num_heads)
    v = cfg.get_int("v_head_dim", default=0)
    return LayerSpec(LayerKind.FULL, num_kv_heads=_num_kv_heads(cfg, num_heads), head_dim=head_dim, head_dim_v=0 if v == head_dim else v)


def _num_kv_heads(cfg: Config, num_heads: int) -> int:
    """KV heads: Falcon's multi_query means ONE head unless new_decoder_architecture; missing means MHA."""
    cfg.consult("multi_query", "num_kv_heads", "n_head_kv")  # Falcon: one of the branches below decides
    if cfg.get("new_decoder_architecture", default=False):
        return cfg.get_int("num_kv_heads", "n_head_kv", "num_key_value_heads")
    if cfg.get("multi_query", default=False):
        return 1
    if cfg.get("multi_query_attention", default=None) is False:  # ChatGLM: group count only with MQA on
        return num_heads
    num_kv_heads = cfg.get_int("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", default=num_heads)
    if num_heads % num_kv_heads:  # vLLM's Attention asserts it: each KV head serves a whole group of query heads
        raise KvsimError(f"{num_kv_heads} KV heads do not divide num_attention_heads {num_heads}", source=cfg.source,
                         field="num_key_value_heads")
    return num_kv_heads


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
