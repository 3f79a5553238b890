"""The memory engine: the allocator interface, the paged allocator (block pool, prefix caching, forks, vLLM's
hybrid groups) and the flat baselines (arena placement), the cache tensors with their kernels, integrity
patterns and timers. It may import `kvsim.models` and `kvsim.size` (the KV cache spec), nothing later.
"""
