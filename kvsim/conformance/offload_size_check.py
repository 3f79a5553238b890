"""`kvsim size --cpu-offload` against vLLM 0.33.0's own CPU tier arithmetic, field by field.

vLLM's planning builds the KV cache config from kvsim's layers (as `size_check` does); vLLM's
`build_offloading_config` (vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py, loaded unmodified
from the wheel) turns it into an `OffloadingConfig`, and vLLM's
`CPUOffloadingSpec` sizes the tier. The one stand-in: the platform is CUDA (`_uses_shared_region` True, as on
the H100 the figures are for; the loader's platform is none).
Run: `python3 -m kvsim.conformance.offload_size_check [--all]` (exit code 1 on any difference).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from kvsim.conformance.size_specs import vllm_config, vllm_modules, vllm_specs
from kvsim.errors import KvsimError
from kvsim.size.vllm import VllmSettings

_OFFLOADING_CONFIG = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"
GIB = 1 << 30


@dataclass(frozen=True)
class OffloadCase:
    """One `kvsim size --json --cpu-offload` run."""

    model: str
    tp: int = 1
    cpu_bytes: int = 100 * GIB
    cpu_block_size: int | None = None
    settings: VllmSettings = VllmSettings()
    context: int | None = None

    @property
    def label(self) -> str:
        opts = f" --cpu-block-size {self.cpu_block_size}" if self.cpu_block_size else ""
        from kvsim.conformance.size_check import has_state_layers

        if has_state_layers(self.model):  # kvsim size's default follows vllm serve's: name the mode
            opts += f" --mamba-cache-mode {self.settings.mamba_cache_mode}"
            if self.settings.mamba_cache_mode == "align":
                opts += f" --mamba-checkpoint-alignment {self.settings.mamba_checkpoint_alignment}"
        if self.context:
            opts += f" --context {self.context}"
        return f"{self.model} --tp {self.tp} --cpu-offload {self.cpu_bytes / GIB:g}GiB{opts}"


@dataclass
class OffloadResult:
    case: OffloadCase
    compared: dict[str, tuple] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def differing(self) -> dict[str, tuple]:
        return {k: v for k, v in self.compared.items() if v[0] != v[1]}


@functools.lru_cache(maxsize=1)
def vllm_offloading_config_module():
    """vLLM's offloading/config.py, unmodified (the loader serves vLLM's KV connector packages for real)."""
    from kvsim.conformance.vllm_import import import_vllm

    return import_vllm(_OFFLOADING_CONFIG)


def vllm_cpu_tier(case: OffloadCase, report: dict, model) -> dict:
    """vLLM's own figures for the case: its KV cache config, its offloading config, its CPUOffloadingSpec."""
    from kvsim.conformance.vllm_import import import_vllm

    v = vllm_modules()
    specs = vllm_specs(v, model, report)
    # MLA layers declare their latent unsharded (`MLAAttention.get_kv_cache_spec`: max_tp_shards=1), which makes
    # every TP rank a replica (`kv_cache_groups_tp_replicas`)
    specs = {name: replace(s, max_tp_shards=1) if type(s) is v.kvi.MLAAttentionSpec else s for name, s in specs.items()}
    cfg = vllm_config(v, case.settings, report["context_tokens"], case.tp)
    groups = v.planning.get_kv_cache_groups(cfg, dict(specs))
    configs = v.planning.get_kv_cache_configs(cfg, [specs], [1 << 40], groups)
    kv_cache_config = v.utils.generate_scheduler_kv_cache_config(configs)  # the scheduler side's view
    extra = {"cpu_bytes_to_use": case.cpu_bytes / GIB * (1 << 30)}  # as _post_init_kv_transfer_config sets it
    if case.cpu_block_size is not None:
        extra["block_size"] = case.cpu_block_size
    cfg.kv_transfer_config = SimpleNamespace(kv_connector_extra_config=extra, engine_id="kvsim")
    cfg.parallel_config = SimpleNamespace(
        pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
        tensor_parallel_size=case.tp, world_size=case.tp, rank=0, data_parallel_index=0, data_parallel_size=1,
        data_parallel_rank_local=None, distributed_executor_backend="mp", nnodes_within_dp=1,
    )
    cfg.cache_config.block_size = report.get("vllm_block_size", report["block_size"])
    cfg.cache_config.prefix_match_unit = None
    cfg.cache_config.enable_prefix_caching = True
    cfg.cache_config.cache_dtype = "auto"
    cfg.cache_config.kv_cache_layout = None
    use_mla = all(isinstance(s, v.kvi.MLAAttentionSpec) for s in specs.values())
    cfg.model_config = SimpleNamespace(
        **vars(cfg.model_config), use_mla=use_mla, model=model.name, dtype="bfloat16",
        get_total_num_kv_heads=lambda: max((layer.num_kv_heads for layer in model.layers), default=1),
    )
    cfg.kv_events_config = None
    offloading = vllm_offloading_config_module().build_offloading_config(cfg, kv_cache_config)
    spec_module = import_vllm("vllm.v1.kv_offload.cpu.spec")

    class CudaCPUOffloadingSpec(spec_module.CPUOffloadingSpec):
        def _uses_shared_region(self) -> bool:  # the platform stand-in: CUDA
            return True

    spec = CudaCPUOffloadingSpec(offloading)
    info = spec.cpu_info
    return {
        "vllm_num_cpu_blocks": spec.num_chunks,
        "cpu_chunk_bytes": spec.kv_bytes_per_chunk,
        "cpu_chunk_bytes_per_rank": spec.cpu_page_size_per_worker,
        "cpu_offload_bytes": info.cpu_kv_cache_size_bytes,
        "cpu_blocks_per_chunk": info.cpu_blocks_per_chunk,
        "cpu_block_size": offloading.groups[0].tokens_per_block * offloading.cache.blocks_per_chunk,
        "cpu_kv_cache_size_tokens": info.cpu_kv_cache_size_tokens,
        "cpu_replicated_layout": spec.replicated_layout,
        "cpu_groups": [
            {"tokens_per_chunk": g.tokens_per_block * offloading.cache.blocks_per_chunk,
             "window_chunks": g.sliding_window_size_in_chunks}
            for g in offloading.groups
        ],
    }


def check(case: OffloadCase) -> OffloadResult:
    """kvsim's CPU tier for the case against vLLM's, field by field."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.size.cpu_offload import model_cpu_offload
    from kvsim.size.report import size_report

    result = OffloadResult(case)
    model = resolve_model(case.model)
    try:
        report = size_report(model, tp=case.tp, context_tokens=case.context, settings=case.settings)
        ours = model_cpu_offload(report, case.cpu_bytes, cpu_block_size=case.cpu_block_size).as_json()
    except KvsimError as exc:
        result.skipped = f"kvsim refuses it: {exc}"
        return result
    theirs = vllm_cpu_tier(case, report.as_json(), model)
    for key, value in theirs.items():
        mine = ours[key]
        if key == "cpu_groups":
            mine = [{k: g[k] for k in ("tokens_per_chunk", "window_chunks")} for g in mine]
        result.compared[key] = (mine, value)
    return result


def default_cases() -> list[OffloadCase]:
    """Uniform, sliding-window, chunked, hybrid (state) and MLA models, at tp 1 and more, two chunk sizes."""
    align = VllmSettings(mamba_cache_mode="align")
    return [
        OffloadCase("llama-3.1-8b"),
        OffloadCase("llama-3.1-8b", cpu_block_size=256),
        OffloadCase("qwen3-32b", tp=2, cpu_bytes=100 * GIB),
        OffloadCase("llama-3.1-70b", tp=8, cpu_bytes=512 * GIB, cpu_block_size=64),
        OffloadCase("mistral-7b-v0.1", cpu_bytes=64 * GIB),
        OffloadCase("gemma-3-27b", tp=2, cpu_bytes=64 * GIB),
        OffloadCase("gpt-oss-120b", tp=2, cpu_bytes=100 * GIB),
        OffloadCase("llama-4-scout", tp=8, cpu_bytes=256 * GIB),
        OffloadCase("qwen3-next-80b-a3b", tp=4, cpu_bytes=64 * GIB, settings=align),
        OffloadCase("jamba-v0.1", tp=2, cpu_bytes=32 * GIB, settings=align),
        OffloadCase("deepseek-v3", tp=8, cpu_bytes=200 * GIB),
    ]


def catalogue_cases() -> list[OffloadCase]:
    """Every catalogue model at tp 1, 2 and 4, mamba_cache_mode none and align, with a tier of an odd size."""
    from kvsim.models.catalogue import model_names

    return [OffloadCase(name, tp=tp, cpu_bytes=48 * GIB + 12_345, settings=VllmSettings(mamba_cache_mode=mode))
            for name in model_names() for tp in (1, 2, 4) for mode in ("none", "align")]


def main(argv: list[str] | None = None) -> int:
    """`--all`: every catalogue model (`catalogue_cases`), else the hand-picked `default_cases`."""
    argv = sys.argv[1:] if argv is None else argv
    failed = 0
    for case in catalogue_cases() if "--all" in argv else default_cases():
        r = check(case)
        if r.skipped:
            print(f"skip  {case.label}: {r.skipped}")
            continue
        bad = r.differing
        failed += bool(bad)
        ours = dict((k, v[0]) for k, v in r.compared.items())
        print(f"{'DIFF' if bad else 'ok  '}  {case.label}: {ours['vllm_num_cpu_blocks']:,} CPU blocks of "
              f"{ours['cpu_block_size']} tokens, {ours['cpu_chunk_bytes']:,} B"
              + "".join(f"\n      {k}: kvsim {a!r} vLLM {b!r}" for k, (a, b) in bad.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
