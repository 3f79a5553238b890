"""Benchmarks of kvsim's own machinery (`kvsim bench ...`): the allocators' CPU cost, later the kernels."""
