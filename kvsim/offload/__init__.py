"""The CPU tier's bookkeeping as vLLM 0.33.0's scheduler side keeps it: `CPUOffloadingManager` (chunk pool,
ref counts, all-or-nothing stores) over a `CachePolicy` (LRU or ARC), with vLLM's vocabulary (offload keys,
lookup / prepare_load / complete_load / prepare_store / complete_store / on_request_finished).

Pure Python, no torch. It may import `kvsim.errors` only; the replay (a later stage) drives it.
`kvsim.conformance.offload_check` runs vLLM's own manager beside it and compares every step.
"""
