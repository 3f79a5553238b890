"""A replay workload: the YAML file read and validated once, into frozen dataclasses.

Every error names the file and the field path (`workloads/x.yaml: requests.arrival.rate: must be > 0`);
unknown keys are errors too, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Literal

from kvsim.workload.distributions import MAX_ARRIVAL_S, arrival_from_fields, length_from_fields
from kvsim.engine.factory import AllocatorConfig
from kvsim.errors import KvsimError
from kvsim.workload.requests import SharedPrefix, SyntheticRequests, TraceRequests
from kvsim.units import dtype_bytes
from kvsim.workload.yaml_fields import Fields
from kvsim.workload.yaml_file import parse_yaml

# The most requests one workload may generate: a stream is held in memory (a few hundred bytes per request),
# so this caps it near a few GiB; the Azure conversation trace has 19,366.
MAX_REQUESTS = 10_000_000
# The largest kv_budget: the replay's step records hold bytes in doubles, exact up to 2**53 B (8 PiB); past it a
# budget's % columns stop adding up (1e20 B gave free = -9.2%).
MAX_KV_BUDGET_BYTES = 2**53
MAX_PARALLEL_SAMPLES = 1024  # samples per prompt (vLLM has no bound of its own; this keeps a typo from exploding a stream)

__all__ = ["Deployment", "OffloadConfig", "ROUTER_POLICIES", "Router", "SchedulerConfig", "SharedPrefix", "SyntheticRequests", "TraceRequests", "Workload", "load_workload"]


@dataclass(frozen=True)
class SchedulerConfig:
    """The continuous-batching scheduler's limits (vLLM's SchedulerConfig names).

    `watermark` is the fraction of KV blocks kept free when admitting a waiting request while others run
    (vLLM's default 0); a paged allocator inherits it unless it sets its own. `scheduler_reserve_full_isl`:
    admit a waiting request only if blocks for all its tokens are free (vLLM's default True).
    `async_scheduling`: schedule step n + 1 before step n's output is processed (vLLM's AsyncScheduler, on in
    `vllm serve` 0.33 and so kvsim's default; `false` keeps the synchronous loop).
    `swap_space_bytes` is the CPU pool that `preemption: swap` (beyond vLLM v1) moves KV to.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    preemption: Literal["recompute", "swap"] = "recompute"
    watermark: float = 0.0
    swap_space_bytes: int = 4 * 2**30
    scheduler_reserve_full_isl: bool = True
    async_scheduling: bool = True


@dataclass(frozen=True)
class Deployment:
    """How the engine sits on GPUs (vLLM's ParallelConfig): `tp` tensor-parallel ranks (the KV pool and
    budget are one rank's), a MoE's experts over `ep` of them (1: split by tensor parallelism, vLLM's
    default; `tp`: `--enable-expert-parallel` with one data-parallel rank)."""

    tp: int = 1
    ep: int = 1
    replicas: int = 1  # engines of tp GPUs each behind the workload's `router` (kvsim.deployment)


ROUTER_POLICIES = ("random", "round-robin", "least-loaded", "prefix-approx", "prefix-precise")
ROUTER_LOADS = ("requests", "kv_usage")
ROUTER_SCORERS = ("dynamo", "llm-d")


@dataclass(frozen=True)
class Router:
    """How a fleet's router picks a replica for each arrival (docs/deployment.md).

    `policy`: `random` (seeded by `seed`: a plain Kubernetes service), `round-robin`, `least-loaded` (by `load`:
    waiting + running requests, or KV usage), `prefix-approx` (the router's own LRU of block hashes per replica,
    `approx_blocks` of them; default each replica's num_gpu_blocks) and `prefix-precise` (the replicas' true
    cache contents). Prefix policies weigh overlap against load by `scorer`: `dynamo` (KvRouter's cost
    `overlap_score_weight` x new prefill blocks + active blocks, lowest wins) or `llm-d` (the weighted sum of the
    prefix-cache, kv-cache-utilization and queue scorers, highest wins; `prefix_weight`, `kv_usage_weight`,
    `queue_weight`).
    """

    policy: str = "round-robin"
    seed: int = 0
    load: str = "requests"
    scorer: str = "dynamo"
    overlap_score_weight: float = 1.0
    prefix_weight: float = 2.0
    kv_usage_weight: float = 1.0
    queue_weight: float = 1.0
    approx_blocks: int | None = None


@dataclass(frozen=True)
class OffloadConfig:
    """The CPU KV tier (vLLM's `--kv-offloading-size` and `kv_connector_extra_config`): `cpu_bytes` of host memory
    for the whole engine, the manager's eviction `policy` (lru or arc), the connector's `block_size` (tokens per
    CPU chunk, a multiple of the GPU block; None: one GPU block), and `store_threshold` (>= 2: store a chunk only
    once it was offered that many times, over `max_tracker_size` tracked keys). `sync_load_budget_bytes` (> 0):
    a CPU hit whose bytes fit the step's budget loads within the step, the request computing in it, rather than
    waiting for an asynchronous load."""

    cpu_bytes: int
    policy: str = "lru"
    block_size: int | None = None
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    sync_load_budget_bytes: int = 0


@dataclass(frozen=True)
class Workload:
    """One replay: a model and KV budget, a request stream, and the allocators that compete for it.

    Exactly one of `kv_budget_bytes` and `gpu_memory_utilization` is set (the replay subtracts the weights
    from the GPU's memory for the latter). `model` and `hardware` are names resolved by the replay, which
    reports an unknown one; a config.json path in `model` is made absolute here (relative to the YAML file).
    """

    name: str
    seed: int
    model: str
    kv_dtype: str
    hardware: str
    kv_budget_bytes: int | None
    gpu_memory_utilization: float | None
    max_model_len: int
    requests: SyntheticRequests | TraceRequests
    allocators: tuple[AllocatorConfig, ...]
    scheduler: SchedulerConfig
    path: Path
    sha256: str  # of the YAML file's bytes
    description: str = ""
    deployment: Deployment = Deployment()
    router: Router = Router()
    offload: OffloadConfig | None = None  # the CPU KV tier under every (paged) allocator; None: no tier

    def __post_init__(self) -> None:
        assert (self.kv_budget_bytes is None) != (self.gpu_memory_utilization is None)
        # unique labels, once vllm serve's defaults are known (prefix_caching None: not yet)
        assert self.allocators and len({(a.label, a.prefix_caching is None) for a in self.allocators}) == len(self.allocators)


WORKLOAD_FIELDS = ("name", "description", "seed", "model", "kv_dtype", "hardware", "kv_budget", "gpu_memory_utilization",
                   "max_model_len", "requests", "allocators", "scheduler", "deployment", "router", "offload")  # fmt: skip


def load_workload(path: str | Path, *, trace: str | None = None, seed: int | None = None, limit: int | None = None,
                  edit: Callable[[object], object] | None = None) -> Workload:
    """Read and validate a workload YAML. `trace` (a path, relative to the working directory) replaces the
    file's request source with that trace; `seed` and `limit` override the file's seed and request limit;
    `edit` changes the parsed YAML before it is validated (command-line settings, kvsim.workload.overrides)."""
    path = Path(path)
    source = str(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KvsimError(f"cannot read workload: {exc.strerror or exc}", source=source) from None
    raw = parse_yaml(data, source=source)
    if edit is not None:
        raw = edit(raw)
    return workload_from_mapping(raw, path, sha256=hashlib.sha256(data).hexdigest(), trace=trace, seed=seed, limit=limit)


def workload_from_mapping(raw, path: str | Path, *, sha256: str, trace: str | None = None, seed: int | None = None,
                          limit: int | None = None) -> Workload:
    """Validate an already parsed workload mapping as if read from `path` (errors name it; relative paths in
    it are relative to its folder); `load_workload` for a file, a sweep for each of its points."""
    path = Path(path)
    source = str(path)
    if raw is None:
        raise KvsimError("the workload file is empty (see workloads/poisson.yaml for every field)", source=source)
    raw = _aliases(raw, source)
    f = Fields(raw, source=source)
    f.only(WORKLOAD_FIELDS)
    base_dir = path.parent

    name = f.str("name", path.stem)
    if "/" in name or "\\" in name or name in (".", ".."):
        raise f.error("name", f"must be a plain folder name (no slashes), got {name!r}")
    file_seed = f.int("seed", 0, min=0)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise KvsimError(f"must be a whole number >= 0, got {seed!r}", field="--seed")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise KvsimError(f"must be a whole number >= 1, got {limit!r}", field="--limit")
    model = f.str("model")
    if model.endswith(".json") or (base_dir / model).exists():  # a path (config, checkpoint), relative to the YAML
        model = str((base_dir / model).resolve())
    kv_dtype = f.str("kv_dtype", "auto").lower()  # vllm serve's default: resolved with the model (kv_cache_dtype)
    if kv_dtype != "auto":
        dtype_bytes(kv_dtype, field="kv_dtype", source=source, kv=True)
    hardware = f.str("hardware")
    if f.has("kv_budget") == f.has("gpu_memory_utilization"):
        raise f.error("kv_budget", "give exactly one of kv_budget (e.g. 4GiB) and gpu_memory_utilization (e.g. 0.9)")
    kv_budget = f.bytes("kv_budget", None)
    if kv_budget is not None and kv_budget > MAX_KV_BUDGET_BYTES:
        raise f.error("kv_budget", f"{kv_budget:.3g} B is more than the replay can count exactly (8 PiB, 2**53 B)")
    utilization = f.float("gpu_memory_utilization", None, min=0, max=1)
    if utilization == 0:
        raise f.error("gpu_memory_utilization", "must be > 0")
    max_model_len = f.int("max_model_len", min=1)
    scheduler = _scheduler(f.sub("scheduler", None))
    requests = _requests(f.sub("requests"), base_dir, max_model_len, trace)
    allocators = _allocators(f, scheduler)
    workload = Workload(
        name=name,
        seed=file_seed if seed is None else seed,
        model=model,
        kv_dtype=kv_dtype,
        hardware=hardware,
        kv_budget_bytes=kv_budget,
        gpu_memory_utilization=utilization,
        max_model_len=max_model_len,
        requests=requests,
        allocators=allocators,
        scheduler=scheduler,
        path=path,
        sha256=sha256,
        description=f.str("description", ""),
        deployment=_deployment(f.sub("deployment", None)),
        router=_router(f.sub("router", None)),
        offload=_offload(f.sub("offload", None), allocators, source),
    )
    f.done()
    if trace is not None and not isinstance(requests, TraceRequests):  # --trace replaces synthetic requests
        workload = replace(workload, requests=TraceRequests(_trace_file(Path(trace), source=None, field="--trace")))
    if limit is not None:
        old = workload.requests.limit
        workload = replace(workload, requests=replace(workload.requests, limit=limit if old is None else min(old, limit)))
    return workload


# The command line's names, accepted in the file too: `gpu: h100-80gb` is `hardware: h100-80gb`.
FIELD_ALIASES = {"gpu": "hardware", "utilization": "gpu_memory_utilization"}


def _aliases(raw, source: str):
    """`raw` with the command line's names (`gpu`, `utilization`) under the file's; both names at once is an error."""
    if not isinstance(raw, dict) or not any(alias in raw for alias in FIELD_ALIASES):
        return raw
    raw = dict(raw)
    for alias, name in FIELD_ALIASES.items():
        if alias in raw:
            if name in raw:
                raise KvsimError(f"give {name} or {alias} (the same setting), not both", source=source, field=alias)
            raw[name] = raw.pop(alias)
    return raw


def _scheduler(f: Fields | None) -> SchedulerConfig:
    if f is None:
        return SchedulerConfig()
    d = SchedulerConfig()
    config = SchedulerConfig(
        max_num_seqs=f.int("max_num_seqs", d.max_num_seqs, min=1),
        max_num_batched_tokens=f.int("max_num_batched_tokens", d.max_num_batched_tokens, min=1),
        preemption=f.choice("preemption", ("recompute", "swap"), d.preemption),
        watermark=f.float("watermark", d.watermark, min=0, max=1, exclusive=False),
        swap_space_bytes=f.bytes("swap_space", d.swap_space_bytes, allow_zero=True),
        scheduler_reserve_full_isl=f.bool("scheduler_reserve_full_isl", d.scheduler_reserve_full_isl),
        async_scheduling=f.bool("async_scheduling", d.async_scheduling),
    )
    if config.watermark >= 1:
        raise f.error("watermark", f"must be < 1 (a fraction of the blocks), got {config.watermark:g}")
    f.done()
    return config


def _offload(f: Fields | None, allocators: tuple[AllocatorConfig, ...], source: str) -> OffloadConfig | None:
    """`offload:`, refused where the tier cannot sit: under a flat allocator (vLLM's connector moves blocks)."""
    if f is None:
        return None
    config = OffloadConfig(
        cpu_bytes=f.bytes("cpu_bytes"),
        policy=f.choice("policy", ("lru", "arc"), "lru"),
        block_size=f.int("block_size", None, min=1),
        store_threshold=f.int("store_threshold", 0, min=0),
        max_tracker_size=f.int("max_tracker_size", 64_000, min=1),
        sync_load_budget_bytes=f.bytes("sync_load_budget_bytes", 0, allow_zero=True),
    )
    f.done()
    flat = [a.label for a in allocators if a.kind != "paged"]
    if flat:
        raise KvsimError(f"the CPU tier moves KV blocks and needs paged allocators; {', '.join(flat)} is flat",
                         source=source, field="offload")
    return config


def with_cpu_offload(workload: Workload, size: str) -> Workload:
    """`kvsim replay --cpu-offload SIZE`: the workload with a CPU tier of SIZE (its policy kept, else lru); 0: none."""
    from kvsim.units import parse_bytes

    cpu_bytes = parse_bytes(size, field="--cpu-offload", allow_zero=True)
    if cpu_bytes == 0:
        return replace(workload, offload=None)
    flat = [a.label for a in workload.allocators if a.kind != "paged"]
    if flat:
        raise KvsimError(f"the CPU tier moves KV blocks and needs paged allocators; {', '.join(flat)} is flat",
                         field="--cpu-offload")
    offload = workload.offload or OffloadConfig(cpu_bytes)
    return replace(workload, offload=replace(offload, cpu_bytes=cpu_bytes))


def _deployment(f: Fields | None) -> Deployment:
    """`deployment: {tp, ep, replicas}`; whether tp suits the model's heads is checked where the model is resolved."""
    if f is None:
        return Deployment()
    deployment = Deployment(tp=f.int("tp", 1, min=1), ep=f.int("ep", 1, min=1), replicas=f.int("replicas", 1, min=1, max=4096))
    if deployment.ep not in (1, deployment.tp):
        raise f.error("ep", f"must be 1 or tp ({deployment.tp}): vLLM's expert parallelism spans every tensor-parallel "
                            f"rank of the one data-parallel rank kvsim replays, got {deployment.ep}")
    f.done()
    return deployment


def _router(f: Fields | None) -> Router:
    """`router: {policy, seed, load, scorer, weights...}`: a name or weight nobody knows is an error."""
    if f is None:
        return Router()
    d = Router()
    router = Router(
        policy=f.choice("policy", ROUTER_POLICIES, d.policy),
        seed=f.int("seed", d.seed, min=0),
        load=f.choice("load", ROUTER_LOADS, d.load),
        scorer=f.choice("scorer", ROUTER_SCORERS, d.scorer),
        overlap_score_weight=f.float("overlap_score_weight", d.overlap_score_weight, min=0),
        prefix_weight=f.float("prefix_weight", d.prefix_weight, min=0),
        kv_usage_weight=f.float("kv_usage_weight", d.kv_usage_weight, min=0),
        queue_weight=f.float("queue_weight", d.queue_weight, min=0),
        approx_blocks=f.int("approx_blocks", None, min=1),
    )
    f.done()
    return router


def _requests(f: Fields, base_dir: Path, max_model_len: int, cli_trace: str | None) -> SyntheticRequests | TraceRequests:
    if "trace" in f.raw:
        return _trace_requests(f, base_dir, cli_trace)
    if f.has("count") == f.has("duration_s"):
        raise f.error("count", "give exactly one of count (requests) and duration_s (seconds of arrivals)")
    count = f.int("count", None, min=1, max=MAX_REQUESTS)
    duration_s = f.float("duration_s", None, min=0, exclusive=True)
    arrival = arrival_from_fields(f.sub("arrival"), count=count)
    if duration_s is not None and duration_s * arrival.mean_rate + arrival.size > MAX_REQUESTS:
        raise f.error("duration_s", f"{duration_s:g} s at {arrival.mean_rate:g} requests/s is more than "
                                    f"{MAX_REQUESTS:,} requests (the most one workload may have)")
    if duration_s is not None and duration_s > MAX_ARRIVAL_S:
        raise f.error("duration_s", f"{duration_s:g} s is past {MAX_ARRIVAL_S:g} s, the latest arrival kvsim replays "
                                    "(beyond it a double does not resolve a step's time)")
    prompt = length_from_fields(f.sub("prompt_tokens"), base_dir=base_dir)
    output = length_from_fields(f.sub("output_tokens"), base_dir=base_dir)
    shared = None
    sp = f.sub("shared_prefix", None)
    if sp is not None:
        shared = SharedPrefix(
            groups=sp.int("groups", min=1, max=MAX_REQUESTS),
            tokens=sp.int("tokens", min=1),
            fraction=sp.float("fraction", min=0, max=1),
        )
        if shared.tokens >= max_model_len:
            raise sp.error("tokens", f"must be < max_model_len ({max_model_len}), got {shared.tokens}")
        sp.done()
    limit = f.int("limit", None, min=1)
    n = f.int("n", 1, min=1, max=MAX_PARALLEL_SAMPLES)  # samples per prompt (vLLM's SamplingParams.n)
    if count is not None and count * n > MAX_REQUESTS:
        raise f.error("n", f"{count:,} prompts x {n} samples is more than {MAX_REQUESTS:,} requests (the most one workload may have)")
    f.done()
    return SyntheticRequests(arrival, prompt, output, count=count, duration_s=duration_s, shared_prefix=shared, limit=limit, n=n)


def _trace_requests(f: Fields, base_dir: Path, cli_trace: str | None) -> TraceRequests:
    """`trace: file.csv` with time_scale and limit beside it, or `trace: {path, time_scale, limit}`.

    The path is relative to the YAML file; it may be null when the command line gives one (--trace, relative
    to the working directory), which also overrides a path in the file.
    """
    t = f.sub("trace") if isinstance(f.raw.get("trace"), dict) else None
    g = t if t is not None else f
    path = g.str("path" if t is not None else "trace", None)
    time_scale = g.float("time_scale", 1.0, min=0, exclusive=True)
    limit = g.int("limit", None, min=1)
    model = g.str("model", None)  # BurstGPT filters: its Model and Log Type columns
    log_type = g.str("log_type", None)
    if t is not None:
        t.done()
    f.done()
    if cli_trace is not None:
        return TraceRequests(_trace_file(Path(cli_trace), source=None, field="--trace"), time_scale, limit, model, log_type)
    if path is None:
        raise f.error("trace.path" if t is not None else "trace", "no trace file here: give one with --trace FILE")
    field = g.path("path" if t is not None else "trace")
    return TraceRequests(_trace_file(base_dir / path, source=f.source, field=field), time_scale, limit, model, log_type)


def _trace_file(path: Path, *, source: str | None, field: str) -> Path:
    if not path.is_file():
        what = "is a directory, not a trace file" if path.is_dir() else "trace file not found"
        raise KvsimError(f"{what}: {path}", source=source, field=field)
    return path


def _retention_interval(a: Fields, block_size: int) -> int | None:
    """vLLM's `prefix_cache_retention_interval`: absent = its default 0 (sparse: a sliding-window group caches
    only the blocks a later hit can reach); an explicit null = None (dense: every full block, vLLM's
    `--prefix-cache-retention-interval` unset in older releases); k > 0 = also a tail every k tokens, k a
    multiple of the block size."""
    key = "prefix_cache_retention_interval"
    if key in a.raw and a.raw[key] is None:
        a.get(key, None)
        return None
    interval = a.int(key, 0, min=0)
    if interval % block_size:
        raise a.error(key, f"must be a multiple of the block size ({block_size}), got {interval}")
    return interval


def _allocators(f: Fields, scheduler: SchedulerConfig) -> tuple[AllocatorConfig, ...]:
    configs = []
    for a in f.subs("allocators"):
        kind = a.choice("kind", ("flat", "paged"))
        if kind == "flat":
            config = AllocatorConfig(
                "flat",
                reserve=a.choice("reserve", ("max", "pow2", "oracle"), "max"),
                placement=a.choice("placement", ("first-fit", "best-fit", "buddy"), "first-fit"),
            )
        else:
            watermark = a.float("watermark", scheduler.watermark, min=0, max=1)
            if watermark >= 1:
                raise a.error("watermark", f"must be < 1 (a fraction of the blocks), got {watermark:g}")
            block_size = a.int("block_size", 16, min=1)
            caching = a.bool("prefix_caching", False) if a.has("prefix_caching") else None  # None: vllm serve's
            if a.has("mamba_cache_mode"):  # vLLM's name for it on a hybrid model: align is prefix caching on
                mode = a.choice("mamba_cache_mode", ("none", "align"))
                if caching is not None and caching != (mode == "align"):
                    raise a.error("mamba_cache_mode", f"{mode} contradicts prefix_caching: {str(caching).lower()} "
                                  "(align is prefix caching on, none off)")
                caching = mode == "align"
            config = AllocatorConfig(
                "paged",
                block_size=block_size,
                prefix_caching=caching,
                watermark=watermark,
                prefix_cache_retention_interval=_retention_interval(a, block_size),
                mamba_checkpoint_alignment=a.int("mamba_checkpoint_alignment", None, min=0),
                given_mamba_cache_mode=a.choice("mamba_cache_mode", ("none", "align")) if a.has("mamba_cache_mode") else None,
            )
        a.done()
        # one left to vllm serve's default (prefix_caching None) and one set may differ for the model: the replay
        # checks those once the defaults are known
        if any(c.label == config.label and (c.prefix_caching is None) == (config.prefix_caching is None) for c in configs):
            raise KvsimError(f"duplicates an earlier allocator ({config.label})", source=a.source, field=a.prefix)
        configs.append(config)
    return tuple(configs)
