"""`kvsim size` against vLLM 0.33.0's own sizing functions, field by field, for every catalogue model.

Builds vLLM's per-layer KV cache specs from kvsim's layer list and runs vLLM's planning (`get_kv_cache_groups`,
`get_kv_cache_configs`, `generate_scheduler_kv_cache_config`, `get_kv_cache_capacity`) on kvsim's KV budget.
Run: `python3 -m kvsim.conformance.size_check` (exit code 1 on any difference).
"""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from kvsim.errors import KvsimError
from kvsim.models import LayerKind, ModelSpec
from kvsim.sizing import cdiv
from kvsim.vllm_sizing import VllmSettings

GPUS = ("h100-80gb", "h200")
TPS = (1, 2, 8)
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn", "int8": "int8"}
_STATE_DTYPES = {2: "bfloat16", 4: "float32"}  # by bytes per element


@dataclass(frozen=True)
class Case:
    """One `kvsim size --json` run: model, --tp, --gpu, the vLLM settings."""

    model: str
    tp: int
    gpu: str
    settings: VllmSettings = VllmSettings()
    kv_dtype: str = "bf16"
    context: int | None = None

    @property
    def label(self) -> str:
        s, default = self.settings, VllmSettings()
        opts = f" --context {self.context}" if self.context else ""
        if s.max_num_batched_tokens != default.max_num_batched_tokens:
            opts += f" --max-num-batched-tokens {s.max_num_batched_tokens}"
        if s.kernel_block_size != default.kernel_block_size:
            opts += f" --kernel-block-size {s.kernel_block_size}"
        if s.mamba_cache_mode != default.mamba_cache_mode:
            opts += f" --mamba-cache-mode {s.mamba_cache_mode}"
        if s.mamba_checkpoint_alignment:
            opts += f" --mamba-checkpoint-alignment {s.mamba_checkpoint_alignment}"
        if not s.async_scheduling:
            opts += " --no-async-scheduling"
        return f"{self.model} --tp {self.tp} --gpu {self.gpu} --kv-dtype {self.kv_dtype}{opts}"


@dataclass
class Result:
    """Fields compared (name -> (kvsim, vLLM)), the ones that differ, or why the case was not compared."""

    case: Case
    compared: dict[str, tuple] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def differing(self) -> dict[str, tuple]:
        return {k: v for k, v in self.compared.items() if v[0] != v[1]}


def _vllm():
    """vLLM's modules, imported unmodified by the conformance loader."""
    from kvsim.conformance.vllm_import import import_vllm

    return SimpleNamespace(
        kvi=import_vllm("vllm.v1.kv_cache_interface"),
        planning=import_vllm("vllm.v1.core.kv_cache_planning"),
        utils=import_vllm("vllm.v1.core.kv_cache_utils"),
        layout=import_vllm("vllm.v1.kv_cache_layout"),
    )


@functools.lru_cache(maxsize=1)
def _vllm_config_properties() -> type:
    """`VllmConfig.max_concurrent_batches` and `.max_in_flight_tokens`, compiled from vLLM's own source.

    vllm/config/vllm.py itself does not import under the loader's stubs, so its two properties are taken out
    of the file unmodified (ast) and put on a class the stub config inherits.
    """
    from kvsim.conformance.vllm_wheel import vllm_source_root

    path = vllm_source_root() / "vllm" / "config" / "vllm.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VllmConfig")
    wanted = {"max_concurrent_batches", "max_in_flight_tokens"}
    body = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted, f"{path}: VllmConfig lacks {wanted}"
    module = ast.Module(body=[ast.ClassDef(name="VllmConfigProperties", bases=[], keywords=[], body=body, decorator_list=[])], type_ignores=[])
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(module), str(path), "exec"), namespace)
    return namespace["VllmConfigProperties"]


def _vllm_config(v, settings: VllmSettings, max_model_len: int, tp: int):
    """The parts of a VllmConfig the sizing functions read, with `vllm serve`'s defaults."""
    layout = v.layout.KVCacheLayout.LBNHC  # resolve_kv_cache_layout's first default preference (backends declare none)

    class Config(_vllm_config_properties()):
        use_v2_model_runner = False

    cfg = Config()
    cfg.model_config = SimpleNamespace(max_model_len=max_model_len, original_max_model_len=max_model_len, supports_kv_cache_grouping=False)
    cfg.scheduler_config = SimpleNamespace(
        max_num_batched_tokens=settings.max_num_batched_tokens, async_scheduling=settings.async_scheduling,
        disable_hybrid_kv_cache_manager=False, max_num_encoder_input_tokens=settings.max_num_batched_tokens,
    )
    cfg.parallel_config = SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1, tensor_parallel_size=tp)
    cfg.cache_config = SimpleNamespace(
        mamba_cache_mode=settings.mamba_cache_mode, num_gpu_blocks_override=None, prefix_cache_retention_interval=None,
        get_resolved_kv_cache_layout=lambda: layout,
    )
    cfg.attention_config = SimpleNamespace(hisparse_config=None)
    cfg.speculative_config = None
    cfg.num_prefill_lookahead_tokens = 0
    cfg.device_config = SimpleNamespace(device_type="cuda")
    return cfg


def vllm_specs(v, model: ModelSpec, report: dict) -> dict:
    """vLLM's per-layer specs for kvsim's layers on one rank: `block_size` and the state padding are kvsim's."""
    import torch

    tp, bs = report["tp"], report.get("vllm_block_size", report["block_size"])
    kv_dtype = getattr(torch, _TORCH_DTYPES[report["kv_dtype"]])
    states = [layer for layer in model.layers if layer.kind == LayerKind.LINEAR_STATE]
    state_shape = {}  # layer -> (shape, dtype): the state's elements in one dtype, or its bytes where dtypes mix
    if states:
        total, elements = report["state_bytes_per_sequence"], sum(layer.state_elements_per_rank(tp) for layer in states)
        if total % elements == 0 and total // elements in _STATE_DTYPES:
            dtype = getattr(torch, _STATE_DTYPES[total // elements])
            state_shape = {layer: ((layer.state_elements_per_rank(tp),), dtype) for layer in states}
        else:  # mixed dtypes (an fp32 ssm state beside a bf16 conv state): equal layers share the total
            assert len(set(states)) == 1 and total % len(states) == 0, "unequal state layers in mixed dtypes"
            state_shape = {states[0]: ((total // len(states),), torch.uint8)}
    mode = report.get("vllm_mamba_cache_mode", "none")
    mamba_block = bs if mode == "align" else report["context_tokens"]  # MambaModelConfig: mamba_block_size
    padded = report.get("vllm_state_page_padded_bytes")
    checkpoint = report.get("vllm_mamba_checkpoint_alignment", 0)
    specs = {}
    for i, layer in enumerate(model.layers):
        name, kind = f"model.layers.{i}.attn", layer.kind.value
        if kind in ("full", "sliding", "chunked"):
            attention = dict(
                block_size=bs, num_kv_heads=layer.kv_heads_per_rank(tp), head_size=layer.head_dim,
                head_size_v=getattr(layer, "head_dim_v", 0) or layer.head_dim, dtype=kv_dtype,
            )
            if kind == "full":
                specs[name] = v.kvi.FullAttentionSpec(**attention)
            elif kind == "sliding":
                specs[name] = v.kvi.SlidingWindowSpec(**attention, sliding_window=layer.window)
            else:
                specs[name] = v.kvi.ChunkedLocalAttentionSpec(**attention, attention_chunk_size=layer.window)
        elif kind == "mla":
            specs[name] = v.kvi.MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=layer.latent_dim, dtype=kv_dtype, cache_dtype_str="auto")
        elif kind == "linear-state":
            shape, dtype = state_shape[layer]
            unpadded = shape[0] * dtype.itemsize
            spec = v.kvi.MambaSpec(
                shapes=(shape,), dtypes=(dtype,), block_size=mamba_block,
                page_size_padded=padded if padded and padded != unpadded else None, mamba_cache_mode=mode,
            )
            if checkpoint:  # what a gated delta net layer exporting prefill checkpoints adds to its spec
                spec = replace(spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=checkpoint)
            specs[name] = spec
        elif kind != "none":  # a layer without a cache has no spec in vLLM either
            raise KvsimError(f"no vLLM spec for {kind!r} layers in the size check", field="layers")
    return specs


def _kind(v, spec) -> str:
    kinds = (
        (v.kvi.SlidingWindowSpec, "sliding"), (v.kvi.MLAAttentionSpec, "mla"), (v.kvi.FullAttentionSpec, "full"),
        (v.kvi.ChunkedLocalAttentionSpec, "chunked"), (v.kvi.MambaSpec, "state"),
    )
    for cls, kind in kinds:
        if isinstance(spec, cls):
            return kind
    return type(spec).__name__


def check(case: Case, report: dict | None = None) -> Result:
    """kvsim size --json for `case` (or the `report` it printed) against vLLM's functions on the same specs and budget."""
    from kvsim.catalogue import resolve_model
    from kvsim.hardware import get_gpu
    from kvsim.size_report import size_report

    result = Result(case)
    model = resolve_model(case.model)
    gpu = get_gpu(case.gpu)
    if report is None:
        try:
            report = size_report(
                model, kv_dtype=case.kv_dtype, tp=case.tp, memory_bytes=gpu.memory_bytes, gpu_name=gpu.name,
                context_tokens=case.context, settings=case.settings,
            ).as_json()
        except KvsimError as exc:
            result.skipped = f"kvsim size refuses it: {exc}"
            return result
    if not report["block_rounded_is_vllm_exact"]:
        result.compared["block_rounded_is_vllm_exact"] = (False, True)
        return result
    v = _vllm()
    specs = vllm_specs(v, model, report)
    cfg = _vllm_config(v, case.settings, report["context_tokens"], case.tp)
    budget = report["kv_budget_bytes"]
    groups = v.planning.get_kv_cache_groups(cfg, dict(specs))
    try:
        configs = v.planning.get_kv_cache_configs(cfg, [specs], [budget], groups)
    except ValueError:  # _check_enough_kv_cache_memory: vLLM refuses to start
        result.compared["vllm_starts"] = (report["vllm_starts"], False)
        return result
    scheduler_config = v.utils.generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = v.utils.get_kv_cache_capacity(cfg, scheduler_config)
    num_blocks = scheduler_config.num_blocks
    c = result.compared
    c["vllm_starts"] = (report["vllm_starts"], True)
    c["vllm_num_gpu_blocks"] = (report["vllm_num_gpu_blocks"], num_blocks)
    c["vllm_bytes_per_block"] = (report["vllm_bytes_per_block"], configs[0].kv_cache_tensors[0].size // num_blocks)
    c["vllm_kv_cache_size_tokens"] = (report["vllm_kv_cache_size_tokens"], tokens)
    c["max_tokens_block_rounded"] = (report["max_tokens_block_rounded"], tokens)
    c["vllm_max_concurrency"] = (report["vllm_max_concurrency"], concurrency)
    c["max_sequences_block_rounded"] = (report["max_sequences_block_rounded"], round(concurrency, 4))
    c["vllm_num_groups"] = (report["vllm_num_groups"], len(groups))
    c["vllm_cache_block_size"] = (report["vllm_cache_block_size"], min(g.kv_cache_spec.block_size for g in groups))
    c["vllm_max_in_flight_tokens"] = (report["vllm_max_in_flight_tokens"], cfg.max_in_flight_tokens)
    vllm_groups = [
        {
            "kind": _kind(v, g.kv_cache_spec),
            "num_layers": len(g.layer_names),
            "block_size": g.kv_cache_spec.block_size,
            "page_bytes": g.kv_cache_spec.page_size_bytes,
            "blocks_per_request": cdiv(g.kv_cache_spec.max_memory_usage_bytes(cfg), g.kv_cache_spec.page_size_bytes),
        }
        for g in scheduler_config.kv_cache_groups
    ]
    c["vllm_groups"] = (report["vllm_groups"], vllm_groups)
    c["vllm_blocks_per_request"] = (report["vllm_blocks_per_request"], sum(g["blocks_per_request"] for g in vllm_groups))
    mamba = [s for s in specs.values() if isinstance(s, v.kvi.MambaSpec)]
    if mamba:
        attention = next(s for s in specs.values() if not isinstance(s, v.kvi.MambaSpec))
        c["vllm_state_page_bytes"] = (report["vllm_state_page_bytes"], mamba[0].real_page_size_bytes)
        c["vllm_state_page_padded_bytes"] = (report["vllm_state_page_padded_bytes"], mamba[0].page_size_bytes)
        # the raise (Platform._align_hybrid_block_size): the attention page holds the state, and one alignment
        # step less would not (unless --block-size already held it)
        step = report["vllm_block_alignment"]
        smaller = attention.copy_with_new_block_size(report["vllm_block_size"] - step).page_size_bytes
        c["vllm_block_size_is_smallest_holding_the_state"] = (
            True,
            report["vllm_block_size"] % step == 0
            and attention.page_size_bytes >= mamba[0].real_page_size_bytes
            and (not report["vllm_block_size_raised"] or smaller < mamba[0].real_page_size_bytes),
        )
    return result


def catalogue_cases() -> list[Case]:
    """Every catalogue model at tp 1, 2, 8 on an H100 and an H200, async and sync scheduling."""
    from kvsim.catalogue import model_names

    return [
        Case(name, tp, gpu, VllmSettings(async_scheduling=sched))
        for name in model_names()
        for tp in TPS
        for gpu in GPUS
        for sched in (True, False)
    ]


def settings_cases() -> list[Case]:
    """The vLLM settings and options beside the defaults: fp8 KV, a short context, a smaller batch budget,
    prefix caching on a hybrid (mamba_cache_mode align), a larger kernel block, and a start vLLM refuses."""
    return [
        Case("llama-3.1-8b", 1, "h100-80gb", kv_dtype="fp8"),
        Case("deepseek-v3", 8, "h200", kv_dtype="fp8"),
        Case("gemma-3-27b", 2, "h100-80gb", kv_dtype="fp8", context=4096),
        Case("gpt-oss-120b", 1, "h200", VllmSettings(max_num_batched_tokens=2048), context=8192),
        Case("mistral-7b-v0.1", 1, "h100-80gb", VllmSettings(max_num_batched_tokens=512, async_scheduling=False), context=3000),
        Case("qwen3-next-80b-a3b", 4, "h100-80gb", VllmSettings(mamba_cache_mode="align")),
        Case("qwen3-next-80b-a3b", 4, "h100-80gb", VllmSettings(mamba_cache_mode="align", mamba_checkpoint_alignment=64)),
        Case("qwen3-next-80b-a3b", 8, "h200", VllmSettings(mamba_cache_mode="align", mamba_checkpoint_alignment=64), context=1000),
        Case("qwen3-next-80b-a3b", 4, "h200", VllmSettings(kernel_block_size=32), kv_dtype="fp8"),
        Case("qwen3-next-80b-a3b", 8, "h100-80gb", context=200),
        Case("qwen3-235b-a22b", 8, "h100-80gb", context=500_000),  # one request does not fit: vLLM refuses
    ]


def run(cases: list[Case]) -> list[Result]:
    return [check(case) for case in cases]


def main(argv: list[str] | None = None) -> int:
    """Print one line per case; exit 1 if any compared field differs."""
    results = run(catalogue_cases() + settings_cases())
    bad = 0
    for r in results:
        if r.skipped:
            print(f"skip  {r.case.label}: {r.skipped}")
        elif r.differing:
            bad += 1
            print(f"DIFF  {r.case.label}: " + "; ".join(f"{k}: kvsim {a!r} vs vLLM {b!r}" for k, (a, b) in r.differing.items()))
        else:
            print(f"ok    {r.case.label}: {len(r.compared)} fields equal")
    compared = sum(1 for r in results if not r.skipped)
    print(f"{compared} cases compared ({len(results) - compared} skipped), {bad} with differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
