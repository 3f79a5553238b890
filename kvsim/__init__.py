"""kvsim: KV-cache sizing, paged-allocator simulation and real GPU measurements."""

__version__ = "0.1.0"
