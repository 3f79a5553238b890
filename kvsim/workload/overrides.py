"""Command-line settings over a workload file's fields, under kvsim's names and `vllm serve`'s.

`kvsim replay workloads/poisson.yaml --gpu h200 --max-num-seqs 128 --enable-prefix-caching` replays the file as if
it said so: the flags edit the parsed YAML before it is validated, so every check applies, and an error about an
edited field names the flag, not the file.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

from kvsim.errors import KvsimError


@dataclass(frozen=True)
class WorkloadOverrides:
    """The settings a command line gives (None: the file's). `block_size` and `prefix_caching` apply to every
    paged allocator; `gpu_memory_utilization` replaces the file's `kv_budget`; `async_scheduling` False keeps the
    synchronous loop (a workload's default is async, as vllm serve's)."""

    model: str | None = None
    hardware: str | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    kv_dtype: str | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    prefix_caching: bool | None = None
    async_scheduling: bool | None = None

    # field -> (the flag that sets it, where it lands in the file)
    FLAGS = {
        "model": ("--model", "model"),
        "hardware": ("--gpu", "hardware"),
        "gpu_memory_utilization": ("--gpu-memory-utilization", "gpu_memory_utilization"),
        "max_model_len": ("--max-model-len", "max_model_len"),
        "kv_dtype": ("--kv-cache-dtype", "kv_dtype"),
        "block_size": ("--block-size", "block_size"),
        "max_num_seqs": ("--max-num-seqs", "scheduler.max_num_seqs"),
        "max_num_batched_tokens": ("--max-num-batched-tokens", "scheduler.max_num_batched_tokens"),
        "prefix_caching": ("--enable-prefix-caching", "prefix_caching"),
        "async_scheduling": ("--async-scheduling", "scheduler.async_scheduling"),
    }

    def given(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def apply(self, raw: object) -> object:
        """The parsed YAML with these settings in it (a copy); anything but a mapping is left for the loader
        to refuse."""
        given = self.given()
        if not given or not isinstance(raw, dict):
            return raw
        raw = copy.deepcopy(raw)
        if str(given.get("model", "")).endswith(".json"):  # a config.json path on the command line: from here
            given["model"] = str(Path(given["model"]).resolve())
        for name in ("model", "hardware", "max_model_len", "kv_dtype"):
            if name in given:
                raw.pop({"hardware": "gpu"}.get(name, ""), None)  # the file's alias gives way too
                raw[name] = given[name]
        if "gpu_memory_utilization" in given:
            raw.pop("kv_budget", None)
            raw.pop("utilization", None)
            raw["gpu_memory_utilization"] = given["gpu_memory_utilization"]
        for name in ("max_num_seqs", "max_num_batched_tokens", "async_scheduling"):
            if name in given:
                scheduler = raw.get("scheduler")
                raw["scheduler"] = {**(scheduler if isinstance(scheduler, dict) else {}), name: given[name]}
        allocators = raw.get("allocators")
        if isinstance(allocators, list) and ("block_size" in given or "prefix_caching" in given):
            edited = []
            for a in allocators:
                if isinstance(a, dict) and a.get("kind") == "paged":
                    a = {**a, **{k: given[k] for k in ("block_size", "prefix_caching") if k in given}}
                if a not in edited:  # paged-16 and paged-16+prefix are one allocator under --enable-prefix-caching
                    edited.append(a)
            raw["allocators"] = edited
        return raw

    def flag_for(self, field: str | None) -> str | None:
        """The flag that set `field` (an error's field path), if one did."""
        if field is None:
            return None
        for name in self.given():
            flag, where = self.FLAGS[name]
            if field == where or (where in ("block_size", "prefix_caching") and field.startswith("allocators[")
                                  and field.endswith(f".{where}")):
                return flag
        return None


@contextmanager
def naming_flags(overrides: WorkloadOverrides):
    """Re-raise a KvsimError about a field a flag set (the file's `hardware` when --gpu gave it) as one naming
    the flag: the file does not say what the error is about."""
    try:
        yield
    except KvsimError as exc:
        flag = overrides.flag_for(exc.field)
        if flag is None:
            raise
        prefix = ": ".join(p for p in (exc.source, exc.field) if p) + ": "
        message = str(exc)
        raise KvsimError(message[len(prefix):] if message.startswith(prefix) else message, field=flag) from None


def load_workload_with(path: str | Path, overrides: WorkloadOverrides, **kwargs):
    """`load_workload(path, **kwargs)` with `overrides` applied; an error about a field a flag set names the flag."""
    from kvsim.workload.spec import load_workload

    with naming_flags(overrides):
        return load_workload(path, edit=overrides.apply, **kwargs)
