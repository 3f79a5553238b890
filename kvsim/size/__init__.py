"""What KV cache costs: bytes per token, block and sequence (`sizing`), the spec allocators are built from
(`kv_cache_spec`), vLLM's start-up arithmetic (`vllm`), the pool tensor's layout, and `kvsim size`'s report
and tables. It may import `kvsim.models` and `kvsim.clock`, nothing later.
"""
