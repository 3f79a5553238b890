"""The vLLM engine settings its KV cache sizing depends on (`vllm serve`'s defaults), checked once at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.errors import KvsimError
from kvsim.size.sizing import positive_int
from kvsim.vllm_version import VLLM_VERSION  # noqa: F401 (re-exported: size speaks of the release it follows)

# The smallest kernel block of vLLM's default attention backends on Hopper/Ampere: FlashAttention supports
# any multiple of 16, FlashInfer 16/32/64. vLLM aligns the raised hybrid block size to it.
DEFAULT_KERNEL_BLOCK_SIZE = 16
# vLLM's `mamba_cache_mode`: "none" (prefix caching off), "align" (prefix caching on: `vllm serve`'s default
# for hybrid models in 0.33, see `MambaModelConfig.verify_and_update_config`).
MAMBA_CACHE_MODES = ("none", "align")


@dataclass(frozen=True)
class VllmSettings:
    """The vLLM engine settings its KV cache sizing depends on (`vllm serve`'s defaults)."""

    max_num_batched_tokens: int = 8192
    async_scheduling: bool = True  # on by default in 0.33; --no-async-scheduling turns it off
    kernel_block_size: int = DEFAULT_KERNEL_BLOCK_SIZE
    mamba_cache_mode: str = "none"
    # align mode only: the token alignment of the state checkpoints every state layer exports from inside a
    # prefill (`get_mamba_prefill_checkpoint_alignment`); 0 when some layer exports none. vLLM 0.33's gated
    # delta net layers export them with FlashInfer's GDN prefill (Hopper; Blackwell with CUDA 13): 64.
    mamba_checkpoint_alignment: int = 0

    def __post_init__(self) -> None:
        positive_int(self.max_num_batched_tokens, "--max-num-batched-tokens")
        positive_int(self.kernel_block_size, "--kernel-block-size")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise KvsimError(
                f"expected one of {', '.join(MAMBA_CACHE_MODES)}, got {self.mamba_cache_mode!r}", field="--mamba-cache-mode"
            )
        if self.mamba_checkpoint_alignment:
            positive_int(self.mamba_checkpoint_alignment, "--mamba-checkpoint-alignment")
            if self.mamba_cache_mode != "align":
                raise KvsimError("state checkpoints exist only with --mamba-cache-mode align", field="--mamba-checkpoint-alignment")

    @property
    def mamba_state_blocks(self) -> int:
        """`MambaSpec.max_memory_usage_bytes` in pages: the running state, in align mode the cached one too,
        and a prefill checkpoint block where the layers export checkpoints (no speculative blocks)."""
        if self.mamba_cache_mode != "align":
            return 1
        return 2 + (1 if self.mamba_checkpoint_alignment else 0)

    @property
    def max_concurrent_batches(self) -> int:
        """`VllmConfig.max_concurrent_batches` without pipeline parallelism: 2 batches overlap with async scheduling."""
        return 2 if self.async_scheduling else 1

    @property
    def max_in_flight_tokens(self) -> int:
        """`VllmConfig.max_in_flight_tokens`: tokens scheduled but not yet settled, which a window keeps alive."""
        return self.max_concurrent_batches * self.max_num_batched_tokens


# GPUs of compute capability 9.0 (Hopper) in kvsim's catalogue: FlashInfer's gated-delta-net prefill runs there
# with no further condition (vLLM 0.33 `_resolve_gdn_prefill_backend`).
HOPPER_GPUS = ("h100-80gb", "h100-pcie", "h100-nvl", "h200", "h20", "gh200")
# vLLM 0.33 `FLASHINFER_GDN_CHECKPOINT_ALIGNMENT` (v1/attention/backends/gdn_attn.py)
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64
# Hugging Face model types whose state layers are gated delta nets (vLLM's `GatedDeltaNetAttention`)
GATED_DELTA_NET_NAMES = ("qwen3-next", "qwen3_next", "qwen3.5", "qwen3_5")
# ... and whose state layers are mamba2 mixers (vLLM's `MambaMixer2.get_kv_cache_spec`: one prefill checkpoint block
# at alignment 1 on every GPU, so align mode holds 3 state blocks a request)
MAMBA2_NAMES = ("nemotron-h", "nemotron_h", "falcon-h1", "falcon_h1", "bamba", "zamba2", "granite-4", "granitemoehybrid")


def serve_mamba_defaults(model, gpu_key: str | None) -> tuple[str, int, str]:
    """`vllm serve` 0.33's mamba_cache_mode and prefill checkpoint alignment for `model` on `gpu_key`, and why.

    - Prefix caching is on by default for a generative hybrid model (`ModelConfig.is_prefix_caching_supported`:
      attn_type "hybrid"), off for an attention-free one ("attention_free"); `MambaModelConfig.
      verify_and_update_config` then sets mamba_cache_mode align (on) or none (off).
    - In align mode a gated delta net layer exports prefill checkpoints (alignment 64) when its prefill kernel is
      FlashInfer's: on Hopper always; on Blackwell only with head_k_dim 128 and a CUDA 13 runtime, which kvsim
      does not assume (give --mamba-checkpoint-alignment 64 there); elsewhere Triton's (no checkpoints).
      Mamba2 mixers (Nemotron-H, Falcon-H1, Bamba, Zamba2, Granite-4) export a checkpoint at alignment 1 on
      every GPU; mamba1 (Jamba) none: alignment 0. Families are told by the model's name.
    """
    from kvsim.models.spec import LayerKind

    states = [layer for layer in model.layers if layer.kind == LayerKind.LINEAR_STATE]
    if not states:
        return "none", 0, ""
    if not any(layer.holds_tokens for layer in model.layers):
        return "none", 0, "an attention-free model: vllm serve leaves prefix caching off (mamba_cache_mode none)"
    names = " ".join(n.lower() for n in (model.name, model.hf_id or "", model.source or ""))
    gdn = any(n in names for n in GATED_DELTA_NET_NAMES)
    where = f"on {gpu_key}" if gpu_key else "with no --gpu"
    if any(n in names for n in MAMBA2_NAMES):
        return "align", 1, (
            f"vllm serve's defaults for a hybrid model {where}: prefix caching on (mamba_cache_mode align), mamba2 "
            "layers export their block-boundary state from inside a prefill (checkpoint alignment 1: 3 state blocks "
            "a request); --no-enable-prefix-caching for none")
    if gdn and gpu_key in HOPPER_GPUS:
        return "align", FLASHINFER_GDN_CHECKPOINT_ALIGNMENT, (
            f"vllm serve's defaults for a hybrid model {where}: prefix caching on (mamba_cache_mode align), gated "
            f"delta net prefill checkpoints every {FLASHINFER_GDN_CHECKPOINT_ALIGNMENT} tokens (FlashInfer's kernel "
            "on Hopper); --no-enable-prefix-caching for none")
    kernel = "" if not gdn else (" (gated delta net prefill by Triton's kernel off Hopper: no checkpoints)" if gpu_key
                                 else " (no --gpu: no gated delta net prefill checkpoints; 64 on Hopper)")
    return "align", 0, (f"vllm serve's defaults for a hybrid model {where}: prefix caching on (mamba_cache_mode "
                        f"align){kernel}; --no-enable-prefix-caching for none")
