"""The paged allocators, laid out as vLLM 0.33.0's `v1/core`: the one block pool of every KV cache group
(`block_pool.py`, blocks as ints in arrays), a block's one identity for prefix caching (`kv_cache_utils.py`), one manager per KV cache group (`single_type_kv_cache_manager.py`), the coordinator over
them with prefix caching across groups (`kv_cache_coordinator.py`), vLLM's `KVCacheManager`
over the groups (`kv_cache_manager.py`), and its single-group fast path for uniform models
(`unitary_kv_cache_manager.py`). May import `kvsim.engine.allocator`, `kvsim.engine.sequence` and `size`."""
