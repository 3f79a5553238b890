"""A config.json's fields: the decoder's own (text_config lifted), class defaults filled, typed getters that
name field and file in every error.
"""

from __future__ import annotations

from typing import Any

from kvsim.errors import KvsimError

_MISSING = object()

# Fields a family's transformers config class fills in when config.json leaves them out (or sets them null).
# Shipped checkpoints rely on these: Falcon-7B/40B's config.json has no max_position_embeddings, gemma-3's
# text_config has neither max_position_embeddings nor vocab_size, and Qwen2/Qwen3 keep sliding windows off
# unless use_sliding_window says otherwise (then only layers >= max_window_layers slide).
_FALCON = {"max_position_embeddings": 2048}
_GEMMA3 = {"max_position_embeddings": 131072, "vocab_size": 262208}
_QWEN = {"use_sliding_window": False, "max_window_layers": 28}
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "falcon": _FALCON,
    "refinedweb": _FALCON,
    "refinedwebmodel": _FALCON,
    "gemma3": _GEMMA3,
    "gemma3_text": _GEMMA3,
    "qwen2": _QWEN,
    "qwen2_moe": _QWEN,
    "qwen3": _QWEN,
    "qwen3_moe": _QWEN,
}


def flatten(data: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields: `text_config` (multimodal wrappers) over the top level, then class defaults."""
    text = data.get("text_config")
    if isinstance(text, dict):  # gemma3, llava...: the decoder lives here
        data = {**{k: v for k, v in data.items() if k != "text_config"}, **text}
    return {**data, **{k: v for k, v in class_defaults(data).items() if data.get(k) is None}}


def class_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """The fields the family's transformers config class fills in (by model_type)."""
    return _CLASS_DEFAULTS.get(str(data.get("model_type", "")).lower(), {})


class Config:
    """A config dict plus the file it came from, so every missing field names both.

    `read` collects every field a reader asked for, so kvsim.models.hf.layout_keys can refuse a layout key that was
    set but never consulted.
    """

    def __init__(self, data: dict[str, Any], source: str):
        self.data = data
        self.source = source
        self.read: set[str] = set()

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        """The first of `names` present with a non-null value; `default` if given, else a KvsimError."""
        self.read.update(names)
        for name in names:
            value = self.data.get(name)
            if value is not None:
                return value
        if default is not _MISSING:
            return default
        raise KvsimError(f"missing field {' / '.join(names)!s}", source=self.source, field=names[0])

    def consult(self, *names: str) -> None:
        """Mark `names` as read on purpose: under this reading they do not change the cache (MLA's KV heads)."""
        self.read.update(names)

    def get_int(self, *names: str, default: Any = _MISSING) -> Any:
        """Like `get`, but a present value must be a positive integer (a default is returned as is)."""
        value = self.get(*names, default=default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise KvsimError(f"expected a positive integer, got {value!r}", source=self.source, field=names[0])
        return value
