"""The vLLM release whose v1 scheduler and KV-cache manager kvsim's replay follows, step for step."""

VLLM_VERSION = "0.33.0"
SCHEDULER_FOLLOWS = f"vLLM v1 {VLLM_VERSION}"  # as reports name it: "scheduler: vLLM v1 0.33.0"
