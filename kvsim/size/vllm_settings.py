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
