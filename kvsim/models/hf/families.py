"""Each family's layer layout, read from its own config keys by vLLM 0.33's rule for it.

`family_of` names the reader for a config (by model_type); `read_layers` runs it. The keys each reader reads are
kvsim.models.hf.layout_keys' table, checked before any reader runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from kvsim.errors import KvsimError
from kvsim.models.hf import hybrids
from kvsim.models.hf.attention import attention_layer
from kvsim.models.hf.fields import Config
from kvsim.models.hf.patterns import layer_kinds
from kvsim.models.hf.state import ssm_dtype, state_layer
from kvsim.models.spec import LayerKind, LayerSpec

_FAMILY_OF = {
    "deci": "deci", "nemotron-nas": "deci", "nemotron_nas": "deci",
    "llama4": "llama4", "llama4_text": "llama4",
    "gemma4": "gemma4", "gemma4_text": "gemma4", "gemma4_unified": "gemma4", "gemma4_unified_text": "gemma4",
    "gemma3n": "gemma3n", "gemma3n_text": "gemma3n",
    "mimo_v2_flash": "mimo_v2", "mimo_v2": "mimo_v2",
    "deepseek_v32": "dsa", "glm_moe_dsa": "dsa",
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5",
    "nemotron_h": "nemotron_h", "falcon_h1": "falcon_h1", "zamba2": "zamba2",
    "mamba": "mamba", "falcon_mamba": "mamba", "mamba2": "mamba2",
    "rwkv": "rwkv", "rwkv5": "rwkv", "rwkv6": "rwkv", "rwkv7": "rwkv",
}  # fmt: skip

# Families vLLM 0.33 does not serve at all: refused, whatever their keys say.
_REFUSED = {
    "minimax": "MiniMax-Text-01 / MiniMax-M1 (lightning attention): vLLM removed MiniMaxText01ForCausalLM in 0.23.0",
    "minimax_text_01": "MiniMax-Text-01 (lightning attention): vLLM removed MiniMaxText01ForCausalLM in 0.23.0",
    "minimax_m1": "MiniMax-M1 (lightning attention): vLLM removed MiniMaxM1ForCausalLM in 0.23.0",
    "kimi_linear": "Kimi Linear / Kimi K3: the KDA layers' conv and recurrent state (vllm/models/kimi_k3, "
                   "kda_state_shape) are not modelled by kvsim yet",
}

ATTENTION_FREE = frozenset({"mamba", "mamba2", "rwkv"})

# Families kvsim sizes by their own layout although vLLM 0.33 does not serve them: no vLLM figures for them.
VLLM_UNSERVED = {"rwkv": "no RWKV architecture in its model registry"}


# The keys of a state layer's shape (kvsim.models.hf.state.state_layer), inert where no layer is a state layer.
_STATE_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
               "mamba_d_conv", "mamba_expand", "mamba_d_ssm")  # fmt: skip


def family_of(cfg: Config) -> str:
    """The family reader for this config, by model_type; 'generic' for every family without its own reader."""
    model_type = str(cfg.get("model_type", default="")).lower()
    if model_type in _REFUSED:
        raise KvsimError(f"not modelled: {_REFUSED[model_type]}; kvsim follows vLLM 0.33", source=cfg.source, field="model_type")
    return _FAMILY_OF.get(model_type, "generic")


def read_layers(cfg: Config, family: str, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """Every layer's cache footprint, in order (a Falcon-H1 / Zamba2 layer with both attention and mamba
    contributes two specs)."""
    return _READERS[family](cfg, hidden_size, num_heads, num_layers)


def generic(
    cfg: Config,
    hidden_size: int,
    num_heads: int,
    num_layers: int,
    *,
    ssm: str | None = None,
    indexer: bool = False,
    extra: dict[str, LayerKind] | None = None,
    window: int | None = None,
) -> list[LayerSpec]:
    """One attention shape for every attention layer, kinds from kvsim.models.hf.patterns, one state shape."""
    kinds = layer_kinds(cfg, num_layers, extra)
    attention = attention_layer(cfg, hidden_size, num_heads, indexer=indexer)
    state = state_layer(cfg, hidden_size, ssm) if LayerKind.LINEAR_STATE in kinds else None
    if state is None and cfg.get("layer_types", default=None) is not None:
        # An explicit layer list without a state layer (the dense Granite 4.0 models: granitemoehybrid, every layer
        # "attention"): vLLM builds a mixer only where the list says so, so the mixer's keys change nothing.
        cfg.consult(*_STATE_KEYS)
    if LayerKind.SLIDING in kinds:
        window = cfg.get_int("sliding_window")
    layers = []
    for kind in kinds:
        if kind == LayerKind.LINEAR_STATE:
            layers.append(state)
        elif kind in (LayerKind.SLIDING, LayerKind.CHUNKED):
            if attention.kind == LayerKind.MLA:
                raise KvsimError("sliding-window MLA layers are not modelled", source=cfg.source, field="sliding_window")
            layers.append(replace(attention, kind=kind, window=window))
        else:
            layers.append(attention)
    return layers


def _deci(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """DeciLM / Llama-Nemotron (vLLM nemotron_nas.py): per layer `block_configs[i].attention`; no_op attention
    keeps nothing, otherwise num_attention_heads // n_heads_in_group KV heads of hidden_size / heads.

    `replace_with_linear` attention (a linear map, no KV) is taken as keeping nothing too; vLLM 0.33 reads
    only `no_op` and needs n_heads_in_group on every other layer.
    """
    blocks = cfg.get("block_configs")
    if not isinstance(blocks, list) or len(blocks) != num_layers:
        raise KvsimError(f"expected a list of {num_layers} block configs", source=cfg.source, field="block_configs")
    head_dim = attention_layer(cfg, hidden_size, num_heads).head_dim
    layers = []
    for i, block in enumerate(blocks):
        attn = block.get("attention") if isinstance(block, dict) else None
        if not isinstance(attn, dict):
            raise KvsimError(f"block {i} has no attention config", source=cfg.source, field="block_configs")
        if attn.get("no_op") or attn.get("replace_with_linear"):
            layers.append(LayerSpec(LayerKind.NO_CACHE))
            continue
        group = attn.get("n_heads_in_group")
        if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or num_heads % group:
            raise KvsimError(
                f"block {i}: n_heads_in_group {group!r} does not divide num_attention_heads {num_heads}",
                source=cfg.source,
                field="block_configs",
            )
        layers.append(LayerSpec(LayerKind.FULL, num_kv_heads=num_heads // group, head_dim=head_dim))
    return layers


# transformers' Llama4TextConfig: without no_rope_layers, every no_rope_layer_interval-th layer is NoPE.
_LLAMA4_NO_ROPE_INTERVAL = 4


def _llama4(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """Llama 4 (vLLM llama4.py): layers with RoPE (no_rope_layers[i] != 0) use chunked local attention over
    attention_chunk_size tokens; NoPE layers attend globally. Newer exports say `layer_types: chunked_attention`.

    Shipped configs (Scout, Maverick) leave no_rope_layers out: transformers' Llama4TextConfig then builds it as
    `(i + 1) % no_rope_layer_interval != 0` (interval 4 by default), and vLLM reads that list."""
    chunk = cfg.get_int("attention_chunk_size", default=None)
    if chunk is None:  # no chunking: every layer is plain attention
        cfg.consult("no_rope_layers", "no_rope_layer_interval")
        return generic(cfg, hidden_size, num_heads, num_layers)
    if cfg.get("layer_types", default=None) is not None:
        return generic(cfg, hidden_size, num_heads, num_layers, extra={"chunked_attention": LayerKind.CHUNKED}, window=chunk)
    rope = cfg.get("no_rope_layers", default=None)
    if not rope:  # None or []: the config class's default list
        interval = cfg.get_int("no_rope_layer_interval", default=_LLAMA4_NO_ROPE_INTERVAL)
        rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(rope, list) or len(rope) != num_layers:
        raise KvsimError(f"expected a list of {num_layers} 0/1 flags", source=cfg.source, field="no_rope_layers")
    attention = attention_layer(cfg, hidden_size, num_heads)
    return [replace(attention, kind=LayerKind.CHUNKED, window=chunk) if flag else attention for flag in rope]


def _gemma4(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """Gemma 4 (vLLM gemma4.py, per-layer config): sliding layers num_key_value_heads x head_dim over
    sliding_window; full layers global_head_dim wide, with num_global_key_value_heads KV heads on
    attention_k_eq_v models (which still cache K and V: K is loaded into both), num_key_value_heads otherwise.

    kvsim asks for global_head_dim rather than assume the config class's default, and refuses
    num_global_key_value_heads without attention_k_eq_v, a combination no public config shows.
    """
    kinds = layer_kinds(cfg, num_layers)
    local = attention_layer(cfg, hidden_size, num_heads)
    global_heads = cfg.get_int("num_global_key_value_heads", default=None)
    if global_heads is not None and not cfg.get("attention_k_eq_v", default=False):
        raise KvsimError(
            "not modelled: num_global_key_value_heads without attention_k_eq_v", source=cfg.source, field="num_global_key_value_heads"
        )
    full = LayerSpec(LayerKind.FULL, num_kv_heads=global_heads or local.num_kv_heads, head_dim=cfg.get_int("global_head_dim"))
    window = cfg.get_int("sliding_window") if LayerKind.SLIDING in kinds else None
    return [replace(local, kind=LayerKind.SLIDING, window=window) if k == LayerKind.SLIDING else full for k in kinds]


def _kv_shared(cfg: Config, layers: list[LayerSpec]) -> list[LayerSpec]:
    """Gemma-3n / Gemma 4: the last num_kv_shared_layers layers read an earlier layer's KV and cache nothing."""
    shared = cfg.get("num_kv_shared_layers", default=0)
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < len(layers):
        raise KvsimError(f"expected an integer in [0, {len(layers)})", source=cfg.source, field="num_kv_shared_layers")
    first = len(layers) - shared
    return layers[:first] + [LayerSpec(LayerKind.NO_CACHE)] * shared


def _mimo_v2(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """MiMo-V2 (vLLM mimo_v2.py): hybrid_layer_pattern[i] == 1 is a sliding layer of swa_num_key_value_heads x
    swa_head_dim (V: swa_v_head_dim) over sliding_window_size; 0 is full attention of num_key_value_heads x
    head_dim (V: v_head_dim). The pattern may be a list or a string of 0/1."""
    pattern = cfg.get("hybrid_layer_pattern")
    flags = [int(c) for c in pattern] if isinstance(pattern, (list, str)) and all(str(c) in "01" for c in pattern) else None
    if flags is None or len(flags) != num_layers:
        raise KvsimError(f"expected {num_layers} 0/1 flags (a list or a string)", source=cfg.source, field="hybrid_layer_pattern")
    full = attention_layer(cfg, hidden_size, num_heads)
    swa = LayerSpec(
        LayerKind.SLIDING,
        num_kv_heads=cfg.get_int("swa_num_key_value_heads"),
        head_dim=cfg.get_int("swa_head_dim"),
        head_dim_v=cfg.get_int("swa_v_head_dim", default=0),
        window=cfg.get_int("sliding_window_size", "sliding_window"),
    )
    return [swa if flag else full for flag in flags]


def _qwen3_5(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """Qwen3.5: the generic hybrid layout; vLLM keeps the gated delta net's recurrent state in mamba_ssm_dtype."""
    return generic(cfg, hidden_size, num_heads, num_layers, ssm=ssm_dtype(cfg, "mamba_ssm_dtype"))


def _dsa(cfg: Config, hidden_size: int, num_heads: int, num_layers: int) -> list[LayerSpec]:
    """DeepSeek-V3.2 / GLM-5: MLA layers that also cache sparse-attention indexer keys, on the layers that build
    an indexer (vLLM deepseek_v2.py, IndexCache): all of them unless index_topk_pattern marks a layer 'S' or,
    without a pattern, max(i - index_skip_topk_offset + 1, 0) % index_topk_freq != 0 (defaults 2 and 1)."""
    layers = generic(cfg, hidden_size, num_heads, num_layers, indexer=True)
    pattern = cfg.get("index_topk_pattern", default=None)
    if pattern is not None:
        if not isinstance(pattern, (list, str)) or len(pattern) != num_layers:
            raise KvsimError(f"expected {num_layers} layer marks", source=cfg.source, field="index_topk_pattern")
        builds = [mark != "S" for mark in pattern]
        cfg.consult("index_topk_freq", "index_skip_topk_offset")  # vLLM reads them only without a pattern
    else:
        freq = cfg.get_int("index_topk_freq", default=1)
        offset = cfg.get("index_skip_topk_offset", default=2)
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise KvsimError(f"expected an integer, got {offset!r}", source=cfg.source, field="index_skip_topk_offset")
        builds = [max(i - offset + 1, 0) % freq == 0 for i in range(num_layers)]
    types = cfg.get("indexer_types", default=None)  # vLLM does not read it for these models: it must agree
    if types is not None and types != ["full" if b else "shared" for b in builds]:
        raise KvsimError("disagrees with index_topk_freq / index_skip_topk_offset", source=cfg.source, field="indexer_types")
    return [layer if build else replace(layer, index_bytes=0) for layer, build in zip(layers, builds)]


Reader = Callable[[Config, int, int, int], list[LayerSpec]]
_READERS: dict[str, Reader] = {
    "generic": generic,
    "deci": _deci,
    "llama4": _llama4,
    "gemma4": lambda cfg, *shape: _kv_shared(cfg, _gemma4(cfg, *shape)),
    "gemma3n": lambda cfg, *shape: _kv_shared(cfg, generic(cfg, *shape)),
    "mimo_v2": _mimo_v2,
    "dsa": _dsa,
    "qwen3_5": _qwen3_5,
    **hybrids.READERS,
}
