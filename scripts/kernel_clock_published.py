"""A published vLLM serving run on one H100, replayed on the kernels-db clock and on the roofline.

    python3 scripts/kernel_clock_published.py

The measurement: Lambda's vLLM benchmark (github.com/LambdaLabsML/vllm-benchmark,
results/prompt_10/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json, 2024-09-07): vLLM's
benchmark_serving.py, 10 ShareGPT prompts sent at once (request_rate inf) to meta-llama/Meta-Llama-3-8B-Instruct
(the same shapes as Llama-3.1-8B) on one H100 80GB SXM. Its per-request prompt and output lengths are copied
below; it reports mean TTFT 62.43 ms and median TPOT 7.56 ms (TPOT = (latency - TTFT) / (output tokens - 1)).

kvsim replays the same 10 requests (arriving together; max_tokens = output_len, so output_len - 1 decode steps
follow the token the prefill samples) on llama-3.1-8b, h100-80gb, and prints the same two statistics on both
clocks, TPOT as requests.csv has it (the same definition).
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

INPUT_LENS = [13, 25, 27, 10, 329, 29, 399, 328, 4, 205]
OUTPUT_LENS = [120, 429, 233, 194, 101, 741, 9, 3, 6, 31]
MEASURED = {"mean_ttft_ms": 62.43, "median_tpot_ms": 7.56}

WORKLOAD = """\
name: lambda-h100-llama3-8b
seed: 0
model: llama-3.1-8b
kv_dtype: bf16
hardware: h100-80gb
gpu_memory_utilization: 0.9
max_model_len: 2048
requests: {{trace: {trace}}}
allocators:
  - {{kind: paged, block_size: 16}}
scheduler: {{max_num_seqs: 256, max_num_batched_tokens: 8192, preemption: recompute}}
"""


def main() -> int:
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.reports import requests_frame
    from kvsim.workload.spec import load_workload

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "lambda.jsonl"
        trace.write_text("".join(json.dumps({"arrival_time": 0.0, "prompt_tokens": p, "output_tokens": o}) + "\n"
                                 for p, o in zip(INPUT_LENS, OUTPUT_LENS)))
        path = Path(tmp) / "lambda.yaml"
        path.write_text(WORKLOAD.format(trace=trace))
        workload = load_workload(path)
        print("| clock | mean TTFT ms | vs measured | median TPOT ms | vs measured |")
        print("|---|---:|---:|---:|---:|")
        print(f"| measured (vLLM 0.6.0, Lambda) | {MEASURED['mean_ttft_ms']:.2f} | | {MEASURED['median_tpot_ms']:.2f} | |")
        for timing in ("kernels-db", "roofline"):
            result = run_replay(workload, ReplayOptions(tensors=False, timing=timing), workers=1)
            frame = requests_frame(result)  # the report's TTFT and TPOT, one row per request
            ttft = float(frame["ttft_s"].mean()) * 1e3
            tpot = float(frame["tpot_s"].median()) * 1e3
            print(f"| {result.clock} | {ttft:.2f} | {ttft / MEASURED['mean_ttft_ms'] - 1:+.0%} | {tpot:.2f} "
                  f"| {tpot / MEASURED['median_tpot_ms'] - 1:+.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
