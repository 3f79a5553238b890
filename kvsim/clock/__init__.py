"""Step-time models shared by the replay and `kvsim size --gpu`: the roofline (peak bandwidth and FLOP/s) and
the kernels-db clock (vLLM's kernels measured on real GPUs). It may import `kvsim.models`, nothing later.
"""
