"""How a replay runs: the user's options (`ReplayOptions`, the CLI's flags) and what every allocator of one
replay shares (`ReplayContext`: the model, KV budget, time model)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from kvsim.engine.kv_cache_spec import KVCacheSpec
from kvsim.errors import KvsimError
from kvsim.roofline import Roofline

TIMINGS = ("roofline", "measured")
# Default --read-every per device. On CUDA a read is cheap: every step. On a CPU a read of every decoding
# request's whole context moves 100+ MiB through host memory (tens of ms) while a step's write takes tens
# of µs: sampling one decode step in CPU_READ_EVERY keeps workloads/poisson.yaml with tensors near 20 s.
CUDA_READ_EVERY = 1
CPU_READ_EVERY = 4000


@dataclass(frozen=True)
class ReplayOptions:
    """How to run a replay (the CLI's flags). `num_layers` layers are materialised when `tensors` is on.

    `read_every`: read + attend on every N-th decode step (per allocator); every step writes. None picks
    the device's default (CUDA_READ_EVERY, CPU_READ_EVERY); measured timing needs every step (1).
    """

    device: str = "auto"
    tensors: bool = True
    timing: str = "roofline"
    num_layers: int = 1
    integrity: bool = False
    read_every: int | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):  # a typo is caught even with --no-tensors
            raise KvsimError(f"unknown device {self.device!r} (choose cpu, cuda, cuda:N or auto)", field="--device")
        if self.timing not in TIMINGS:
            raise KvsimError(f"unknown timing {self.timing!r} (choose roofline or measured)", field="--timing")
        if self.timing == "measured" and not self.tensors:
            raise KvsimError("measured timing needs the cache tensors (drop --no-tensors)", field="--timing")
        if self.integrity and not self.tensors:
            raise KvsimError("integrity checks need the cache tensors (drop --no-tensors)", field="--integrity")
        if self.num_layers < 1:
            raise KvsimError(f"must be >= 1, got {self.num_layers}", field="--layers")
        if self.read_every is not None and self.read_every < 1:
            raise KvsimError(f"must be >= 1, got {self.read_every}", field="--read-every")
        if self.timing == "measured" and self.read_every not in (None, 1):
            raise KvsimError("measured timing times every step's read (use --read-every 1)", field="--read-every")


@dataclass(frozen=True)
class ReplayContext:
    """What every allocator of a replay shares: the model's cache spec factory, budget, time model."""

    model: object  # kvsim.models.ModelSpec
    kv_dtype: str
    budget_bytes: int
    max_model_len: int
    roofline: Roofline
    scheduler_config: object  # kvsim.workload.SchedulerConfig
    seed: int

    def spec(self, block_size: int) -> KVCacheSpec:
        """The model's cache spec; a mixed model's carries vLLM's KV cache groups for this budget (`pool`),
        sized with the scheduler's token budget and async scheduling setting (the tokens a window keeps in flight)."""
        from kvsim.sizing import kv_cache_spec
        from kvsim.vllm_sizing import VllmSettings, with_pool

        spec = kv_cache_spec(self.model, kv_dtype=self.kv_dtype, block_size=block_size)
        sc = self.scheduler_config
        settings = VllmSettings(max_num_batched_tokens=sc.max_num_batched_tokens, async_scheduling=getattr(sc, "async_scheduling", False))
        return with_pool(self.model, spec, self.budget_bytes, self.max_model_len, settings)


ProgressFn = Callable[[str, int, int], None]  # (allocator label, requests done, total requests)
