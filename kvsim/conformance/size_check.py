"""`kvsim size` against vLLM 0.33.0's own sizing functions, field by field, for every catalogue model.

Builds vLLM's per-layer KV cache specs from kvsim's layer list and runs vLLM's planning (`get_kv_cache_groups`,
`get_kv_cache_configs`, `generate_scheduler_kv_cache_config`, `get_kv_cache_capacity`) on kvsim's KV budget.
Run: `python3 -m kvsim.conformance.size_check` (exit code 1 on any difference).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field, replace

from kvsim.conformance.size_specs import spec_kind, vllm_config, vllm_modules, vllm_specs
from kvsim.errors import KvsimError
from kvsim.size.sizing import cdiv
from kvsim.size.vllm import VLLM_VERSION, VllmSettings

GPUS = ("h100-80gb", "h200")
TPS = (1, 2, 8)


@dataclass(frozen=True)
class Case:
    """One `kvsim size --json` run: model, --tp, --gpu, the vLLM settings."""

    model: str
    tp: int
    gpu: str
    settings: VllmSettings = VllmSettings()
    kv_dtype: str = "bf16"
    context: int | None = None
    num_params: int | None = None  # a config.json path (`model`) states none: the weights to assume

    @property
    def label(self) -> str:
        s, default = self.settings, VllmSettings()
        opts = f" --context {self.context}" if self.context else ""
        if s.max_num_batched_tokens != default.max_num_batched_tokens:
            opts += f" --max-num-batched-tokens {s.max_num_batched_tokens}"
        if s.kernel_block_size != default.kernel_block_size:
            opts += f" --kernel-block-size {s.kernel_block_size}"
        if has_state_layers(self.model):  # kvsim size's defaults follow vllm serve's: name the mode and alignment
            opts += f" --mamba-cache-mode {s.mamba_cache_mode}"
            if s.mamba_cache_mode == "align":
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


@functools.lru_cache(maxsize=None)
def has_state_layers(model: str) -> bool:
    """Whether `model` (a catalogue name or config path) has state layers, whose mamba settings a label names."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hf_config import load_hf_config
    from kvsim.models.spec import LayerKind

    try:
        spec = resolve_model(model) if not model.endswith(".json") else load_hf_config(model)
    except KvsimError:
        return False
    return any(layer.kind == LayerKind.LINEAR_STATE for layer in spec.layers)


def check(case: Case, report: dict | None = None) -> Result:
    """kvsim size --json for `case` (or the `report` it printed) against vLLM's functions on the same specs and budget."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.size.report import size_report

    result = Result(case)
    model = resolve_model(case.model)
    if case.num_params is not None:
        model = replace(model, num_params=case.num_params)
    if model.vllm_unserved:
        result.skipped = f"vLLM {VLLM_VERSION} does not serve it: {model.vllm_unserved}"
        return result
    gpu = get_gpu(case.gpu)
    if report is None:
        try:
            report = size_report(
                model, kv_dtype=case.kv_dtype, tp=case.tp, memory_bytes=gpu.reported_memory_bytes, gpu_name=gpu.name,
                context_tokens=case.context, settings=case.settings,
            ).as_json()
        except KvsimError as exc:
            result.skipped = f"kvsim size refuses it: {exc}"
            return result
    if not report["block_rounded_is_vllm_exact"]:
        result.compared["block_rounded_is_vllm_exact"] = (False, True)
        return result
    v = vllm_modules()
    specs = vllm_specs(v, model, report)
    cfg = vllm_config(v, case.settings, report["context_tokens"], case.tp)
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
            "kind": spec_kind(v, g.kv_cache_spec),
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
    attention = next((s for s in specs.values() if not isinstance(s, v.kvi.MambaSpec)), None)
    if mamba and attention is None:  # attention-free: the state page unpadded, the block size as asked
        c["vllm_state_page_bytes"] = (report["vllm_groups"][0]["page_bytes"], mamba[0].real_page_size_bytes)
        c["vllm_state_page_unpadded"] = (True, mamba[0].page_size_bytes == mamba[0].real_page_size_bytes)
    elif mamba:
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
    from kvsim.models.catalogue import model_names

    return [
        Case(name, tp, gpu, VllmSettings(async_scheduling=sched))
        for name in model_names()
        for tp in TPS
        for gpu in GPUS
        for sched in (True, False)
    ]


def settings_cases() -> list[Case]:
    """The vLLM settings and options beside the defaults: fp8 KV, a short context, a smaller batch budget,
    prefix caching on a hybrid and on an attention-free model (mamba_cache_mode align), a larger kernel block,
    chunked local attention and sparse MLA at a length that fits, and a start vLLM refuses."""
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
        Case("llama-4-scout", 8, "h100-80gb", context=131072),  # chunked local attention groups beside full ones
        Case("mamba-codestral-7b", 2, "h100-80gb", VllmSettings(mamba_cache_mode="align")),  # attention-free, align
        Case("deepseek-v3.2", 8, "h200", context=65536),  # sparse MLA and its indexer keys in one group
        Case("qwen3-235b-a22b", 8, "h100-80gb", context=500_000),  # one request does not fit: vLLM refuses
    ]


# vLLM's cache dtype strings in kvsim's names (None: auto stays the model's dtype; "refused": vLLM cannot load it)
_VLLM_KV_DTYPES = {"fp8_e4m3": "fp8", "fp8": "fp8", "nvfp4": "nvfp4", "refused": "refused"}


@functools.lru_cache(maxsize=1)
def vllm_validate_kv_cache_scheme():
    """vLLM's `CompressedTensorsKVCacheMethod.validate_kv_cache_scheme`, compiled from its own source.

    Its module (model_executor/.../compressed_tensors.py) needs the compressed-tensors package and CUDA kernels, so
    the function is taken out of the file unmodified (ast), with compressed-tensors' `QuantizationStrategy` as a
    stand-in enum of the same values (compressed_tensors/quantization/quant_args.py,
    https://github.com/vllm-project/compressed-tensors). It raises where vLLM refuses a checkpoint's
    kv_cache_scheme while building its Attention layers.
    """
    import ast
    import enum
    from typing import Any

    from kvsim.conformance.vllm_wheel import vllm_source_root

    path = vllm_source_root() / "vllm" / "model_executor" / "layers" / "quantization" / "compressed_tensors" / "compressed_tensors.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CompressedTensorsKVCacheMethod")
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "validate_kv_cache_scheme")
    func.decorator_list = []  # a @staticmethod, compiled as a plain function
    strategy = enum.Enum("QuantizationStrategy", {"TENSOR": "tensor", "CHANNEL": "channel", "GROUP": "group",
                                                  "BLOCK": "block", "TOKEN": "token", "TENSOR_GROUP": "tensor_group",
                                                  "ATTN_HEAD": "attn_head"}, type=str)  # fmt: skip
    namespace: dict = {"QuantizationStrategy": strategy, "Any": Any}
    module = ast.Module(body=[func], type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), str(path), "exec"), namespace)
    return namespace["validate_kv_cache_scheme"]


def vllm_refuses_kv_cache_scheme(scheme) -> bool:
    """Whether vLLM's validate_kv_cache_scheme refuses a compressed-tensors `scheme` (any exception it raises)."""
    try:
        vllm_validate_kv_cache_scheme()(scheme)
    except Exception:
        return True
    return False


def checkpoint_kv_dtypes(models=None) -> list[tuple[str, str | None, str | None]]:
    """(model, kvsim's, vLLM's) KV cache dtype that --kv-cache-dtype auto takes from the checkpoint, for every
    catalogue model (or `models`, (name, config dict, ModelSpec) each): kvsim's `ModelSpec.checkpoint_kv_dtype`
    against vLLM's own `_normalize_quantization_config` then `get_kv_cache_quant_algo_string` on the config's
    quantization_config (ModelOpt checkpoints). For compressed-tensors checkpoints vLLM decides in its Attention
    layer (a kv_cache_scheme is fp8; MLAAttention leaves it), a module the loader does not import: there the
    rule is read, not run, and the scheme goes through vLLM's own validate_kv_cache_scheme (vLLM's "refused",
    which a kvsim ModelSpec can never equal: kvsim refuses such a config when it reads it)."""
    import copy
    from types import SimpleNamespace

    from kvsim.conformance.vllm_import import import_vllm
    from kvsim.models.spec import LayerKind

    torch_utils = import_vllm("vllm.utils.torch_utils")
    normalize = import_vllm("vllm.transformers_utils.model_arch_config_convertor").ModelArchConfigConvertorBase._normalize_quantization_config
    if models is None:
        from kvsim.models.catalogue import catalogue_entry, catalogue_models

        models = [(m.name, catalogue_entry(m.name).get("config") or {}, m) for m in catalogue_models()]
    rows = []
    for name, config, model in models:
        quant = normalize(None, SimpleNamespace(quantization_config=copy.deepcopy(config.get("quantization_config")),
                                                compression_config=copy.deepcopy(config.get("compression_config"))))
        vllm = None
        if isinstance(quant, dict):
            vllm = torch_utils.get_kv_cache_quant_algo_string(quant)
            attention = any(layer.kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED) for layer in model.layers)
            if vllm is None and quant.get("quant_method") == "compressed-tensors" and quant.get("kv_cache_scheme") is not None and attention:
                vllm = "refused" if vllm_refuses_kv_cache_scheme(quant["kv_cache_scheme"]) else "fp8"
        rows.append((name, model.checkpoint_kv_dtype, _VLLM_KV_DTYPES.get(vllm)))
    return rows


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
    dtypes = checkpoint_kv_dtypes()
    for name, ours, theirs in dtypes:
        if ours != theirs:
            bad += 1
            print(f"DIFF  {name}: --kv-cache-dtype auto: kvsim {ours or 'the model dtype'} vs vLLM {theirs or 'the model dtype'}")
    asking = sum(1 for _, ours, _ in dtypes if ours)
    print(f"--kv-cache-dtype auto: {len(dtypes)} catalogue models compared, {asking} whose checkpoint asks for a KV dtype, "
          f"{sum(1 for _, a, b in dtypes if a != b)} with differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
