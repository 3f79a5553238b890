"""Hugging Face config.json -> ModelSpec, offline: which kind each layer is and what it stores.

Handles explicit vs derived head_dim, MHA (no num_key_value_heads), Falcon multi_query, MLA, sliding windows
(model-wide, `layer_types`, `sliding_window_pattern`, family alternation), Qwen3-Next and Jamba hybrids, and
configs nested under `text_config`. A field it needs and cannot find raises KvsimError naming field and file.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.hf.attention import attention_layer
from kvsim.hf.context import rope_scaled_max_len, weight_dtype
from kvsim.hf.fields import Config, flatten
from kvsim.hf.params import estimate_num_params
from kvsim.hf.patterns import layer_kinds
from kvsim.hf.state import state_layer
from kvsim.models import LayerKind, LayerSpec, ModelSpec

__all__ = ["estimate_num_params", "load_hf_config", "model_spec_from_config"]


def load_hf_config(path: str | Path, *, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face config.json at `path` into a ModelSpec (parameter count estimated from it)."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise KvsimError(f"cannot read config: {exc.strerror or exc}", source=source) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvsimError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=source) from None
    if not isinstance(data, dict):
        raise KvsimError("expected a JSON object at the top level", source=source)
    spec = model_spec_from_config(data, source=source, name=name or Path(path).parent.name or Path(path).stem)
    estimate = estimate_num_params(data, spec)
    if estimate is None:
        return spec
    return replace(spec, num_params=estimate, params_source="estimated from config.json tensor shapes")


def model_spec_from_config(
    data: dict[str, Any],
    *,
    source: str,
    name: str,
    hf_id: str | None = None,
    num_params: int | None = None,
    params_source: str | None = None,
) -> ModelSpec:
    """Build a ModelSpec from a config dict (as in config.json). `source` names the file in errors."""
    data = flatten(data)
    cfg = Config(data, source)
    num_layers = cfg.get_int("num_hidden_layers", "n_layer", "num_layers")
    hidden_size = cfg.get_int("hidden_size", "d_model", "n_embd")
    num_heads = cfg.get_int("num_attention_heads", "n_head", "num_heads")
    max_len = rope_scaled_max_len(cfg, cfg.get_int("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"))
    kinds = layer_kinds(cfg, num_layers)
    attention = attention_layer(cfg, hidden_size, num_heads)
    state = state_layer(cfg, hidden_size) if LayerKind.LINEAR_STATE in kinds else None
    window = cfg.get_int("sliding_window") if LayerKind.SLIDING in kinds else None

    layers = []
    for kind in kinds:
        if kind == LayerKind.LINEAR_STATE:
            layers.append(state)
        elif kind == LayerKind.SLIDING and attention.kind == LayerKind.FULL:
            layers.append(LayerSpec(LayerKind.SLIDING, attention.num_kv_heads, attention.head_dim, window=window))
        else:  # FULL, or MLA (MLA models have no sliding layers kvsim knows of)
            layers.append(attention)
    return ModelSpec(
        name=name,
        hf_id=hf_id,
        layers=tuple(layers),
        max_model_len=max_len,
        num_params=num_params,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        weight_dtype=weight_dtype(cfg),
        vocab_size=cfg.get("vocab_size", default=None),
        source=source,
        params_source=params_source,
    )

