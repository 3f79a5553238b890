"""The Hugging Face Hub step of model resolution: a repository's config.json and safetensors index, never weights.

huggingface_hub is imported here, inside the function, and only when this step runs: `kvsim size -m qwen3-8b`
never loads it. It honours what the rest of the ecosystem does: HF_TOKEN (gated and private repositories),
HF_ENDPOINT (mirrors), HF_HUB_OFFLINE, and it downloads into the same cache kvsim reads first next time.
Every failure is one KvsimError line naming the repository.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.models.hf_cache import CONFIG, INDEX, Checkpoint
from kvsim.models.hf_config import QUANT_CONFIG

_TRUE = {"1", "on", "yes", "true"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set to a true value, as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def fetch_from_hub(repo_id: str) -> Checkpoint:
    """Download `repo_id`'s config.json (and model.safetensors.index.json when it has one) into the local cache;
    where config.json states no quantization_config, also hf_quant_config.json when the repository has one (a
    legacy ModelOpt checkpoint's, which vLLM reads for --kv-cache-dtype auto), beside it in the same snapshot."""
    import logging

    try:
        import huggingface_hub
        import huggingface_hub.file_download  # noqa: F401  (sets up its logger, which kvsim then quiets)
        from huggingface_hub import errors
    except ImportError:
        raise KvsimError(
            f"{repo_id!r} is neither a local path nor a catalogue model, and reaching the Hub needs the package "
            "huggingface_hub (pip install huggingface_hub)",
            field="--model",
        ) from None
    print(f"kvsim: reading {repo_id}'s {CONFIG} from the Hugging Face Hub", file=sys.stderr)
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry warnings would bury the one line kvsim prints on failure
    try:
        config = _download(huggingface_hub, errors, repo_id, CONFIG)
        assert config is not None
        index = _download(huggingface_hub, errors, repo_id, INDEX, optional=True)
        if not _states_quantization(Path(config)):
            _download(huggingface_hub, errors, repo_id, QUANT_CONFIG, optional=True)
    finally:
        hub_log.setLevel(level)
    return Checkpoint(Path(config), Path(index) if index else None, repo_id, "Hugging Face Hub")


def _download(hub, errors, repo_id: str, filename: str, *, optional: bool = False) -> str | None:
    """One file of `repo_id` through hf_hub_download; None for a missing optional file; else one KvsimError line."""

    def fail(why: str) -> KvsimError:
        return KvsimError(f"{repo_id}: {why}", field="--model")

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        return hub.hf_hub_download(repo_id, filename)
    except getattr(errors, "GatedRepoError", ()):
        raise fail(f"gated repository on the Hugging Face Hub: accept its terms on {endpoint}/{repo_id}, then set "
                   "HF_TOKEN (or run `hf auth login`)") from None  # fmt: skip
    except getattr(errors, "RepositoryNotFoundError", ()):
        raise fail(f"no such repository on {endpoint} (a private one needs HF_TOKEN); `kvsim models` lists the "
                   "catalogue, and a path to a config.json works too") from None  # fmt: skip
    except getattr(errors, "RevisionNotFoundError", ()):
        raise fail(f"no revision 'main' on {endpoint}") from None
    except getattr(errors, "LocalEntryNotFoundError", ()):
        raise fail(f"cannot reach {endpoint} and {filename} is not in the local Hugging Face cache: connect, or "
                   "pass a local path to its config.json (HF_HUB_OFFLINE=1 skips the Hub)") from None  # fmt: skip
    except getattr(errors, "EntryNotFoundError", ()):
        if optional:
            return None
        raise fail(f"the repository has no {filename}, so it is not a model kvsim can read") from None
    except getattr(errors, "HfHubHTTPError", ()) as exc:
        raise fail(f"the Hugging Face Hub answered: {_first_line(exc)}") from None
    except (OSError, ValueError) as exc:
        raise fail(f"cannot reach the Hugging Face Hub ({_first_line(exc)}); set HF_HUB_OFFLINE=1 to stay offline, "
                   "or pass a local path to its config.json") from None  # fmt: skip


def _states_quantization(config: Path) -> bool:
    """Whether a downloaded config.json has a quantization_config (one that cannot be read asks for nothing more:
    reading it again reports the fault)."""
    import json

    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return True
    return not isinstance(data, dict) or data.get("quantization_config") is not None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
