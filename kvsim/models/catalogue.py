"""The model catalogue shipped as package data (kvsim/models/data/models.yaml), and name resolution.

`resolve_model` accepts a short name (`qwen3-0.6b`), a Hugging Face id (`Qwen/Qwen3-0.6B`) or one of its
instruct / chat / base variants (`Qwen/Qwen3-0.6B-Base`), in any case, or a path to a config.json. Catalogue entries go through the same config reader as files do.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import replace
from importlib import resources
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.models.hf_config import load_hf_config, model_spec_from_config
from kvsim.models.spec import ModelSpec

CATALOGUE_FILE = "kvsim/models/data/models.yaml"


@functools.lru_cache(maxsize=1)
def _entries() -> dict[str, dict]:
    """Raw catalogue entries by short name (lower case)."""
    import yaml

    text = resources.files("kvsim.models").joinpath("data/models.yaml").read_text()
    entries = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert isinstance(entries, dict) and entries, "empty model catalogue"
    return {name.lower(): entry for name, entry in entries.items()}


@functools.lru_cache(maxsize=None)
def _build(short_name: str) -> ModelSpec:
    entry = _entries()[short_name]
    source = f"{CATALOGUE_FILE} [{short_name}]"
    spec = model_spec_from_config(
        entry["config"],
        source=source,
        name=short_name,
        hf_id=entry["hf_id"],
        num_params=int(entry["num_params"]),
        params_source=entry["params_source"],
    )
    weight_dtype = entry.get("weight_dtype", spec.weight_dtype)
    checkpoint = entry.get("checkpoint_bytes")
    return replace(spec, weight_dtype=weight_dtype, checkpoint_bytes=int(checkpoint) if checkpoint else None)


def model_names() -> list[str]:
    """Every catalogue short name, in catalogue order."""
    return list(_entries())


def catalogue_models() -> list[ModelSpec]:
    """Every catalogue model, in catalogue order."""
    return [_build(name) for name in _entries()]


def catalogue_entry(name: str) -> dict:
    """The raw YAML entry (sources included) of a catalogue model, by short name or HF id."""
    return _entries()[_lookup(name)]


@functools.lru_cache(maxsize=1)
def _by_repository_id() -> dict[str, str]:
    """Short name by lower-case repository id: each entry's hf_id and its aliases (instruct / chat variants)."""
    ids: dict[str, str] = {}
    for short, entry in _entries().items():
        for repo in [entry["hf_id"], *entry.get("aliases", [])]:
            assert repo.lower() not in ids, f"repository id {repo} names two catalogue entries"
            ids[repo.lower()] = short
    return ids


def _lookup(name: str) -> str:
    """Short name for `name` (short name, HF id or alias, any case); KvsimError with close matches if unknown."""
    key = name.strip().lower()
    entries = _entries()
    if key in entries:
        return key
    by_hf = _by_repository_id()
    if key in by_hf:
        return by_hf[key]
    candidates = list(entries) + list(by_hf)
    close = difflib.get_close_matches(key, [c.lower() for c in candidates], n=4, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise KvsimError(
        f"unknown model {name!r}{hint} (`kvsim models` lists the catalogue; a path to any config.json works too)",
        field="--model",
    )


def resolve_model(name_or_path: str) -> ModelSpec:
    """A ModelSpec from a catalogue short name, a Hugging Face id, or a path to a config.json."""
    path = Path(name_or_path)
    if name_or_path.endswith(".json") or path.is_file():
        return load_hf_config(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_config(path / "config.json")
    return _build(_lookup(name_or_path))
