"""No model the replay serves loses vLLM's KV cache groups: every catalogue model and every config family kvsim
reads gets the paged pool vLLM 0.33.0 would build (a mixed model) or is uniform (one group), and a model whose
groups vLLM's arithmetic cannot build stops with a KvsimError, never a replay on another layout."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvsim.engine.factory import AllocatorConfig, make_allocator
from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator
from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
from kvsim.errors import KvsimError
from kvsim.models.catalogue import catalogue_models
from kvsim.models.hf_config import load_hf_config
from kvsim.size.sizing import kv_cache_spec
from kvsim.size.vllm_pool import with_pool
from kvsim.size.vllm_settings import VllmSettings

BUDGET, MAX_MODEL_LEN = 8 << 30, 4096


def _family_configs() -> dict[str, dict]:
    """The config.json of every family kvsim reads, as tests/models/test_hf_families.py holds them."""
    path = Path(__file__).parents[1] / "models" / "test_hf_families.py"
    spec = importlib.util.spec_from_file_location("hf_families", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    configs = {k: v for k, v in vars(module).items() if k.isupper() and isinstance(v, dict) and "model_type" in v}
    assert len(configs) >= 10, sorted(configs)  # the families are still there to check
    return configs


FAMILIES = _family_configs()


def _check_groups(model) -> None:
    spec = kv_cache_spec(model, kv_dtype="bf16", block_size=16)
    pooled = with_pool(model, spec, BUDGET, MAX_MODEL_LEN, VllmSettings())
    if all(g.kind == "state" for g in spec.groups):  # attention-free: no block table for the paged replay
        assert [g.kind for g in pooled.pool.groups] == ["state"]
        with pytest.raises(KvsimError, match="attention"):
            make_allocator(AllocatorConfig("paged"), pooled, BUDGET, max_model_len=MAX_MODEL_LEN)
        return
    alloc = make_allocator(AllocatorConfig("paged"), pooled, BUDGET, max_model_len=MAX_MODEL_LEN)
    if spec.is_uniform:
        assert pooled is spec and isinstance(alloc, PagedAllocator)
    else:
        assert pooled.pool is not None and pooled.pool.groups and isinstance(alloc, HybridPagedAllocator)
        kinds = {g.kind for g in spec.groups}
        assert kinds <= {g.kind if g.kind != "mla" else "full" for g in pooled.pool.groups}, model.name


@pytest.mark.parametrize("model", catalogue_models(), ids=lambda m: m.name)
def test_every_catalogue_model_keeps_vllms_groups(model):
    _check_groups(model)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_config_family_keeps_vllms_groups(name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FAMILIES[name]))
    _check_groups(load_hf_config(path))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("failure", ["no groups", "not modelled"])
def test_groups_vllm_cannot_build_are_an_error_naming_the_layers_and_the_file(tmp_path, monkeypatch, failure, tp):
    """Where vLLM's arithmetic builds no groups for a mixed model (it cannot unify the pages) or kvsim does not
    model it: one line naming the layer kinds and the model's file, not a replay on some other layout; at any
    tensor parallelism (one rank's pool)."""
    import kvsim.size.vllm_pool as vllm_pool

    def startup(*args, **kwargs):
        if failure == "no groups":
            return None
        raise KvsimError("vLLM 0.33.0's KV cache arithmetic for 'linear' layers is not modelled", field="layers")

    monkeypatch.setattr(vllm_pool, "vllm_startup", startup)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FAMILIES["GEMMA4"]))
    model = load_hf_config(path)
    spec = kv_cache_spec(model, kv_dtype="bf16", block_size=16, tp=tp)
    with pytest.raises(KvsimError) as err:
        with_pool(model, spec, BUDGET, MAX_MODEL_LEN, VllmSettings(), tp)
    message = str(err.value)
    assert message.startswith(str(model.source or model.name))
    assert ("full, sliding" in message) if failure == "no groups" else ("'linear' layers" in message)
