"""`kvsim cache-curve`: the exact prefix-cache hit rate of an LRU cache of blocks at every capacity, in one
pass over a request stream (`curve`), the block units it walks (`blocks`) and its table (`view`); with
`--cpu-capacities`, vLLM's CPU tier below it (`two_tier`, checked against the chunk-by-chunk `two_tier_sim`,
shown by `view_tiers`). Beside the replay: it may import `models`, `size`, `offload`, `workload` (and `plots`
from its views), not the replay.
"""
