"""Hugging Face config.json -> ModelSpec, offline: which kind each layer is and what it stores.

The family reader (kvsim.models.hf.families) decides each layer's kind and shape by vLLM 0.33's rule for that family;
a layout key the reader does not read is refused first (kvsim.models.hf.layout_keys). A field it needs and cannot find
raises KvsimError naming field and file.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.models.hf.context import checkpoint_kv_dtype, max_model_len, weight_dtype
from kvsim.models.hf.families import ATTENTION_FREE, VLLM_UNSERVED, family_of, read_layers
from kvsim.models.hf.fields import Config, flatten
from kvsim.models.hf.layout_keys import check_layout_keys, check_layout_keys_read
from kvsim.models.hf.params import estimate_num_params
from kvsim.models.spec import ModelSpec
from kvsim.models.weight_config import weight_config

__all__ = ["estimate_num_params", "load_hf_config", "model_spec_from_config"]

# Files a checkpoint ships beside its config.json: named as a model, they are a mistake worth naming.
MAX_LAYERS = 10_000  # the deepest served models have a few hundred
# Widths and counts the weight count reads (kvsim.models.weight_config, kvsim.models.hf.params): where a config
# gives one it must be a whole number, positive for the first two (a -1 vocabulary would shrink the weights and
# grow the KV budget silently), zero allowed for the rest (no shared experts, q_lora_rank 0).
_POSITIVE_WEIGHT_FIELDS = ("vocab_size", "intermediate_size")
_COUNT_WEIGHT_FIELDS = ("ffn_dim", "n_inner", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                        "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                        "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                        "v_head_dim")
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
# ModelOpt 0.29 and before saved the quantization config in this file beside config.json, not in it; vLLM 0.33 reads
# it where config.json has no quantization_config (vllm/transformers_utils/config.py, get_config)
QUANT_CONFIG = "hf_quant_config.json"


def config_name(path: Path, data: dict) -> str:
    """A model's name from its config file: the file's own name (`qwen25-7b.json` -> qwen25-7b), or for a
    Hugging Face `config.json` the config's `_name_or_path` (its last part) or else the folder holding it.

    Never the folder of a file with a name of its own: workloads resolve paths to absolute ones, and every
    report would be named after wherever the file happens to live.
    """
    if path.stem.lower() != "config":
        return path.stem
    hub = data.get("_name_or_path")
    if isinstance(hub, str) and hub.strip().strip("/"):
        return hub.strip().strip("/").split("/")[-1]
    return path.resolve().parent.name or path.stem


def load_hf_config(path: str | Path, *, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face config.json at `path` into a ModelSpec (parameter count estimated from it)."""
    source = str(path)
    if Path(path).suffix.lower() in _WEIGHT_FILES:
        raise KvsimError("a weights file, not a config: give the checkpoint's folder or its config.json", source=source)
    data = _read_json_object(Path(path), "config", "a config.json")
    data, quant_source = _with_legacy_quant_config(Path(path), data)
    spec = model_spec_from_config(data, source=source, name=name or config_name(Path(path), data),
                                  quant_source=quant_source)
    estimate = estimate_num_params(data, spec)
    if estimate is None:
        return spec
    return replace(spec, num_params=estimate, params_source="estimated from config.json tensor shapes")


def _with_legacy_quant_config(path: Path, data: dict) -> tuple[dict, str | None]:
    """A checkpoint's config.json with its `hf_quant_config.json` as quantization_config, as vLLM 0.33 reads it:
    only where the file is a checkpoint's config.json (a folder's, the Hugging Face cache's, the Hub's download)
    and states no quantization_config itself. Returns the data and the file it took, if any."""
    beside = path.with_name(QUANT_CONFIG)
    if path.name != "config.json" or data.get("quantization_config") is not None or not beside.is_file():
        return data, None
    quant = _read_json_object(beside, "it", f"a {QUANT_CONFIG}")
    return {**data, "quantization_config": quant}, str(beside)


def _read_json_object(path: Path, it: str, kind: str) -> dict:
    """The JSON object in `path`; else a KvsimError naming the file (`it` and `kind` word the messages:
    "cannot read {it}", "not {kind}: binary content")."""
    source = str(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise KvsimError(f"cannot read {it}: {exc.strerror or exc}", source=source) from None
    except UnicodeDecodeError:
        raise KvsimError(f"not {kind}: binary content, not JSON text", source=source) from None
    except json.JSONDecodeError as exc:
        raise KvsimError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=source) from None
    if not isinstance(data, dict):
        raise KvsimError("expected a JSON object at the top level", source=source)
    return data


def _check_weight_fields(cfg: Config) -> None:
    """The weight count's widths and counts, where given: whole numbers, positive where zero means nothing."""
    for name in _POSITIVE_WEIGHT_FIELDS + _COUNT_WEIGHT_FIELDS:
        value = cfg.data.get(name)
        if value is None:
            continue
        least = 1 if name in _POSITIVE_WEIGHT_FIELDS else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            what = "a positive integer" if least else "a whole number >= 0"
            raise KvsimError(f"expected {what}, got {value!r}", source=cfg.source, field=name)


def model_spec_from_config(
    data: dict[str, Any],
    *,
    source: str,
    name: str,
    hf_id: str | None = None,
    num_params: int | None = None,
    params_source: str | None = None,
    quant_source: str | None = None,
) -> ModelSpec:
    """Build a ModelSpec from a config dict (as in config.json). `source` names the file in errors; `quant_source`
    the file its quantization_config came from where that is another (a ModelOpt `hf_quant_config.json`)."""
    data = flatten(data)
    cfg = Config(data, source)
    family = family_of(cfg)
    check_layout_keys(cfg, family)  # before any figure: a layout key this family's reader ignores is an error
    _check_weight_fields(cfg)
    num_layers = cfg.get_int("num_hidden_layers", "n_layer", "num_layers")
    if num_layers > MAX_LAYERS:  # kvsim keeps one entry per layer: a typo of 10^8 would hang, 10^30 overflow
        raise KvsimError(f"expected at most {MAX_LAYERS:,} layers, got {num_layers:,}", source=source,
                         field=next(n for n in ("num_hidden_layers", "n_layer", "num_layers") if cfg.data.get(n) is not None))
    hidden_size = cfg.get_int("hidden_size", "d_model", "n_embd")
    num_heads = 0 if family in ATTENTION_FREE else cfg.get_int("num_attention_heads", "n_head", "num_heads")
    layers = read_layers(cfg, family, hidden_size, num_heads, num_layers)
    check_layout_keys_read(cfg, family)
    return ModelSpec(
        name=name,
        hf_id=hf_id,
        layers=tuple(layers),
        max_model_len=max_model_len(cfg, assume_default=family in ATTENTION_FREE),
        num_params=num_params,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        weight_dtype=weight_dtype(cfg),
        checkpoint_kv_dtype=checkpoint_kv_dtype(cfg, layers, quant_source=quant_source),
        vocab_size=cfg.get("vocab_size", default=None),
        source=source,
        params_source=params_source,
        vllm_unserved=VLLM_UNSERVED.get(family),
        weight_config=weight_config(data, num_layers, quant_source or source),
    )

