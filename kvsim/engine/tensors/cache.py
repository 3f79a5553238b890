"""The real K/V pool: one torch tensor indexed by the allocators' slots, with timed writes, reads and swaps.

Byte accounting belongs to the allocators; this tensor only makes the memory traffic real. Materialise fewer
layers (or none: every method becomes a no-op) without changing any byte figure.
"""

from __future__ import annotations

import numpy as np
import torch

from kvsim.engine.tensors import kernels
from kvsim.engine.tensors.cache_read import CacheReads
from kvsim.engine.tensors.cache_swap import CacheSwaps
from kvsim.engine.tensors.cache_write import CacheWrites
from kvsim.engine.tensors.device import TORCH_DTYPES, free_memory_bytes, resolve_device, zeros_pool
from kvsim.engine.tensors.integrity import IntegrityPatterns
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.tensors.timing import StepTimer
from kvsim.errors import KvsimError
from kvsim.units import format_bytes

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}  # same-width integer view: copies and gathers move bits, never convert


class KVCache(CacheWrites, CacheReads, CacheSwaps):
    """The K/V pool of `num_slots` token slots over `num_layers` materialised layers (nano-vllm layout).

        kv_cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        kv_flat  [2, num_layers, num_blocks * block_size, num_kv_heads, head_dim]   (same memory)

    `num_blocks = ceil(num_slots / block_size)`, so a flat arena whose slot count is not a multiple of the
    block size fits too. Every write/read/swap/copy is timed into `timer` (µs per step and kind).

    Integrity mode writes token-unique bit patterns instead of random data and checks reads and `verify`
    against them (`patterns`, an `IntegrityPatterns`: the values follow each token's prefix fingerprint).

    This class builds the pool and its views and holds the copies; writes, reads and swaps are its mixins
    (`cache_write.CacheWrites`, `cache_read.CacheReads`, `cache_swap.CacheSwaps`).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_slots: int,
        *,
        device: str = "auto",
        num_layers: int = 1,
        integrity: bool = False,
        num_q_heads: int | None = None,
        write_kernel: str = "auto",
        seed: int = 0,
    ):
        if spec.dtype not in TORCH_DTYPES:
            raise KvsimError(f"kv dtype {spec.dtype!r} has no torch tensor type here", field="dtype")
        if num_layers < 0:
            raise KvsimError(f"materialised layers must be >= 0, got {num_layers}", field="num_layers")
        assert num_slots > 0
        self.spec = spec
        self.num_slots = num_slots
        self.block_size = spec.block_size
        self.num_blocks = -(-num_slots // spec.block_size)
        self.num_layers = num_layers
        self.integrity = integrity
        self.device = resolve_device(device)
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.num_q_heads = num_q_heads or spec.num_kv_heads
        self.timer = StepTimer(self.device, enabled=num_layers > 0)
        bits = 8 * torch.empty(0, dtype=self.dtype).element_size()
        self.patterns = IntegrityPatterns(num_layers, spec.num_kv_heads, spec.head_dim, bits, self.device)
        self._src = torch.empty(0)  # [2, L, cap, H, D] write data, grown on demand
        self._src_rows: np.ndarray | None = None  # the same buffer as numpy token rows [2L, cap] (CPU)
        self._read_buf: torch.Tensor | None = None  # (cap,) integer elements that reads gather into
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self.write_kernel = self._pick_write_kernel(write_kernel)
        self.kv_cache: torch.Tensor | None = None
        self.kv_flat: torch.Tensor | None = None
        if num_layers == 0:
            return
        free = free_memory_bytes(self.device)
        if self.nbytes > free:
            raise KvsimError(
                f"the KV pool needs {format_bytes(self.nbytes)} ({num_layers} layers x {self.num_blocks} blocks x "
                f"{spec.block_size} tokens x {spec.num_kv_heads} heads x {spec.head_dim} x K/V, {spec.dtype}) but "
                f"{self.device.type} has {format_bytes(free)} free; materialise fewer layers (--layers) or none "
                "(--no-tensors)",
                field="num_layers",
            )
        shape = (2, num_layers, self.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # zeros, not empty: padded reads touch unwritten slots, and garbage NaNs would poison masked attention
        self.kv_cache = zeros_pool(shape, self.dtype, self.device)
        self.kv_flat = self.kv_cache.view(2, num_layers, self.num_blocks * spec.block_size, *shape[4:])
        # Copies and gathers go through same-width integer views: bit-exact for every dtype, and on CPU
        # fp8 has no index_copy_ while bf16 index_select of 64-token blocks ran ~50x slower than int16.
        self._bits = _INT_VIEW[self.kv_cache.element_size()]
        self._cache_bits = self.kv_cache.view(self._bits)
        self._flat_bits = self.kv_flat.view(self._bits)
        # 3-D views for indexed copies along dim 1 (see kernels' module docstring for why)
        self._slot_rows = self._flat_bits.view(2 * num_layers, -1, spec.num_kv_heads * spec.head_dim)  # [2L, S, H*D]
        self._block_rows = self._cache_bits.view(2 * num_layers, self.num_blocks, -1)  # [2L, num_blocks, bs*H*D]
        # The pool as numpy token rows, for the CPU's write kernel (`kernels.scatter_rows`)
        self._token_rows = kernels.token_rows(self.kv_flat) if self.device.type == "cpu" else None

    @property
    def nbytes(self) -> int:
        """Bytes of the materialised pool (0 when accounting only); not the simulated budget."""
        s = self.spec
        return 2 * self.num_layers * self.num_blocks * s.block_size * s.num_kv_heads * s.head_dim * self.dtype.itemsize

    @property
    def enabled(self) -> bool:
        """False for an accounting-only cache (num_layers=0): every method is then a no-op."""
        return self.kv_cache is not None

    def _index(self, values) -> torch.Tensor:
        """An int64 index tensor on the device from any int sequence or array (same shape).

        On CUDA the indices are staged in pinned memory: a copy from pageable memory may make the driver wait
        for the stream's queued kernels (a host sync in the step loop); a pinned one is queued and returns, and
        the caching host allocator keeps the staging block until the copy has run.
        """
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    # --- integrity bookkeeping (IntegrityPatterns) ----------------------------------------------------
    def register(self, seq_id: int, token_ids: np.ndarray) -> None:
        """Tell integrity mode the token ids of `seq_id` (prompt + output), so values follow token content.

        A request never registered gets values derived from (seq_id, position): still token-unique, but
        then another request reading its blocks through the prefix cache would (rightly) fail `verify`.
        """
        if self.integrity:
            self.patterns.register(seq_id, token_ids)

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's fingerprints (its blocks may stay cached for others)."""
        self.patterns.forget(seq_id)

    # --- copy-on-write ---------------------------------------------------------------------------------
    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """kv_flat[..., dst[i], ...] = kv_flat[..., src[i], ...] for all layers: timed as "copy"."""
        if not self.enabled or len(src) == 0:
            return
        assert len(src) == len(dst)
        s, d = self._index(src), self._index(dst)
        with self.timer.measure("copy"):
            self._slot_rows.index_copy_(1, d, self._slot_rows.index_select(1, s))

    def copy_blocks(self, pairs: list[tuple[int, int]] | np.ndarray) -> None:
        """Copy whole blocks (src_block, dst_block), e.g. copy-on-write of a shared partial block: timed "copy".

        Every source is read before any destination is written (a pair's source may be another's destination;
        destinations must be distinct).
        """
        if not self.enabled or len(pairs) == 0:
            return
        p = self._index(np.asarray(pairs, dtype=np.int64).reshape(-1, 2))
        with self.timer.measure("copy"):
            self._block_rows.index_copy_(1, p[:, 1], self._block_rows.index_select(1, p[:, 0]))
