"""`kvsim cache-curve`: the exact prefix-cache hit rate of an LRU cache of blocks at every capacity, in one
pass over a request stream (`curve`), the block units it walks (`blocks`) and its table (`view`). Beside the
replay: it may import `models`, `size`, `workload` (and `plots` from its view), not the replay.
"""
