"""Checkpoints on this machine: a folder holding config.json, or a repository in the local Hugging Face cache.

The cache is read the way huggingface_hub lays it out, without importing it (`kvsim size` starts fast):
`$HF_HUB_CACHE` (else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), then `models--ORG--NAME/refs/main` names
the snapshot `models--ORG--NAME/snapshots/<commit>/` whose config.json is read. A checkpoint's
`model.safetensors.index.json` beside its config gives its shipped size (`metadata.total_size`), never its weights;
a legacy ModelOpt `hf_quant_config.json` beside it is read with the config (kvsim.models.hf_config.load_hf_config).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.models.hf_config import load_hf_config
from kvsim.models.spec import ModelSpec

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's config.json, its safetensors index when it has one, and where it was found."""

    config: Path
    index: Path | None
    repo_id: str | None = None  # ORG/NAME when it came from the cache or the Hub
    where: str = "local path"  # 'local path', 'local Hugging Face cache', 'Hugging Face Hub'


def hub_cache_dir() -> Path:
    """The Hugging Face cache folder huggingface_hub would use (HF_HUB_CACHE, HF_HOME/hub, the XDG default)."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def local_checkpoint(path: Path) -> Checkpoint:
    """A folder holding config.json (and maybe its index), or a config file itself."""
    if path.is_dir():
        index = path / INDEX
        return Checkpoint(path / CONFIG, index if index.is_file() else None)
    return Checkpoint(path, None)


def find_cached(repo_id: str) -> Checkpoint | None:
    """`repo_id`'s config.json in the local Hugging Face cache (the snapshot refs/main names, else the newest
    snapshot holding one); None when the cache has no config for it. Repository ids match in any case."""
    cache = hub_cache_dir()
    folder = "models--" + repo_id.replace("/", "--")
    repo = cache / folder
    if not repo.is_dir():
        try:
            repo = next(p for p in cache.iterdir() if p.name.lower() == folder.lower() and p.is_dir())
        except (OSError, StopIteration):
            return None
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    candidates = []
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    try:
        candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        pass
    for snapshot in candidates:
        if (snapshot / CONFIG).is_file():
            index = snapshot / INDEX
            owner_name = repo.name.removeprefix("models--").replace("--", "/", 1)
            index_file = index if index.is_file() else None
            return Checkpoint(snapshot / CONFIG, index_file, owner_name, "local Hugging Face cache")
    return None


def checkpoint_bytes(index: Path) -> int | None:
    """The shipped weight bytes a safetensors index states (metadata.total_size); None when it states none."""
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvsimError(f"cannot read the safetensors index: {exc}", source=str(index)) from None
    metadata = data.get("metadata") if isinstance(data, dict) else None
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if total is None:
        return None
    if isinstance(total, bool) or not isinstance(total, (int, float)) or total <= 0:
        raise KvsimError(
            f"expected a positive byte count, got {total!r}", source=str(index), field="metadata.total_size"
        )
    return int(total)


def checkpoint_spec(checkpoint: Checkpoint) -> ModelSpec:
    """The ModelSpec of a checkpoint: its config.json read as any config file, named by its repository id when it
    has one, with the index's total size as `checkpoint_bytes`."""
    name = checkpoint.repo_id.split("/")[-1] if checkpoint.repo_id else None
    spec = load_hf_config(checkpoint.config, name=name)
    size = checkpoint_bytes(checkpoint.index) if checkpoint.index else None
    return replace(spec, hf_id=checkpoint.repo_id or spec.hf_id, checkpoint_bytes=size or spec.checkpoint_bytes)
