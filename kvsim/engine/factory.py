"""Allocator configurations (as a workload names them) and the one place that builds allocators from them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from kvsim.engine.allocator import KVAllocator
from kvsim.size.kv_cache_spec import KVCacheSpec



@dataclass(frozen=True)
class AllocatorConfig:
    """One allocator under test: `{kind: paged, block_size: 16, prefix_caching: true}` in a workload.

    Flat: `reserve` (max = max_model_len tokens, pow2 = next power of two >= num_final_tokens, oracle =
    exactly num_final_tokens) and `placement` of slabs in the arena. Paged: `block_size` (tokens per block),
    `prefix_caching`, `watermark` (fraction of blocks kept free at admission).

    Left out of a workload (None), `prefix_caching` and `mamba_checkpoint_alignment` are what vllm serve uses for
    the model on the GPU (`with_serve_defaults`): prefix caching on for a hybrid model (mamba_cache_mode align,
    with its state layers' prefill checkpoint alignment, 64 for a gated delta net on Hopper), off otherwise.
    """

    kind: Literal["flat", "paged"]
    block_size: int = 16
    reserve: Reserve = "max"
    placement: Placement = "first-fit"
    prefix_caching: bool | None = None  # None: vllm serve's for the model (`with_serve_defaults`)
    watermark: float = 0.0
    # vLLM's `prefix_cache_retention_interval` (its default 0: a sliding-window group caches only the blocks a
    # replay of the prompt or a shared-prefix junction can hit; None: every full block; k: every k tokens too)
    prefix_cache_retention_interval: int | None = 0
    # align mode (a hybrid model with prefix caching): the token alignment at which the state layers export a
    # prefill checkpoint from inside a chunk (0: none; None: vllm serve's for the model and GPU)
    mamba_checkpoint_alignment: int | None = None
    # the workload's own `mamba_cache_mode` (already read into prefix_caching), kept to check it applies to the model
    given_mamba_cache_mode: str | None = field(default=None, compare=False)

    def with_serve_defaults(self, model, gpu_key: str | None) -> AllocatorConfig:
        """This configuration with what the workload leaves out set as `vllm serve` 0.33 sets it for `model` on
        `gpu_key` (`kvsim.size.vllm_settings.serve_mamba_defaults`, the defaults `kvsim size` prints): prefix
        caching on for a hybrid model in mamba_cache_mode align with the GPU's checkpoint alignment, off (kvsim's
        default) for the others; `prefix_caching: false` on a hybrid model is mamba_cache_mode none."""
        if self.kind != "paged":
            return self
        from kvsim.size.vllm_settings import serve_mamba_defaults

        mode, alignment, _ = serve_mamba_defaults(model, gpu_key)
        from kvsim.models.spec import LayerKind

        if self.given_mamba_cache_mode is not None and not any(l.kind == LayerKind.LINEAR_STATE for l in model.layers):
            from kvsim.errors import KvsimError

            raise KvsimError(f"{model.name} has no state layers (mamba, gated delta net), and vLLM ignores the mode "
                             "there: set prefix_caching instead", field="mamba_cache_mode")
        caching = (mode == "align") if self.prefix_caching is None else self.prefix_caching
        align = caching and mode == "align"
        given = self.mamba_checkpoint_alignment
        if given and not align:
            from kvsim.errors import KvsimError

            raise KvsimError("state checkpoints exist only for a hybrid model with prefix caching (mamba_cache_mode "
                             "align)", field="mamba_checkpoint_alignment")
        return replace(self, prefix_caching=caching, mamba_checkpoint_alignment=(alignment if given is None else given) if align else 0)

    @property
    def mamba_cache_mode(self) -> str:
        """vLLM's mamba_cache_mode for a hybrid model under this configuration: align with prefix caching."""
        return "align" if self.kind == "paged" and self.prefix_caching else "none"

    @property
    def label(self) -> str:
        """A short unique name for tables and report rows, e.g. 'paged-16+prefix', 'flat-max' or, with a
        watermark other than the default 0 (vLLM's), 'paged-16-wm0.05' (so two watermarks can be compared)."""
        if self.kind == "flat":
            suffix = "" if self.placement == "first-fit" else f"-{self.placement}"
            return f"flat-{self.reserve}{suffix}"
        watermark = "" if self.watermark == 0.0 else f"-wm{self.watermark:g}"
        prefix = ""
        if self.prefix_caching:  # a retention interval other than vLLM's default 0 is named: -dense (None), -r<k>
            interval = self.prefix_cache_retention_interval
            prefix = "+prefix" + ("-dense" if interval is None else f"-r{interval}" if interval else "")
        return f"paged-{self.block_size}{watermark}{prefix}"


def make_allocator(config: AllocatorConfig, spec: KVCacheSpec, budget_bytes: int, *, max_model_len: int) -> KVAllocator:
    """Build the allocator `config` describes over `budget_bytes` of KV memory for `spec`: a paged one over
    vLLM's KV cache groups when `spec.pool` carries them (a mixed model), else over its one group."""
    assert spec.block_size == config.block_size or config.kind == "flat"
    if config.kind == "paged" and spec.pool is not None:
        from kvsim.engine.paged.kv_cache_manager import HybridPagedAllocator

        return HybridPagedAllocator(
            spec,
            budget_bytes,
            max_model_len=max_model_len,
            watermark=config.watermark,
            enable_prefix_caching=bool(config.prefix_caching),
            prefix_cache_retention_interval=config.prefix_cache_retention_interval,
            mamba_checkpoint_alignment=config.mamba_checkpoint_alignment or 0,
        )
    if config.kind == "paged":
        from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator

        assert spec.is_uniform, "a mixed model's spec carries vLLM's groups (kvsim.size.vllm_pool.with_pool)"
        if config.prefix_cache_retention_interval:
            from kvsim.errors import KvsimError

            raise KvsimError(f"is {config.prefix_cache_retention_interval} but this model has no sliding-window "
                             "layer group, so retention has no effect (vLLM refuses it): set it to 0",
                             field="prefix_cache_retention_interval")
        return PagedAllocator(
            spec,
            budget_bytes,
            max_model_len=max_model_len,
            enable_prefix_caching=bool(config.prefix_caching),
            watermark=config.watermark,
        )
    from kvsim.engine.flat.flat_allocator import FlatAllocator

    return FlatAllocator(spec, budget_bytes, max_model_len=max_model_len, reserve=config.reserve, placement=config.placement)
