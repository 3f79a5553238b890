"""`kvsim profile`: PyTorch's CUDA caching allocator under a naive per-request cache beside one paged pool
(`run`), and the request stream it replays (`stream`). Beside the stages: it may import any of them, and
nothing imports it but the CLI.
"""
