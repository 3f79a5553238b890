"""Model and hardware facts: layer specs by kind (`spec`), the Hugging Face config.json reader (`hf_config` over
the `hf` family readers), the catalogue, the GPU table and the GPUs' links for tensor parallelism (`interconnect`), with their YAML data (`data/`). The bottom stage: it
may import only `kvsim.errors`, `kvsim.units` and `kvsim.vllm_version`.
"""
