"""A workload: the YAML file and its validated fields (`spec`, `yaml_fields`), length and arrival
distributions, trace formats (`traces`, `trace_mooncake`), and the request stream with its token ids
(`requests`). It may import `kvsim.models`, `kvsim.size` and `kvsim.engine` (allocator configurations), nothing
later.
"""
