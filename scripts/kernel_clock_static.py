"""Static batches on the kernels-db clock against aiconfigurator's own static estimate (its SDK's static mode).

    python3 scripts/kernel_clock_static.py [--hardware h100-80gb] [--isl 1024] [--osl 128]
        [--models llama-3.1-8b,qwen3-32b,qwen3-30b-a3b,deepseek-v3] [--batches 1,4,16,64,256] [--tp 1,2,4,8] [--ep]

For each model and batch size B: a kvsim replay (accounting only) of B requests all arriving at t=0, each with
`isl` prompt tokens and max_tokens = `osl` (the prefill samples the first token, so `osl - 1` decode steps follow,
as aiconfigurator's `osl` tokens take `osl - 1` generation steps), with max_num_batched_tokens = B * isl and
max_num_seqs = B so the whole batch prefills in one step as in a static batch, and a KV budget that holds it all.
kvsim's mean TTFT and TPOT (requests.csv's: (finished - first token) / (output tokens - 1)) are printed beside
`EngineHandle.run_static(batch_size=B, isl, osl)` (TTFT = its context ms, TPOT = its generation ms / (osl - 1))
and the difference in %. Markdown table on stdout.

`--tp 1,2,4,8` repeats it at each tensor-parallel size (the workload's `deployment: {tp}`, its KV budget one
rank's), against the SDK's engine compiled at the same tp (MoE experts split by tp; with `--ep` over tp ranks
of expert parallelism instead); a tp that does not suit a model's heads is skipped and said.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

WORKLOAD = """\
name: static-b{batch}
seed: 0
model: {model}
kv_dtype: bf16
hardware: {hardware}
kv_budget: {budget}
max_model_len: {max_model_len}
deployment: {{tp: {tp}, ep: {ep}}}
requests:
  count: {batch}
  arrival: {{process: burst, size: {batch}, every_s: 1000000}}
  prompt_tokens: {{dist: constant, value: {isl}}}
  output_tokens: {{dist: constant, value: {osl}}}
allocators:
  - {{kind: paged, block_size: 16}}
scheduler: {{max_num_seqs: {batch}, max_num_batched_tokens: {tokens}, preemption: recompute}}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h100-80gb")
    parser.add_argument("--models", default="llama-3.1-8b,qwen3-32b,qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--isl", type=int, default=1024)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--ep", action="store_true", help="MoE experts over the tp ranks (expert parallelism)")
    parser.add_argument("--roofline-hardware", default=None,
                        help="also replay each batch on the roofline of this GPU (e.g. a100-40gb) and print its TTFT/TPOT")
    args = parser.parse_args()

    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.clock.kernels_db import kernel_clock
    from kvsim.replay.run import run_replay
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.reports import requests_frame
    from kvsim.size.sizing import kv_cache_spec
    from kvsim.errors import KvsimError
    from kvsim.workload.spec import load_workload

    logging.disable(logging.WARNING)

    def replay_static(name: str, hardware: str, batch: int, timing: str, tp: int = 1, ep: int = 1) -> tuple[float, float]:
        """Mean TTFT and TPOT (ms) of `batch` identical requests arriving together, replayed on `timing`."""
        per_token = kv_cache_spec(resolve_model(name), kv_dtype="bf16", tp=tp).bytes_per_token  # one rank's
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "static.yaml"
            max_len = args.isl + args.osl
            path.write_text(WORKLOAD.format(
                batch=batch, model=name, hardware=hardware, isl=args.isl, osl=args.osl,
                tokens=batch * args.isl, max_model_len=max_len, budget=2 * batch * (max_len + 16) * per_token, tp=tp, ep=ep,
            ))
            result = run_replay(load_workload(path), ReplayOptions(tensors=False, timing=timing), workers=1)
        run = result.runs[0]
        assert not any(run.rejected_reason) and not run.num_preemptions.any(), (name, batch)
        frame = requests_frame(result)  # the report's TTFT and TPOT, one row per request
        return float(frame["ttft_s"].mean()) * 1e3, float(frame["tpot_s"].mean()) * 1e3

    gpu = get_gpu(args.hardware)
    print(f"isl {args.isl}, osl {args.osl}, {gpu.name}; aiconfigurator = EngineHandle.run_static(batch_size=B, "
          f"isl={args.isl}, osl={args.osl}) (static mode) of the engine compiled at the same tp"
          f"{' (MoE experts over ep = tp)' if args.ep else ''}\n")
    print("| model | tp | B | kvsim TTFT ms | aic TTFT ms | diff | kvsim TPOT ms | aic TPOT ms | diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for name in args.models.split(","):
        model = resolve_model(name)
        for tp in (int(t) for t in args.tp.split(",")):
            ep = tp if args.ep else 1
            try:
                kv_cache_spec(model, tp=tp)
                clock = kernel_clock(model, gpu, tp=tp, ep=ep)
            except KvsimError as exc:
                print(f"| {name} | {tp} | skipped: {exc} |||||||")
                continue
            handle = clock._handle  # the SDK's compiled engine for the same model, system, vLLM version and tp
            for batch in (int(b) for b in args.batches.split(",")):
                context_ms, generation_ms, _ = handle.run_static(batch_size=batch, isl=args.isl, osl=args.osl)
                aic_ttft, aic_tpot = context_ms, generation_ms / (args.osl - 1)
                ttft, tpot = replay_static(name, args.hardware, batch, "kernels-db", tp, ep)
                d_ttft, d_tpot = ttft / aic_ttft - 1, tpot / aic_tpot - 1
                worst = max(worst, abs(d_ttft), abs(d_tpot))
                extra = ""
                if args.roofline_hardware:
                    r_ttft, r_tpot = replay_static(name, args.roofline_hardware, batch, "roofline", tp)
                    extra = f" roofline on {args.roofline_hardware}: TTFT {r_ttft:.2f} ms, TPOT {r_tpot:.3f} ms |"
                print(f"| {name} | {tp} | {batch} | {ttft:.2f} | {aic_ttft:.2f} | {d_ttft:+.1%} | {tpot:.3f} | {aic_tpot:.3f} "
                      f"| {d_tpot:+.1%} |{extra}", flush=True)
    print(f"\nlargest difference: {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
