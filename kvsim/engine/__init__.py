"""The memory engine: the allocator interface (`allocator.py`), a request's state (`sequence.py`) and the one place
allocators are built (`factory.py`); the paged allocators laid out as vLLM's `v1/core` (`paged/`), the flat
baselines (`flat/`), and the cache tensors with their kernels, integrity patterns and timers (`tensors/`).
It may import `kvsim.models` and `kvsim.size` (the KV cache spec), nothing later.
"""
