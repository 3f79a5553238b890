"""How a replay runs: the user's options (`ReplayOptions`, the CLI's flags) and what every allocator of one
replay shares (`ReplayContext`: the model, KV budget, time model)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.errors import KvsimError
from kvsim.clock.roofline import Roofline

TIMINGS = ("roofline", "measured", "kernels-db", "auto")  # auto: kernels-db where it applies, else roofline
# Default --read-every per device. On CUDA a read is a padded gather and an attention over every decoding
# request's whole context: 0.2-3.6 ms at batch 8-64 and 2k-16k tokens on an H200 (`kvsim bench kernels`,
# docs/gpu.md), so reading on every one of the main job's 276,908 decode steps did not finish in 223 s there.
# One decode step in CUDA_READ_EVERY reads: 2,769 reads for that job, each a real kernel time.
# On a CPU a read of every decoding request's whole context moves up to 1 GiB through host memory and attends
# over it (~150 ms on the main job's paged batches) while a step's write takes tens of µs: sampling one decode
# step in CPU_READ_EVERY (the first decode step and every 20,000th after it: 2-6 reads per allocator of
# workloads/poisson.yaml) keeps that job with tensors under 8 s (scripts/bench_main_job.py).
CUDA_READ_EVERY = 100
CPU_READ_EVERY = 20_000
# Measured timing on a CPU reads every CPU_MEASURED_READ_EVERY-th decode step; the steps between are timed
# with the last read's µs per context token (a read every step made 20 requests take minutes).
CPU_MEASURED_READ_EVERY = 100
# Host memory a replay may give each CPU cache pool before it refuses (--max-host-memory changes it). A worker
# holds its pool plus ~0.4-0.9 GB of torch, write and read buffers (a sampled read of a long padded batch is
# the largest), so a 1 GiB pool keeps every process under 2 GB resident (scripts/bench_main_job.py --all).
# Llama-3.1-8B's pool at 90% of an H100 is 1.78 GiB for its one materialised layer: the Mooncake workloads say
# so and replay with --no-tensors, or with --max-host-memory 2GiB where 2.4 GB of RAM is there to give.
CPU_POOL_CAP_BYTES = 1 << 30


@dataclass(frozen=True)
class ReplayOptions:
    """How to run a replay (the CLI's flags). `num_layers` layers are materialised when `tensors` is on.

    `read_every`: read + attend on every N-th decode step (per allocator); every step writes. None picks
    the device's default (CUDA_READ_EVERY, CPU_READ_EVERY, CPU_MEASURED_READ_EVERY); measured timing gives a
    step without a read the last read's time per context token.
    `max_host_bytes`: the largest CPU cache pool a replay allocates; a bigger one is refused before any runs.
    `tp`, `ep` (--tp, --ep): override the workload's `deployment`; None keeps it.
    """

    device: str = "auto"
    tensors: bool = True
    timing: str = "roofline"
    num_layers: int = 1
    integrity: bool = False
    read_every: int | None = None
    max_host_bytes: int = CPU_POOL_CAP_BYTES
    tp: int | None = None
    ep: int | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):  # a typo is caught even with --no-tensors
            raise KvsimError(f"unknown device {self.device!r} (choose cpu, cuda, cuda:N or auto)", field="--device")
        if self.timing not in TIMINGS:
            raise KvsimError(f"unknown timing {self.timing!r} (choose roofline, measured, kernels-db or auto)", field="--timing")
        if self.timing == "measured" and not self.tensors:
            raise KvsimError("measured timing needs the cache tensors (drop --no-tensors)", field="--timing")
        if self.integrity and not self.tensors:
            raise KvsimError("integrity checks need the cache tensors (drop --no-tensors)", field="--integrity")
        if self.num_layers < 1:
            raise KvsimError(f"must be >= 1, got {self.num_layers}", field="--layers")
        if self.read_every is not None and self.read_every < 1:
            raise KvsimError(f"must be >= 1, got {self.read_every}", field="--read-every")
        if self.max_host_bytes < 1:
            raise KvsimError(f"must be > 0, got {self.max_host_bytes}", field="--max-host-memory")
        for flag, value in (("--tp", self.tp), ("--ep", self.ep)):
            if value is not None and value < 1:
                raise KvsimError(f"must be >= 1, got {value}", field=flag)

    def ignored_without_tensors(self) -> list[str]:
        """The flags set here that `--no-tensors` makes meaningless (they shape only the cache tensors)."""
        if self.tensors:
            return []
        flags = [("--device", self.device != "auto"), ("--layers", self.num_layers != 1), ("--read-every", self.read_every is not None),
                 ("--max-host-memory", self.max_host_bytes != CPU_POOL_CAP_BYTES)]  # fmt: skip
        return [flag for flag, given in flags if given]


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
    clock: object | None = None  # kvsim.clock.kernels_db.KernelClock for --timing kernels-db; None: the roofline
    tp: int = 1  # tensor-parallel ranks: the pool, its budget and the cache spec are one rank's
    offload: object | None = None  # kvsim.workload.OffloadConfig: the CPU tier under each paged allocator
    gpu: object | None = None  # kvsim.models.hardware.GPUSpec (the CPU tier's host link)
    source: str = ""  # the workload file (errors about `offload` name it)

    def spec(self, block_size: int, config=None) -> KVCacheSpec:
        """One rank's cache spec; a mixed model's carries vLLM's KV cache groups for this budget (`pool`),
        sized with the scheduler's token budget and async scheduling setting (the tokens a window keeps in flight)
        and, for a hybrid model, the allocator `config`'s mamba_cache_mode (align with prefix caching: the state
        groups take the attention block size, raised to a multiple of the checkpoint alignment)."""
        from kvsim.size.sizing import kv_cache_spec
        from kvsim.size.vllm import VllmSettings
        from kvsim.size.vllm_pool import with_pool

        spec = kv_cache_spec(self.model, kv_dtype=self.kv_dtype, block_size=block_size, tp=self.tp)
        sc = self.scheduler_config
        align = config is not None and config.mamba_cache_mode == "align" and spec.state_bytes_per_sequence > 0
        settings = VllmSettings(max_num_batched_tokens=sc.max_num_batched_tokens, async_scheduling=sc.async_scheduling,
                                mamba_cache_mode="align" if align else "none",
                                mamba_checkpoint_alignment=(config.mamba_checkpoint_alignment or 0) if align else 0)
        return with_pool(self.model, spec, self.budget_bytes, self.max_model_len, settings, self.tp)


ProgressFn = Callable[[str, int, int], None]  # (allocator label, requests done, total requests)
