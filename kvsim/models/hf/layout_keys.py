"""Which config keys decide a model's cache layout, and which of them kvsim reads for each family.

A config that sets a layout key its family's reader does not read, or does not consult for that config, is
refused (KvsimError naming key and file): kvsim never prints a number built on a key it ignored.
"""

from __future__ import annotations

import re

from kvsim.errors import KvsimError
from kvsim.models.hf.fields import Config, class_defaults

# A key "looks like layout" when its name holds one of these: layer patterns, per-kind head counts and sizes,
# windows and chunks, KV sharing (Gemma-3n, Hunyuan's cross-layer attention), cross-attention layers, MLA / indexer,
# mamba / linear-attention state.
LAYOUT_KEY = re.compile(
    r"layer_types|layer_type|_pattern|block_config|block_type|layer_ids|layer_indices|attn_layer|attn_type|"
    r"head_dim|key_value_heads|kv_heads|heads_in_group|kv_lora|kv_shared|shared_kv|window|attention_chunk|"
    r"chunked|^index_|^indexer_|mamba|ssm|^linear_|linear_attn|swa_|state_size|conv_kernel|d_state|no_rope_layers|attention_interval|"
    r"lightning|kv_channels|multi_query|^use_cla|cla_share|cross_attention_layers|per_layer_config"
)

# Keys every reader understands (kvsim.models.hf.attention, kvsim.models.hf.patterns, kvsim.models.hf.state).
_GENERIC = frozenset({
    "head_dim", "kv_channels", "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num",
    "multi_query", "multi_query_attention", "new_decoder_architecture",
    "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
    "layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "sliding_window_pattern",
    "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim",
    "attn_layer_indices", "attn_layer_period", "attn_layer_offset",
    "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_ssm",
})  # fmt: skip

# Keys that look like layout but never change what a layer caches (biases, kernels' chunking, rope of a kind,
# query heads of a kind, the indexer's query side, MTP layers' own pattern, dense / MoE MLP per layer).
_NEUTRAL = frozenset({
    "mamba_dt_rank", "mamba_proj_bias", "mamba_conv_bias", "mamba_chunk_size", "mamba_rms_norm",
    "mamba_norm_before_gate", "mamba_use_mlp", "mamba_hidden_act", "mamba_dt_min", "mamba_dt_max",
    "mamba_dt_init_floor", "mamba_dt_limit", "use_mamba_kernels", "use_mambapy", "ssm_multipliers", "ssm_in_multiplier",
    "ssm_out_multiplier", "swa_rope_theta", "swa_num_attention_heads", "add_swa_attention_sink_bias",
    "activation_sparsity_pattern", "qk_nope_head_dim", "mtp_hybrid_override_pattern", "index_topk", "index_n_heads",
    "expert_layer_period", "expert_layer_offset", "mlp_layer_types", "indexer_rope_interleave",
    "index_share_for_mtp_iteration",
})  # fmt: skip

# Keys that look like layout but that vLLM 0.33's model file for this model_type never reads: inert whatever
# their value, so never an error. gemma2.py sizes its window from sliding_window (real Gemma 2 configs repeat it
# as sliding_window_size); mimo_v2.py reads sliding_window_size, never attention_chunk_size; minimax_m2.py builds
# full attention on every layer and never reads attn_type_list.
VLLM_IGNORED: dict[str, frozenset[str]] = {
    "gemma2": frozenset({"sliding_window_size"}),
    "mimo_v2_flash": frozenset({"attention_chunk_size"}),
    "mimo_v2": frozenset({"attention_chunk_size"}),
    "minimax_m2": frozenset({"attn_type_list"}),
}

# Family (as kvsim.models.hf.families names it) -> the layout keys its reader reads beyond the generic ones.
FAMILY_KEYS: dict[str, frozenset[str]] = {
    "generic": frozenset(),
    "deci": frozenset({"block_configs"}),
    "llama4": frozenset({"attention_chunk_size", "no_rope_layers", "no_rope_layer_interval"}),
    "gemma4": frozenset({"global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "num_kv_shared_layers"}),
    "gemma3n": frozenset({"num_kv_shared_layers"}),
    "mimo_v2": frozenset({"hybrid_layer_pattern", "swa_num_key_value_heads", "swa_head_dim", "swa_v_head_dim", "sliding_window_size"}),
    "dsa": frozenset({"index_head_dim", "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern", "indexer_types"}),
    "qwen3_5": frozenset({"mamba_ssm_dtype"}),
    "nemotron_h": frozenset({"hybrid_override_pattern", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                             "n_groups", "conv_kernel", "mamba_ssm_cache_dtype", "attention_head_dim"}),
    "falcon_h1": frozenset(),
    "zamba2": frozenset({"layers_block_type", "hybrid_layer_ids", "attention_head_dim", "mamba_ngroups",
                         "n_mamba_heads", "mamba_headdim"}),
    "mamba": frozenset({"state_size", "conv_kernel"}),
    "mamba2": frozenset({"state_size", "conv_kernel"}),
    "rwkv": frozenset(),
}  # fmt: skip


def _is_set(value: object) -> bool:
    return value not in (None, False, 0, "", [], {})


def _layout_keys_set(cfg: Config) -> list[str]:
    """The config's own (not class-default) keys that look like layout and are set, in name order."""
    defaults = class_defaults(cfg.data)
    ignored = VLLM_IGNORED.get(_model_type(cfg).lower(), frozenset())
    return sorted(
        key
        for key, value in cfg.data.items()
        if LAYOUT_KEY.search(key) and key not in _NEUTRAL | ignored and _is_set(value)
        and not (key in defaults and value == defaults[key])
    )


def check_layout_keys(cfg: Config, family: str) -> None:
    """Before reading: refuse a layout key the `family` reader does not read (KvsimError naming key and file)."""
    known = _GENERIC | FAMILY_KEYS[family]
    for key in _layout_keys_set(cfg):
        if key not in known:
            _refuse(cfg, key, f"is not modelled by kvsim for model_type {_model_type(cfg)!r} (read as the {family} family)")


def check_layout_keys_read(cfg: Config, family: str) -> None:
    """After reading: refuse a layout key that is set but that the reader never consulted for this config
    (e.g. mamba fields on a config whose layers are all attention)."""
    for key in _layout_keys_set(cfg):
        if key not in cfg.read:
            _refuse(cfg, key, f"is set, but the {family} layout kvsim read for model_type {_model_type(cfg)!r} does not use it")


def _model_type(cfg: Config) -> str:
    return str(cfg.data.get("model_type", "?"))


def _refuse(cfg: Config, key: str, why: str) -> None:
    raise KvsimError(
        f"layout key {key!r} {why}, so no size would be right (docs/models.md lists what each family reads)",
        source=cfg.source,
        field=key,
    )
