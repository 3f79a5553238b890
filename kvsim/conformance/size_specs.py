"""vLLM 0.33.0's side of the size check: its modules, a stand-in VllmConfig, and its per-layer KV cache specs
built from kvsim's layer list (the block size and state padding as kvsim computed them).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import replace
from types import SimpleNamespace

from kvsim.errors import KvsimError
from kvsim.models import LayerKind, ModelSpec
from kvsim.vllm_sizing import VllmSettings

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn", "int8": "int8"}
_STATE_DTYPES = {2: "bfloat16", 4: "float32"}  # by bytes per element


def vllm_modules():
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


def vllm_config(v, settings: VllmSettings, max_model_len: int, tp: int):
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


def spec_kind(v, spec) -> str:
    kinds = (
        (v.kvi.SlidingWindowSpec, "sliding"), (v.kvi.MLAAttentionSpec, "mla"), (v.kvi.FullAttentionSpec, "full"),
        (v.kvi.ChunkedLocalAttentionSpec, "chunked"), (v.kvi.MambaSpec, "state"),
    )
    for cls, kind in kinds:
        if isinstance(spec, cls):
            return kind
    return type(spec).__name__
