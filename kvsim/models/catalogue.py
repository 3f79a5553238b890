"""The model catalogue shipped as package data (kvsim/models/data/models.yaml), and the order a model name resolves in.

`resolve_model` accepts a path (a config.json, or a checkpoint folder holding one), a Hugging Face id
(`Qwen/Qwen3-14B-AWQ`), or a catalogue short name (`qwen3-0.6b`) in any case. A Hugging Face id is looked up, in
order, in the local Hugging Face cache, the catalogue, then on the Hub: a model on this machine is read as it is
there, a catalogue model never needs the network, and only an id neither knows reaches the Hub (unless
HF_HUB_OFFLINE). Catalogue entries go through the same config reader as files do.
"""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import replace
from importlib import resources
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.models.hf_config import model_spec_from_config
from kvsim.models.spec import ModelSpec
from kvsim.models.yaml_entries import entries_fields, entry_texts, parse_entry

CATALOGUE_FILE = "kvsim/models/data/models.yaml"


@functools.lru_cache(maxsize=1)
def _texts() -> dict[str, str]:
    """Each catalogue entry's YAML text by short name (lower case), in catalogue order. An entry is parsed when
    it is asked for: the whole file (150+ entries, most with a whole config.json) takes ~0.1 s to parse, and
    `kvsim size` needs one."""
    text = resources.files("kvsim.models").joinpath("data/models.yaml").read_text()
    texts = {}
    for name, entry in entry_texts(text, CATALOGUE_FILE).items():
        assert name.lower() not in texts, f"catalogue entry {name} twice"
        texts[name.lower()] = entry
    return texts


@functools.lru_cache(maxsize=None)
def _entry(short_name: str) -> dict:
    """One raw catalogue entry (its YAML parsed alone)."""
    return parse_entry(short_name, _texts()[short_name], CATALOGUE_FILE)


@functools.lru_cache(maxsize=None)
def _build(short_name: str) -> ModelSpec:
    entry = _entry(short_name)
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
    return list(_texts())


def catalogue_models() -> list[ModelSpec]:
    """Every catalogue model, in catalogue order."""
    return [_build(name) for name in _texts()]


def catalogue_entry(name: str) -> dict:
    """The raw YAML entry (sources included) of a catalogue model, by short name or HF id."""
    return _entry(_lookup(name))


@functools.lru_cache(maxsize=1)
def _by_repository_id() -> dict[str, str]:
    """Short name by lower-case repository id: each entry's hf_id and its aliases (instruct / chat variants)."""
    ids: dict[str, str] = {}
    for short, fields in entries_fields(_texts(), "hf_id", "aliases", file=CATALOGUE_FILE).items():  # those lines, not whole entries
        for repo in [fields["hf_id"], *fields.get("aliases", [])]:
            assert repo.lower() not in ids, f"repository id {repo} names two catalogue entries"
            ids[repo.lower()] = short
    return ids


def _with_catalogue_params(spec: ModelSpec, key: str | None) -> ModelSpec:
    """A cached checkpoint the catalogue also knows (by id or alias: the same architecture) keeps its own config,
    and takes the catalogue's sourced parameter count where its config.json could not be counted."""
    if key is None or spec.num_params is not None:
        return spec
    known = _build(key)
    return replace(spec, num_params=known.num_params, params_source=f"{CATALOGUE_FILE} [{key}]: {known.params_source}")


# Names that are files, whether or not they exist: a config, or a weights file named by mistake (refused by name).
_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")

# A Hugging Face repository id: ORG/NAME of letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _catalogue_key(name: str) -> str | None:
    """Short name for `name` (short name, HF id or alias, any case), or None."""
    key = name.strip().lower()
    if key in _texts():
        return key
    return _by_repository_id().get(key)


def _close_matches(name: str) -> str:
    candidates = list(_texts()) + list(_by_repository_id())
    close = difflib.get_close_matches(name.strip().lower(), candidates, n=4, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _lookup(name: str) -> str:
    """Short name for `name` (short name, HF id or alias, any case); KvsimError with close matches if unknown."""
    key = _catalogue_key(name)
    if key is None:
        raise KvsimError(
            f"unknown model {name!r}{_close_matches(name)} (`kvsim models` lists the catalogue; a Hugging Face id "
            "ORG/NAME or a path to a config.json works too)",
            field="--model",
        )
    return key


def resolve_model(name_or_path: str) -> ModelSpec:
    """A ModelSpec from a path, a Hugging Face id or a catalogue short name, in this order:

    1. a local path: a config.json (any file name) or a folder holding one (its safetensors index, if any,
       gives `checkpoint_bytes`);
    2. ORG/NAME in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME; where vLLM users have their models);
    3. the catalogue (short names, ids and aliases): offline, sourced, with a parameter count;
    4. ORG/NAME on the Hugging Face Hub (config.json and model.safetensors.index.json only), unless HF_HUB_OFFLINE.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file() or path.suffix.lower() in _FILE_SUFFIXES or (path.is_dir() and (path / "config.json").is_file()):
        from kvsim.models.hf_cache import checkpoint_spec, local_checkpoint

        return checkpoint_spec(local_checkpoint(path))
    repo_id = name_or_path.strip().strip("/")
    key = _catalogue_key(name_or_path)
    if _REPO_ID.match(repo_id):  # the checkpoints' module loads for a path or an ORG/NAME id, not a short name
        from kvsim.models.hf_cache import checkpoint_spec, find_cached, hub_cache_dir

        cached = find_cached(repo_id)
        if cached is not None:
            return _with_catalogue_params(checkpoint_spec(cached), key)
    if key is not None:
        return _build(key)
    if not _REPO_ID.match(repo_id):
        if path.is_dir():
            raise KvsimError("a folder without a config.json", source=str(path), field="--model")
        _lookup(name_or_path)  # raises, naming close matches
    from kvsim.models.hf_cache import checkpoint_spec, hub_cache_dir
    from kvsim.models.hub import fetch_from_hub, hub_offline  # the Hub's step, reached by an id nothing else knows

    if hub_offline():
        raise KvsimError(
            f"unknown model {repo_id!r}: not a local path, not in the Hugging Face cache ({hub_cache_dir()}), "
            "not in kvsim's catalogue, and HF_HUB_OFFLINE=1 keeps kvsim off the Hub. Unset HF_HUB_OFFLINE, or fetch "
            f"its config once (`hf download {repo_id} config.json model.safetensors.index.json`), or pass a path to "
            f"its config.json; `kvsim models` lists the catalogue{_close_matches(repo_id)}",
            field="--model",
        )
    return checkpoint_spec(fetch_from_hub(repo_id))
