"""Conformance against vLLM 0.33.0: its own scheduler and KV cache manager, run beside kvsim's replay.

Owns the wheel cache (vllm_wheel), the stub loader (vllm_import) and the comparison; imports kvsim's
logic modules, never the CLI.
"""
