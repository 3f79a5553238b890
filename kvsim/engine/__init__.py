"""The memory engine: allocators (flat and paged) behind one interface, and the real cache tensors."""
