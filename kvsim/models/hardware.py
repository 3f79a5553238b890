"""The GPU catalogue (kvsim/models/data/hardware.yaml): nominal memory and the memory CUDA reports, bandwidth and
bf16 FLOP/s, each sourced."""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from importlib import resources

from kvsim.errors import KvsimError
from kvsim.models.yaml_entries import entries_fields, entry_texts, parse_entry
from kvsim.units import parse_bytes

HARDWARE_FILE = "kvsim/models/data/hardware.yaml"


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: `memory_bytes` of device memory (the datasheet's), HBM bandwidth (bytes/s), dense bf16
    FLOP/s, and `cuda_memory_bytes`, what the device reports to CUDA (torch's total_memory, vLLM's
    `total_gpu_memory`): the figure vLLM's gpu_memory_utilization multiplies."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    bf16_flops_per_s: float
    source: str
    key: str = ""  # catalogue short name, e.g. "h100-80gb"
    cuda_memory_bytes: int = 0  # 0: unknown, taken as memory_bytes
    cuda_memory_estimated: bool = True  # derived from nvidia-smi's total rather than read in a vLLM log
    cuda_memory_source: str = ""
    unified_memory: bool = False  # CPU and GPU share it (DGX Spark): what is free at start-up varies

    @property
    def reported_memory_bytes(self) -> int:
        """The memory CUDA reports (what vLLM sizes against); the nominal figure where unknown."""
        return self.cuda_memory_bytes or self.memory_bytes


@functools.lru_cache(maxsize=1)
def _texts() -> dict[str, str]:
    """Each GPU's YAML text by key, in file order: an entry is parsed when asked for (the whole table took
    ~10 ms, and `kvsim size` needs one)."""
    text = resources.files("kvsim.models").joinpath("data/hardware.yaml").read_text()
    return entry_texts(text, HARDWARE_FILE)


@functools.lru_cache(maxsize=None)
def _gpu(key: str) -> GPUSpec:
    entry = parse_entry(key, _texts()[key], HARDWARE_FILE)
    source = f"{HARDWARE_FILE} [{key}]"
    return GPUSpec(
        name=entry["name"],
        memory_bytes=parse_bytes(entry["memory"], field="memory", source=source),
        hbm_bandwidth_bytes_per_s=float(entry["hbm_bandwidth_bytes_per_s"]),
        bf16_flops_per_s=float(entry["bf16_flops_per_s"]),
        source=entry["source"],
        key=key,
        cuda_memory_bytes=parse_bytes(entry["cuda_memory"], field="cuda_memory", source=source),
        cuda_memory_estimated=bool(entry.get("cuda_memory_estimated", True)),
        cuda_memory_source=entry.get("cuda_memory_source", ""),
        unified_memory=bool(entry.get("unified_memory", False)),
    )


@functools.lru_cache(maxsize=1)
def _aliases() -> dict[str, str]:
    """GPU key by key and by alias (lower case), from each entry's `aliases:` line."""
    table = {}
    for key, fields in entries_fields(_texts(), "aliases", file=HARDWARE_FILE).items():
        table[key] = key
        for alias in fields.get("aliases", []):
            table[str(alias).lower()] = key
    return table


@functools.lru_cache(maxsize=None)
def gpu_key_by_name(name: str) -> str | None:
    """The catalogue key of the GPU whose `name` (GPUSpec.name, e.g. "NVIDIA H100 80GB SXM") is `name`, or None."""
    for key, fields in entries_fields(_texts(), "name", file=HARDWARE_FILE).items():
        if fields.get("name") == name:
            return key
    return None


def gpu_names() -> list[str]:
    """Every catalogue GPU key, in catalogue order."""
    return list(_texts())


def get_gpu(name: str) -> GPUSpec:
    """The GPU called `name` (`h100-80gb`, `H200`, `a100-40gb`...; case-insensitive, '_' or ' ' as '-')."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    aliases = _aliases()
    variants = [k for k in gpu_names() if k.startswith(key + "-")]
    if key not in aliases and len(variants) > 1:  # `a100`: the 40 GB or the 80 GB card?
        raise KvsimError(f"ambiguous GPU {name!r}: say which of {', '.join(variants)}", field="--gpu")
    if key in aliases:
        return _gpu(aliases[key])
    close = difflib.get_close_matches(key, list(aliases), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise KvsimError(f"unknown GPU {name!r}{hint} (known: {', '.join(gpu_names())})", field="--gpu")
