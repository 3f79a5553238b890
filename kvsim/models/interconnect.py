"""The GPU-to-GPU link of each catalogue GPU (kvsim/models/data/interconnect.yaml): one direction's bandwidth,
sourced, for the roofline's tensor-parallel all-reduce."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

from kvsim.errors import KvsimError

INTERCONNECT_FILE = "kvsim/models/data/interconnect.yaml"


@dataclass(frozen=True)
class Interconnect:
    """A GPU's link to its peers: `bandwidth_bytes_per_s` in one direction (NCCL's bus bandwidth peak)."""

    link: str
    bandwidth_bytes_per_s: float
    source: str
    host_link: str | None = None  # the GPU's link to host memory (a CPU KV tier's loads and stores), if known
    host_bandwidth_bytes_per_s: float | None = None  # one direction
    host_source: str | None = None


@functools.lru_cache(maxsize=1)
def interconnects() -> dict[str, Interconnect]:
    """Every entry of the file, by GPU key (hardware.yaml's keys)."""
    from kvsim.models.yaml_entries import load_yaml

    text = resources.files("kvsim.models").joinpath("data/interconnect.yaml").read_text()
    raw = load_yaml(text, INTERCONNECT_FILE)
    table = {}
    for key, entry in raw.items():
        bandwidth = float(entry["bandwidth_bytes_per_s"])
        assert bandwidth > 0, (INTERCONNECT_FILE, key)
        host = entry.get("host_bandwidth_bytes_per_s")
        table[key] = Interconnect(entry["link"], bandwidth, entry["source"], entry.get("host_link"),
                                  None if host is None else float(host), entry.get("host_source"))
    return table


def get_interconnect(gpu) -> Interconnect:
    """The link of a catalogue `GPUSpec`, or a KvsimError naming the GPU (tensor parallelism needs one)."""
    found = interconnects().get(gpu.key)
    if found is None:
        raise KvsimError(f"{gpu.name}: no GPU-to-GPU link bandwidth in {INTERCONNECT_FILE}, which the roofline's "
                         "all-reduce at tp > 1 needs", field="hardware")
    return found


def peer_nvlink(device_name: str) -> bool:
    """Whether the catalogue GPU called `device_name` (GPUSpec.name) reaches its tensor-parallel peers over NVLink
    (or another GPU fabric) rather than PCIe alone; True for a device this file does not list."""
    from kvsim.models.hardware import gpu_key_by_name

    found = interconnects().get(gpu_key_by_name(device_name) or "")
    return found is None or not found.link.startswith("PCIe")


def get_host_link(gpu) -> tuple[float, str]:
    """The host link of a catalogue `GPUSpec` (one direction's bytes/s, its source), or a KvsimError naming the
    GPU (a CPU KV tier's transfers need one)."""
    found = interconnects().get(gpu.key)
    if found is None or found.host_bandwidth_bytes_per_s is None:
        raise KvsimError(f"{gpu.name}: no host link bandwidth in {INTERCONNECT_FILE}, which the CPU tier's "
                         "transfers need", field="offload")
    return found.host_bandwidth_bytes_per_s, found.host_source
