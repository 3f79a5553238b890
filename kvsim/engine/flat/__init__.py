"""The flat baselines: one contiguous slab per request (`flat_allocator.py`) in an arena with first-fit,
best-fit or buddy placement (`arena.py`). May import `kvsim.engine.allocator`, `kvsim.engine.sequence` and `size`."""
