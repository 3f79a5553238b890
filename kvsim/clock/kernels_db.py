"""The kernels-db clock: a step's time from vLLM's kernels as measured on real GPUs (aiconfigurator-core's
performance database, queried through its SDK and its own interpolation), summed over the model's layers."""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.clock.roofline import HOST_BANDWIDTH_BYTES_PER_S, last_step_before
from kvsim.vllm_version import VLLM_VERSION

KVSIM_VLLM_VERSION = VLLM_VERSION  # the vLLM kvsim follows; the database's closest version is picked
BACKEND = "vllm"
# kvsim's GPU keys -> the database's system names. A100 40GB is left out on purpose: the database's A100 is
# the 80 GB SXM board (2.0 TB/s against 1.6), so its decode times would be a fifth too fast.
SYSTEMS = {"h100-80gb": "h100_sxm", "h200": "h200_sxm", "a100-80gb": "a100_sxm", "b200": "b200_sxm", "l40s": "l40s"}
# kvsim's Hugging Face ids -> the ids the database's model configs are filed under, where they differ.
MODEL_ALIASES = {
    "meta-llama/llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B",
    "meta-llama/llama-3.1-70b": "meta-llama/Meta-Llama-3.1-70B",
    "meta-llama/llama-3.1-405b": "meta-llama/Meta-Llama-3.1-405B",
}
# kvsim's KV dtypes -> the SDK's KV-cache quant modes (None: the model's default, 16-bit). fp32 has no kernels.
KV_QUANT = {"bf16": None, "fp16": None, "fp8": "fp8", "int8": "int8"}
_PROBE_TOKENS = 512  # token count at which ops are probed for their dependence on sequence length


def available() -> bool:
    """Whether the `perfdb` extra (aiconfigurator-core) is installed, without importing it."""
    import importlib.util

    return importlib.util.find_spec("aiconfigurator_core") is not None


def _version_key(version: str) -> tuple:
    parts = []
    for p in version.split("."):
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def closest_version(versions, target: str = KVSIM_VLLM_VERSION) -> str:
    """The version in `versions` closest to `target` (the newer one on a tie): compared as (major, minor, patch)."""
    t = _version_key(target)

    def distance(v: str) -> tuple:
        k = _version_key(v)
        return tuple(abs(a - b) for a, b in zip(k + (0,) * 3, t + (0,) * 3))[:3], tuple(-x for x in k)

    return min(versions, key=distance)


def database_versions(system: str) -> list[str]:
    """The vLLM versions the database holds measured data for on `system` (its query slots whose data exists)."""
    from aiconfigurator_core.sdk import perf_database

    slots = perf_database.get_version_slots(system, BACKEND) or {}
    root = Path(perf_database.get_systems_paths()[0]) / "data" / system
    measured = {p.name for p in root.glob(f"*/{BACKEND}/*") if p.is_dir()}
    return sorted({v for v in slots.values() if v in measured}, key=_version_key)


def model_path(hf_id: str | None, name: str) -> str:
    """The database's id for a kvsim model, or a KvsimError naming the model (it has no config for it)."""
    import aiconfigurator_core

    configs = Path(aiconfigurator_core.__file__).parent / "model_configs"
    for candidate in (MODEL_ALIASES.get((hf_id or "").lower()), hf_id):
        if candidate and (configs / f"{candidate.replace('/', '--')}_config.json").is_file():
            return candidate
    raise KvsimError(f"{name}: aiconfigurator-core's database has no model config for {hf_id or name} "
                     "(the kernels-db clock times only the models it ships)", field="model")


@dataclass
class KernelClock:
    """Step times of one model on one GPU from the kernel database; same interface as `Roofline` for the replay.

    A step's time is the sum of three parts, each the sum over the model's layers that the SDK returns:

        shared    = every token-wise op (QKV/O/MLP or MoE GEMMs, norms, all-reduce for tp) at the step's tokens
                    + the logits GEMM at the number of requests in the step
        context   = context attention (or the MLA block) per prefill chunk: (chunk tokens, prefix); chunks of
                    the same shape are one batched query, as vLLM runs them in one varlen kernel
        decode    = generation attention (or MLA) for all decodes at once, at their mean context length

    A decode-only step takes the SDK's generation ops at the decode batch. Which ops depend on sequence length
    is probed once (an op whose time changes with `s` at a fixed token count is attention-like).
    """

    system: str
    vllm_version: str
    model_path: str
    tp: int = 1
    kv_quant: str | None = None  # the SDK's KV-cache quant mode (fp8, int8), None for 16-bit
    ep: int = 1  # expert-parallel ranks of a MoE model's experts: 1 (experts split by tp) or tp
    host_bandwidth_bytes_per_s: float = HOST_BANDWIDTH_BYTES_PER_S
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        from aiconfigurator_core.sdk.config_builders import build_model_config
        from aiconfigurator_core.sdk.engine import EngineHandle
        from aiconfigurator_core.sdk.models import get_model

        # A MoE's experts span the tp ranks (vLLM's attention width = expert width, one data-parallel rank):
        # split tensor-wise by default, over ep ranks with --enable-expert-parallel (then ep = tp).
        moe_tp, moe_ep = self.tp // self.ep, self.ep
        with _quiet():
            self._handle = EngineHandle.compile(self.model_path, self.system, BACKEND,
                                                backend_version=self.vllm_version, tp_size=self.tp,
                                                moe_tp_size=moe_tp, moe_ep_size=moe_ep, kvcache_quant_mode=self.kv_quant)
            # The op lists the engine compiled, as compile_engine builds them (their lengths index the engine's).
            ops = get_model(self.model_path, build_model_config(self.tp, 1, 1, moe_tp, moe_ep, kvcache_quant_mode=self.kv_quant),
                            BACKEND)
            self.num_experts = getattr(ops, "_num_experts", None)  # None: a dense model
            self._num_ops = (len(ops.context_ops), len(ops.generation_ops))
            self._ctx = self._split(is_context=True)
            self._gen = self._split(is_context=False)

    @property
    def label(self) -> str:
        """What the header and meta.json name: the database, its system and vLLM version (and tp/ep above 1)."""
        par = (f", tp {self.tp}" if self.tp > 1 else "") + (f", ep {self.ep}" if self.ep > 1 else "")
        return f"kernels-db (aiconfigurator-core {_aic_version()}, {self.system}, vLLM {self.vllm_version}{par})"

    # --- op lists ------------------------------------------------------------------------------------

    def _ops(self, is_context: bool, indices, **shape) -> list:
        h = self._handle
        return (h.evaluate_context_ops if is_context else h.evaluate_generation_ops)(list(indices), **shape)

    def _split(self, *, is_context: bool) -> tuple[list[int], list[int], list[int]]:
        """(token-wise, sequence-dependent, logits) op indices of the context or generation op list."""
        n = self._num_ops[0 if is_context else 1]
        short = self._ops(is_context, range(n), batch_size=1, s=64, x=_PROBE_TOKENS) if is_context else \
            self._ops(False, range(n), batch_size=8, s=256)
        long = self._ops(is_context, range(n), batch_size=1, s=_PROBE_TOKENS, x=_PROBE_TOKENS) if is_context else \
            self._ops(False, range(n), batch_size=8, s=4096)
        shared, seq, logits = [], [], []
        for i, (a, b) in enumerate(zip(short, long)):
            if "logits" in a[0]:
                logits.append(i)
            elif abs(a[1] - b[1]) > 1e-9 * max(abs(a[1]), 1.0):
                seq.append(i)
            else:
                shared.append(i)
        if not seq:
            raise KvsimError(f"{self.model_path}: the database times no attention op for it on {self.system}",
                             field="model")
        return shared, seq, logits

    # --- cached queries (milliseconds) -----------------------------------------------------------------

    def _sum(self, key, is_context: bool, indices, **shape) -> float:
        ms = self._cache.get(key)
        if ms is None:
            ms = self._cache[key] = math.fsum(op[1] for op in self._ops(is_context, indices, **shape)) if indices else 0.0
        return ms

    def prefill_shared_ms(self, num_tokens: int, num_reqs: int) -> float:
        """Token-wise ops at `num_tokens` plus the logits GEMM at `num_reqs` rows."""
        shared, _, logits = self._ctx
        ms = self._sum(("cs", num_tokens), True, shared, batch_size=1, s=num_tokens, x=num_tokens)
        if logits:
            return ms + self._sum(("cl", num_reqs), True, logits, batch_size=num_reqs, s=1)
        # Some op lists (the SDK's MoE models) carry the logits GEMM in generation only: take it from there.
        return ms + self._sum(("gl", num_reqs), False, self._gen[2], batch_size=num_reqs, s=1)

    def context_attention_ms(self, count: int, num_tokens: int, prefix: int) -> float:
        """`count` prefill chunks of `num_tokens` new tokens after `prefix` computed ones."""
        return self._sum(("ca", count, num_tokens, prefix), True, self._ctx[1], batch_size=count, s=num_tokens, prefix=prefix)

    def decode_shared_ms(self, num_seqs: int) -> float:
        """A decode-only step's token-wise ops and logits at `num_seqs` requests."""
        shared, _, logits = self._gen
        return self._sum(("gs", num_seqs), False, shared + logits, batch_size=num_seqs, s=1)

    def decode_attention_ms(self, num_seqs: int, ctx_len: int) -> float:
        """Generation attention for `num_seqs` decodes attending to `ctx_len` positions each."""
        return self._sum(("ga", num_seqs, ctx_len), False, self._gen[1], batch_size=num_seqs, s=ctx_len)

    # --- the replay's interface ------------------------------------------------------------------------

    def output_time(self, out, swap_bytes: int = 0) -> float:
        """Seconds of one scheduled step (`SchedulerOutput`: its prefill chunks and decodes), swaps included."""
        ms = 0.0
        n = len(out.decodes)
        if out.prefills:
            tokens = sum(num for _, _, num in out.prefills) + n
            ms += self.prefill_shared_ms(tokens, len(out.prefills) + n)
            for (start, num), count in sorted(Counter((s, k) for _, s, k in out.prefills).items()):
                ms += self.context_attention_ms(count, num, start)
        elif n:
            ms += self.decode_shared_ms(n)
        if n:
            ctx = sum(seq.num_computed_tokens for seq in out.decodes)
            ms += self.decode_attention_ms(n, _mean_ctx(ctx, n, 0))
        return ms * 1e-3 + swap_bytes / self.host_bandwidth_bytes_per_s

    def decode_run(self, num_seqs: int, ctx_sum: int, num_steps: int) -> float:
        """Seconds of `num_steps` decode-only steps of the same `num_seqs` requests (see `Roofline.decode_run`).

        The shared ops are the same every step; attention's per-step times are summed by Simpson's rule over
        the first, middle and last step (exact where the database's curve is quadratic or flatter in the context
        length, which decode attention, read-bound, is to well under 1%). Written here: the SDK has no sum.
        """
        assert num_seqs > 0 and num_steps >= 0
        if num_steps == 0:
            return 0.0
        first = self.decode_attention_ms(num_seqs, _mean_ctx(ctx_sum, num_seqs, 0))
        last = self.decode_attention_ms(num_seqs, _mean_ctx(ctx_sum, num_seqs, num_steps - 1))
        if num_steps <= 2:
            attn = first + (last if num_steps == 2 else 0.0)
        else:
            mid = self.decode_attention_ms(num_seqs, _mean_ctx(ctx_sum, num_seqs, (num_steps - 1) / 2))
            attn = num_steps * (first + 4.0 * mid + last) / 6.0
        return (num_steps * self.decode_shared_ms(num_seqs) + attn) * 1e-3

    def decode_steps_before(self, num_seqs: int, ctx_sum: int, max_steps: int, time_left: float) -> tuple[int, float]:
        """How many decode steps (at least 1, at most `max_steps`) start before `time_left` s, and their time."""
        assert max_steps >= 1
        return last_step_before(self.decode_run, num_seqs, ctx_sum, 1, max_steps, time_left)


def _mean_ctx(ctx_sum: int, num_seqs: int, step: float) -> int:
    """Positions a decode attends to on average at decode step `step`: its computed tokens + 1."""
    return int(round(ctx_sum / num_seqs + step)) + 1


def kernel_clock(model, gpu, *, tp: int = 1, kv_dtype: str = "bf16", ep: int = 1) -> KernelClock:
    """The kernels-db clock for a catalogue `ModelSpec` on a `GPUSpec` at `tp` tensor-parallel ranks (a MoE's
    experts over `ep` of them: 1 or tp), or a one-line KvsimError naming what is missing (the extra, the GPU,
    the model, the KV dtype, experts to split)."""
    if not available():
        raise KvsimError("the kernels-db clock needs aiconfigurator-core: pip install 'kvsim[perfdb]'", field="--timing")
    system = SYSTEMS.get(gpu.key)
    if system is None:
        raise KvsimError(f"{gpu.name}: not in aiconfigurator-core's database (it has: {', '.join(SYSTEMS)})",
                         field="hardware")
    versions = database_versions(system)
    if not versions:
        raise KvsimError(f"{gpu.name}: aiconfigurator-core holds no vLLM data for {system}", field="hardware")
    if kv_dtype not in KV_QUANT:
        raise KvsimError(f"the database times no attention kernel with a {kv_dtype} KV cache "
                         f"(it has: {', '.join(KV_QUANT)})", field="kv_dtype")
    if ep not in (1, tp):
        raise KvsimError(f"ep {ep} with tp {tp}: vLLM's expert parallelism spans every tp rank of the one "
                         "data-parallel rank kvsim replays (ep 1, or ep = tp)", field="ep")
    path = model_path(model.hf_id, model.name)
    clock = _cached_clock(system, closest_version(versions), path, tp, KV_QUANT[kv_dtype], ep)
    if ep > 1 and not clock.num_experts:
        raise KvsimError(f"ep {ep}: {model.name} has no experts to split (expert parallelism is for MoE models)", field="ep")
    return clock


def decode_step_line(model, gpu, *, num_seqs: int, context_tokens: int, tp: int = 1, kv_dtype: str = "bf16") -> str:
    """`kvsim size --gpu --step-time`: one decode step of `num_seqs` requests at `context_tokens` each, on
    this clock: a rough "what this GPU does" at the maximum concurrency."""
    if num_seqs < 1:
        return "decode step: not one request of this length fits"
    clock = kernel_clock(model, gpu, tp=tp, kv_dtype=kv_dtype)
    step_s = clock.decode_run(num_seqs, num_seqs * (context_tokens - 1), 1)
    return (f"decode step at {num_seqs:,} requests x {context_tokens:,} tokens: {step_s * 1e3:.2f} ms, "
            f"{num_seqs / step_s:,.0f} tok/s ({clock.label})")


@functools.lru_cache(maxsize=8)
def _cached_clock(system: str, version: str, path: str, tp: int, kv_quant: str | None, ep: int = 1) -> KernelClock:
    try:
        return KernelClock(system, version, path, tp, kv_quant, ep=ep)
    except KvsimError:
        raise
    except Exception as exc:  # the SDK's own errors: a model family or op it cannot time
        raise KvsimError(f"{path} on {system}: aiconfigurator-core cannot time it ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})", field="model") from None


def _aic_version() -> str:
    from importlib import metadata

    return metadata.version("aiconfigurator-core")


class _quiet:
    """Silence the SDK's loading chatter (it logs each fallback table it reads) while a clock is built."""

    def __enter__(self):
        self._level = logging.root.manager.disable
        logging.disable(logging.WARNING)

    def __exit__(self, *exc):
        logging.disable(self._level)
