"""The KV cache tensors an allocator's slots index: the pool and its writes, reads and swaps (`cache.py`,
`cache_write.py`, `cache_read.py`, `cache_swap.py`), the kernels (`kernels.py`, the Triton store in
`triton_store.py`), devices (`device.py`), integrity patterns (`integrity.py`) and step timers (`timing.py`).
Knows no allocator: it is given slots. May import `size` and `units`."""
