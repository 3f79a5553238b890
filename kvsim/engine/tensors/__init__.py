"""The KV cache tensors an allocator's slots index: the pool and its writes, reads and swaps (`cache.py`), the kernels (`kernels.py`, the Triton store in
`triton_store.py`), devices (`device.py`), integrity patterns (`integrity.py`) and step timers (`timing.py`).
Knows no allocator: it is given slots. May import `size` and `units`."""
