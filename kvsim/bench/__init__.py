"""`kvsim bench`: the allocator's CPU cost per decode token, and the cache kernels (write, gather, decode
attention, paged FlexAttention) against the roofline measured in the same run. Beside the stages: it may
import any of them, and nothing imports it but the CLI.
"""
