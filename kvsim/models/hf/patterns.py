"""Which kind each layer is, for configs of the generic family: layer_types, hybrid intervals/indices/periods,
sliding-window patterns. Family-specific layouts are kvsim.models.hf.families'.
"""

from __future__ import annotations

from kvsim.errors import KvsimError
from kvsim.models.hf.fields import Config
from kvsim.models.spec import LayerKind

# Families whose configs leave the sliding/full alternation implicit: layer i slides when (i+1) % n != 0.
# gemma2 and gpt-oss alternate starting with a sliding layer; gemma3's class default pattern is 6.
_FAMILY_PATTERN = {"gemma2": 2, "gpt_oss": 2, "gemma3": 6, "gemma3_text": 6}

_LAYER_TYPE_KINDS = {
    "full_attention": LayerKind.FULL,
    "attention": LayerKind.FULL,
    "global_attention": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING,
    "local_attention": LayerKind.SLIDING,
    "linear_attention": LayerKind.LINEAR_STATE,
    "mamba": LayerKind.LINEAR_STATE,
}


def layer_kinds(cfg: Config, num_layers: int, extra: dict[str, LayerKind] | None = None) -> list[LayerKind]:
    """Each layer's kind, from the most explicit description the config gives; `extra` adds layer_types names."""
    layer_types = cfg.get("layer_types", default=None)
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise KvsimError(f"expected a list of {num_layers} layer types", source=cfg.source, field="layer_types")
        known = {**_LAYER_TYPE_KINDS, **(extra or {})}
        unknown = sorted({str(t) for t in layer_types} - set(known))
        if unknown:
            raise KvsimError(
                f"unknown layer type(s) {', '.join(unknown)} (known: {', '.join(known)})",
                source=cfg.source,
                field="layer_types",
            )
        kinds = [known[t] for t in layer_types]
        _check_interval(cfg, kinds)
        return kinds
    interval = cfg.get_int("full_attention_interval", default=None)
    if interval is not None:  # Qwen3-Next: every interval-th layer is full attention, the rest gated delta net
        return [LayerKind.FULL if (i + 1) % interval == 0 else LayerKind.LINEAR_STATE for i in range(num_layers)]
    indices = cfg.get("attn_layer_indices", default=None)
    if indices is not None:  # Bamba / Granite-4 style: attention at these layers, mamba elsewhere
        if not isinstance(indices, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in indices):
            raise KvsimError(f"expected a list of layer indices in [0, {num_layers})", source=cfg.source, field="attn_layer_indices")
        return [LayerKind.FULL if i in indices else LayerKind.LINEAR_STATE for i in range(num_layers)]
    period = cfg.get_int("attn_layer_period", default=None)
    if period is not None:  # Jamba: attention where i % period == offset, mamba elsewhere
        offset = cfg.get("attn_layer_offset")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
            raise KvsimError(f"expected an integer in [0, {period}), got {offset!r}", source=cfg.source, field="attn_layer_offset")
        return [LayerKind.FULL if i % period == offset else LayerKind.LINEAR_STATE for i in range(num_layers)]
    window = cfg.get("sliding_window", default=None)
    if window is None or cfg.get("use_sliding_window", default=True) is False:  # Qwen: False unless set
        # Qwen2/2.5/3 ship max_window_layers beside use_sliding_window false: it then changes nothing
        # (transformers' Qwen2Config drops the window, so vLLM's qwen2.py sees full attention on every layer).
        cfg.consult("max_window_layers")
        return [LayerKind.FULL] * num_layers
    model_type = str(cfg.get("model_type", default="")).lower()
    pattern = cfg.get_int("sliding_window_pattern", default=None) or _FAMILY_PATTERN.get(model_type)
    first_sliding = cfg.get("max_window_layers", default=None)
    if pattern is None and first_sliding is not None:  # Qwen2/Qwen3: layers >= max_window_layers slide
        if isinstance(first_sliding, bool) or not isinstance(first_sliding, int) or first_sliding < 0:
            raise KvsimError(
                f"expected a non-negative integer, got {first_sliding!r}", source=cfg.source, field="max_window_layers"
            )
        return [LayerKind.SLIDING if i >= first_sliding else LayerKind.FULL for i in range(num_layers)]
    if pattern is None:  # `sliding_window` alone: every layer slides (Mistral 7B v0.1)
        return [LayerKind.SLIDING] * num_layers
    return [LayerKind.SLIDING if (i + 1) % pattern != 0 else LayerKind.FULL for i in range(num_layers)]


def _check_interval(cfg: Config, kinds: list[LayerKind]) -> None:
    """Qwen3.5 configs give both layer_types and full_attention_interval: they must say the same."""
    interval = cfg.get_int("full_attention_interval", default=None)
    if interval is None:
        return
    full = [i for i, kind in enumerate(kinds) if kind == LayerKind.FULL]
    if full != [i for i in range(len(kinds)) if (i + 1) % interval == 0]:
        raise KvsimError(
            f"full_attention_interval {interval} disagrees with layer_types (full attention at {full})",
            source=cfg.source,
            field="full_attention_interval",
        )
