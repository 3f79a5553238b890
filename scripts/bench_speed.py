"""Benchmark: what prefix caching, async scheduling and the allocator cost kvsim, as ratios measured in one run.

    python3 scripts/bench_speed.py [--runs 3] [--only prefix,aisimulate,allocator,async]
        [--trace ../shared/traces/mooncake/conversation_trace.jsonl] [--nano-vllm DIR] [--json OUT]

Four measurements (issue 24), each the minimum of --runs runs (the machine is shared: the load is printed):

1. prefix: one paged-16 allocator with prefix caching against the same without it, accounting only, on the
   whole Mooncake conversation trace (workloads/mooncake-conversation.yaml's two allocators, one per replay),
   and on workloads/shared-prefix.yaml accounting only and with CPU tensors. Replay CPU seconds
   (`run_replay(..., workers=1)`, one allocator per call), and their ratio. Goal: <= 1.3x.
2. aisimulate: the Mooncake trace, paged-16 + prefix caching, accounting only, roofline, against NVIDIA's
   AISimulate (`pip install aisimulate==0.13.0.dev202610270000000085`) configured to the same pool
   (num_gpu_blocks), block size, max_num_seqs, max_num_batched_tokens, prefix caching, model and GPU
   (`database_mode: SOL`, its roofline). AISimulate has no watermark setting, so both run at watermark 0.
   Each side is timed as a whole command (wall and CPU of a child process, imports included); AISimulate's
   own engine time (`wall_time_ms`) is printed beside. Skipped with a message where it is not installed.
   Goal: kvsim at least 2x faster.
3. allocator: kvsim's PagedAllocator, nano-vllm's BlockManager and vLLM 0.33's KVCacheManager on one synthetic
   trace (kvsim.bench.allocator's shared-prefix stream: per request allocate, one append per decode token,
   free; prefix caching on; a pool that never preempts), block sizes 16 and 256. Thread CPU time of the
   allocator calls only (the driver between them is not counted; a request's block hashing is: vLLM's
   `Request` construction and token appends, which hash its blocks, are timed; kvsim's requests carry the
   replay's exact block keys, made inside its timed `allocate` as in a replay: the calls a replay makes;
   `--hash-token-ids` hashes their token ids instead). Each side's admissions, decode tokens and frees of a step
   are timed as spans, not call by call (a clock read costs ~0.4 µs, a token's whole cost on kvsim's side);
   the step's sampled tokens are looked up before vLLM's span. Each side's CPU seconds are also printed per
   kind of call (admissions / decode tokens / frees: where the time goes). nano-vllm's
   block_manager.py is loaded at run time from --nano-vllm (a checkout of GeeeekExplorer/nano-vllm; default
   ~/.cache/kvsim/nano-vllm), never copied here; vLLM's modules come from the conformance harness's cache.
   Goals: kvsim/nano <= 0.25, kvsim/vLLM <= 0.05.
4. async: workloads/poisson.yaml accounting only, every allocator in one process, with async scheduling (a
   workload's default) and with `scheduler: {async_scheduling: false}`, the two alternately; then the same on
   workloads/sliding-window.yaml (a sliding-window model) and on the Mooncake conversation trace, paged-16 +
   prefix caching. Replay CPU seconds, rows of the step records,
   and their ratio. Goal: <= 1.2x.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_TRACE = Path("shared") / "traces" / "mooncake" / "conversation_trace.jsonl"
DEFAULT_TRACE = next((p / _TRACE for p in REPO.parents if (p / _TRACE).is_file()), REPO.parent / _TRACE)
DEFAULT_NANO = Path.home() / ".cache" / "kvsim" / "nano-vllm"
AISIMULATE_PIN = "aisimulate==0.13.0.dev202610270000000085"
ME = "python3 scripts/bench_speed.py"


def load() -> str:
    return "load " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def best(runs: int, fn):
    """The minimum over `runs` calls of fn() -> dict of seconds (compared by its first value)."""
    results = []
    for _ in range(runs):
        gc.collect()
        results.append(fn())
    return min(results, key=lambda r: next(iter(r.values())))


# --- replays ------------------------------------------------------------------------------------------------


def _workload(name: str, trace: Path | None):
    from kvsim.workload.spec import load_workload

    return load_workload(REPO / "workloads" / name, trace=str(trace) if trace else None)


def time_replay(workload, *, tensors: bool) -> dict:
    """CPU and wall seconds of `run_replay(workload, workers=1)` in this process (imports already done)."""
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.run import run_replay

    options = ReplayOptions(tensors=tensors, device="cpu") if tensors else ReplayOptions(tensors=False)
    c0, w0 = time.process_time(), time.perf_counter()
    result = run_replay(workload, options, workers=1)
    c1, w1 = time.process_time(), time.perf_counter()
    run = result.runs[0]
    return {"cpu_s": c1 - c0, "wall_s": w1 - w0, "hit_tokens": run.prefix_hit_tokens,
            "preemptions": int(run.num_preemptions.sum()), "rows": len(next(iter(run.steps.values()))),
            "running_rows": int(sum(run.steps["num_running"]))}  # each row's running requests, summed: the loops' work


def one_allocator(workload, index: int, **scheduler):
    w = replace(workload, allocators=(workload.allocators[index],))
    return replace(w, scheduler=replace(w.scheduler, **scheduler)) if scheduler else w


def bench_prefix(args, out: list) -> None:
    cases = [("mooncake-conversation.yaml", args.trace, False), ("shared-prefix.yaml", None, False),
             ("shared-prefix.yaml", None, True)]
    for name, trace, tensors in cases:
        w = _workload(name, trace)
        plain = next(i for i, a in enumerate(w.allocators) if a.kind == "paged" and a.block_size == 16 and not a.prefix_caching)
        cached = next(i for i, a in enumerate(w.allocators) if a.kind == "paged" and a.block_size == 16 and a.prefix_caching)
        what = f"{name}{' (whole trace)' if trace else ''}, {'CPU tensors' if tensors else 'accounting only'}"
        t_plain = best(args.runs, lambda: time_replay(one_allocator(w, plain), tensors=tensors))
        t_cached = best(args.runs, lambda: time_replay(one_allocator(w, cached), tensors=tensors))
        ratio = t_cached["cpu_s"] / t_plain["cpu_s"]
        # Prefix hits change what is simulated: more requests may run at once, in fewer rows. The per-row loops
        # visit each running request, so CPU per running request per row separates that from caching's overhead.
        work = t_cached["running_rows"] / t_plain["running_rows"]
        row = {"item": 1, "what": f"prefix-cached / uncached replay, paged-16, {what}", "uncached": t_plain,
               "cached": t_cached, "ratio": ratio, "running_rows_ratio": work, "ratio_per_running_row": ratio / work,
               "goal": "<= 1.3", "command": f"{ME} --only prefix", "load": load()}
        out.append(row)
        print(f"[1] {row['what']}: uncached {t_plain['cpu_s']:.2f} CPU s ({t_plain['wall_s']:.2f} wall), "
              f"cached {t_cached['cpu_s']:.2f} CPU s ({t_cached['wall_s']:.2f} wall): {ratio:.2f}x  [{row['load']}]",
              flush=True)
        print(f"    running requests summed over rows, cached / uncached: {t_cached['running_rows']:,} / "
              f"{t_plain['running_rows']:,} = {work:.2f}x; CPU per running request per row: {ratio / work:.2f}x", flush=True)


def bench_async(args, out: list) -> None:
    cases = [("poisson.yaml", None, None, "workloads/poisson.yaml (five allocators)"),
             ("sliding-window.yaml", None, None, "workloads/sliding-window.yaml (Gemma 3 27B, three allocators)")]
    if args.trace.is_file():
        cases.append(("mooncake-conversation.yaml", args.trace, True, "the Mooncake conversation trace, paged-16+prefix"))
    else:
        print(f"[5] trace not found: {args.trace}; the Mooncake row is skipped", flush=True)
    for name, trace, cached, what in cases:
        w = _workload(name, trace)
        if cached:
            w = one_allocator(w, next(i for i, a in enumerate(w.allocators) if a.kind == "paged" and a.block_size == 16
                                      and a.prefix_caching))
        both = {False: [], True: []}
        for _ in range(args.runs):  # alternately: the machine's load drifts
            for async_scheduling in (False, True):
                gc.collect()
                both[async_scheduling].append(
                    time_replay_all(replace(w, scheduler=replace(w.scheduler, async_scheduling=async_scheduling))))
        t_sync, t_async = (min(both[a], key=lambda r: r["cpu_s"]) for a in (False, True))
        ratio = t_async["cpu_s"] / t_sync["cpu_s"]
        row = {"item": 5, "what": f"async / sync scheduling, {what}, accounting only", "sync": t_sync,
               "async": t_async, "ratio": ratio, "goal": "<= 1.2", "command": f"{ME} --only async", "load": load()}
        out.append(row)
        print(f"[5] {row['what']}: sync {t_sync['cpu_s']:.2f} CPU s ({t_sync['rows']} rows), async "
              f"{t_async['cpu_s']:.2f} CPU s ({t_async['rows']} rows): {ratio:.2f}x  [{row['load']}]", flush=True)
        if len(t_sync["rows_by_allocator"]) > 1:
            print("    rows, sync / async: " + ", ".join(f"{label} {n:,} / {t_async['rows_by_allocator'][label]:,}"
                                                   for label, n in t_sync["rows_by_allocator"].items()), flush=True)


def time_replay_all(workload) -> dict:
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.run import run_replay

    c0, w0 = time.process_time(), time.perf_counter()
    result = run_replay(workload, ReplayOptions(tensors=False), workers=1)
    c1, w1 = time.process_time(), time.perf_counter()
    by_allocator = {r.label: len(r.steps["step"]) for r in result.runs}
    return {"cpu_s": c1 - c0, "wall_s": w1 - w0, "rows": sum(by_allocator.values()), "rows_by_allocator": by_allocator}


# --- AISimulate ---------------------------------------------------------------------------------------------

AISIM_CONFIG = """\
traffic:
  source: {{type: trace, paths: [{trace}], format: mooncake, block_size: 512}}
  load: {{type: trace_timestamps}}
engine:
  model: {hf_id}
  hardware: {gpu}
  backend: vllm
  context_length: {max_model_len}
  workers:
    aggregated:
      scheduler: {{max_batched_tokens: {max_num_batched_tokens}, max_sequences: {max_num_seqs}}}
      kv_cache: {{block_size: {block_size}, prefix_caching: true, capacity: {{type: fixed, blocks: {num_gpu_blocks}}}}}
      timing: {{database_mode: SOL}}
"""


def _child(cmd: list[str]) -> dict:
    """Wall and CPU (user + sys) seconds of one child process; its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - w0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "stdout": proc.stdout}


def bench_aisimulate(args, out: list) -> None:
    if importlib.util.find_spec("aisimulate") is None:
        print(f"[2] AISimulate is not installed (pip install {AISIMULATE_PIN}): skipped; kvsim alone below", flush=True)
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.replay.run import run_replay  # noqa: F401  (imports before timing)

    w = _workload("mooncake-conversation.yaml", args.trace)
    cached = next(i for i, a in enumerate(w.allocators) if a.prefix_caching)
    w = one_allocator(w, cached, watermark=0.0)
    config = w.allocators[0]
    model, gpu = resolve_model(w.model), get_gpu(w.hardware)
    num_gpu_blocks = _num_gpu_blocks(w)
    tmp = Path(tempfile.mkdtemp(prefix="bench-speed-"))
    try:
        wl_path = tmp / "mooncake-prefix-wm0.yaml"
        import yaml

        raw = yaml.safe_load((REPO / "workloads" / "mooncake-conversation.yaml").read_text())
        raw["allocators"] = [{"kind": "paged", "block_size": config.block_size, "prefix_caching": True}]
        raw["scheduler"]["watermark"] = 0.0
        raw["requests"]["trace"]["path"] = str(args.trace.resolve())
        wl_path.write_text(yaml.safe_dump(raw, sort_keys=False))
        kv_cmd = [sys.executable, "-m", "kvsim", "replay", str(wl_path), "--no-tensors", "--quiet", "--json", "--out", str(tmp / "kvsim")]
        kv = best(args.runs, lambda: _child(kv_cmd))
        summary = json.loads(kv.pop("stdout"))
        kv_replay = best(args.runs, lambda: time_replay(w, tensors=False))
        row = {"item": 2, "what": "Mooncake conversation trace, paged-16 + prefix caching, watermark 0, accounting only, roofline",
               "num_gpu_blocks": num_gpu_blocks, "kvsim_command": kv, "kvsim_replay": kv_replay,
               "kvsim_summary": summary, "command": f"{ME} --only aisimulate", "load": load()}
        print(f"[2] kvsim: `python3 -m kvsim replay <workloads/mooncake-conversation.yaml, one paged-16+prefix allocator, "
              f"watermark 0> --no-tensors --trace {args.trace}`: {kv['wall_s']:.2f} s wall, {kv['cpu_s']:.2f} CPU s "
              f"(replay alone {kv_replay['wall_s']:.2f} s wall, {kv_replay['cpu_s']:.2f} CPU s); "
              f"hit tokens {kv_replay['hit_tokens']:,}, preemptions {kv_replay['preemptions']}; "
              f"num_gpu_blocks {num_gpu_blocks:,}  [{row['load']}]", flush=True)
        if importlib.util.find_spec("aisimulate") is not None:
            cfg = tmp / "aisimulate.yaml"
            cfg.write_text(AISIM_CONFIG.format(
                trace=args.trace.resolve(), hf_id=_aisim_model(model), gpu=_aisim_gpu(gpu), max_model_len=w.max_model_len,
                max_num_batched_tokens=w.scheduler.max_num_batched_tokens, max_num_seqs=w.scheduler.max_num_seqs,
                block_size=config.block_size, num_gpu_blocks=num_gpu_blocks))
            ai_cmd = [sys.executable, "-m", "aisimulate", "predict", "-c", str(cfg), "--output-dir", str(tmp / "aisim"),
                      "--overwrite", "--format", "json"]
            ai = best(args.runs, lambda: _child(ai_cmd))
            report = json.loads(ai.pop("stdout").strip().splitlines()[-1])
            ai["engine_wall_s"] = report.get("wall_time_ms", float("nan")) / 1e3
            ai["prefix_cache_reused_ratio"] = report.get("prefix_cache_reused_ratio")
            ai["first_admission_reused_ratio"] = report.get("first_admission_prefix_cache_reused_ratio")
            kv_ratio = kv_replay["hit_tokens"] / summary_prompt_tokens(w)
            row.update(aisimulate=ai, aisimulate_config=cfg.read_text(), ratio=kv["wall_s"] / ai["wall_s"],
                       kvsim_hit_ratio=kv_ratio)
            print(f"[2] AISimulate: `python3 -m aisimulate predict -c <config below> --format json`: {ai['wall_s']:.2f} s wall, "
                  f"{ai['cpu_s']:.2f} CPU s (its engine {ai['engine_wall_s']:.2f} s); prefix reuse at first admission "
                  f"{ai['first_admission_reused_ratio']:.4f} (all admissions {ai['prefix_cache_reused_ratio']:.4f}), "
                  f"kvsim's hit tokens / prompt tokens {kv_ratio:.4f}", flush=True)
            row["cpu_ratio"] = kv["cpu_s"] / ai["cpu_s"]
            print(f"[2] kvsim / AISimulate, whole commands: {row['ratio']:.2f}x wall, {row['cpu_ratio']:.2f}x CPU; "
                  f"kvsim's replay / AISimulate's engine: "
                  f"{kv_replay['wall_s'] / ai['engine_wall_s']:.2f}x  (goal: kvsim <= 0.5x)", flush=True)
            print("    AISimulate config:\n" + "\n".join("      " + line for line in cfg.read_text().splitlines()), flush=True)
        out.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def summary_prompt_tokens(w) -> int:
    from kvsim.workload.requests import generate_requests

    return sum(r.num_prompt_tokens for r in generate_requests(w))


def _num_gpu_blocks(w) -> int:
    """The replay's pool for `w`'s one paged allocator, in vLLM's count (block 0, the null block, included)."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.size.sizing import kv_cache_spec
    from kvsim.size.startup import vllm_kv_cache_memory

    model, gpu = resolve_model(w.model), get_gpu(w.hardware)
    budget = w.kv_budget_bytes or vllm_kv_cache_memory(model, gpu.reported_memory_bytes,
                                                       utilization=w.gpu_memory_utilization, device_name=gpu.name)
    spec = kv_cache_spec(model, kv_dtype=w.kv_dtype, block_size=w.allocators[0].block_size)
    return budget // spec.block_bytes


def _aisim_model(model) -> str:
    """AISimulate's bundled config for the model (it looks configs up by Hugging Face id, offline)."""
    return {"meta-llama/Llama-3.1-8B": "meta-llama/Meta-Llama-3.1-8B"}.get(model.hf_id, model.hf_id)


def _aisim_gpu(gpu) -> str:
    return {"h100-80gb": "h100_sxm", "h200-141gb": "h200_sxm", "a100-80gb": "a100_sxm"}.get(gpu.key, gpu.key)


# --- the allocator alone: kvsim, nano-vllm, vLLM -----------------------------------------------------------


def _load_nano(root: Path):
    """nano-vllm's block_manager and sequence modules, loaded from a checkout outside the repository."""
    import types

    files = {"sequence": root / "nanovllm" / "engine" / "sequence.py", "block_manager": root / "nanovllm" / "engine" / "block_manager.py"}
    if not all(p.is_file() for p in files.values()):
        return None
    pkg = types.ModuleType("nanovllm")
    pkg.__path__ = []
    eng = types.ModuleType("nanovllm.engine")
    eng.__path__ = []
    sp = types.ModuleType("nanovllm.sampling_params")

    class SamplingParams:  # what Sequence reads of it
        def __init__(self, temperature=1.0, max_tokens=64, ignore_eos=True):
            self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos

    sp.SamplingParams = SamplingParams
    sys.modules.update({"nanovllm": pkg, "nanovllm.engine": eng, "nanovllm.sampling_params": sp})
    mods = {}
    for name, path in files.items():
        spec = importlib.util.spec_from_file_location(f"nanovllm.engine.{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods


def _trace(num_requests: int, seed: int, block_keys: bool = True):
    from kvsim.bench.allocator import make_trace

    return make_trace(num_requests, seed, "shared-prefix", block_keys=block_keys)  # prompts U[64, 2048], outputs U[16, 1024]


def run_kvsim(trace, block_size: int, max_running: int) -> tuple[list[int], int]:
    from kvsim.engine.paged.unitary_kv_cache_manager import PagedAllocator
    from kvsim.size.kv_cache_spec import KVCacheSpec

    spec = KVCacheSpec.uniform(num_layers=32, num_kv_heads=8, head_dim=128, block_size=block_size)
    num_blocks = _pool_blocks(block_size, max_running)
    alloc = PagedAllocator(spec, num_blocks * spec.block_bytes, max_model_len=4096, enable_prefix_caching=True)
    cpu = time.thread_time_ns
    spent = [0, 0, 0]  # CPU ns: admissions, decode tokens, frees
    for seq in trace:
        seq.num_computed_tokens = 0
    waiting, running = list(reversed(trace)), []
    while waiting or running:
        t0 = cpu()
        while waiting and len(running) < max_running:
            seq = waiting.pop()
            assert alloc.allocate(seq, seq.num_prompt_tokens) is not None
            seq.num_computed_tokens = seq.num_prompt_tokens
            running.append(seq)
        t1 = cpu()
        assert alloc.append_decode_in_order(running) == len(running)  # the call the replay makes
        t2 = cpu()
        spent[0] += t1 - t0
        spent[1] += t2 - t1
        still, done = [], []
        for seq in running:
            seq.num_computed_tokens += 1
            (done if seq.num_computed_tokens >= seq.num_final_tokens else still).append(seq)
        t0 = cpu()
        for seq in done:
            alloc.free(seq)
        spent[2] += cpu() - t0
        running = still
    return spent, alloc.prefix_hit_tokens


def run_nano(nano, trace, block_size: int, max_running: int) -> tuple[list[int], int]:
    NanoSeq, BlockManager = nano["sequence"].Sequence, nano["block_manager"].BlockManager
    NanoSeq.block_size = block_size  # nano-vllm's class attribute, set from its Config
    bm = BlockManager(_pool_blocks(block_size, max_running), block_size)
    cpu = time.thread_time_ns
    spent, hits = [0, 0, 0], 0  # CPU ns: admissions, decode tokens, frees
    ids = {s.seq_id: s.token_ids.tolist() for s in trace}
    waiting, running = list(reversed(trace)), []
    while waiting or running:
        admitted = []
        while waiting and len(running) + len(admitted) < max_running:
            s = waiting.pop()
            seq = NanoSeq(ids[s.seq_id][: s.num_prompt_tokens])
            seq.kvsim = s
            admitted.append(seq)
        t0 = cpu()
        for seq in admitted:  # Scheduler.schedule's prefill
            n = bm.can_allocate(seq)
            assert n != -1
            bm.allocate(seq, n)
            hits += seq.num_cached_tokens
            seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
            bm.hash_blocks(seq)  # at once, as kvsim and vLLM cache a prompt's blocks at admission: the same hits
        t1 = cpu()
        for seq in running:  # Scheduler.schedule's decode
            assert bm.can_append(seq)
            seq.num_scheduled_tokens = 1
            bm.may_append(seq)
        for seq in running:  # Scheduler.postprocess's hashing
            bm.hash_blocks(seq)
        t2 = cpu()
        spent[0] += t1 - t0
        spent[1] += t2 - t1
        still, done = [], []
        for seq in admitted + running:
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            s = seq.kvsim
            seq.append_token(ids[s.seq_id][seq.num_tokens])
            (done if seq.num_tokens >= s.num_final_tokens else still).append(seq)
        t0 = cpu()
        for seq in done:
            bm.deallocate(seq)
        spent[2] += cpu() - t0
        running = still
    return spent, hits


def run_vllm(trace, block_size: int, max_running: int) -> tuple[list[int], int]:
    from kvsim.conformance.vllm_engine import EngineSetup, build_scheduler
    from kvsim.conformance.vllm_import import import_vllm

    setup = EngineSetup(num_gpu_blocks=_pool_blocks(block_size, max_running), block_size=block_size, num_layers=32,
                        num_kv_heads=8, head_size=128, kv_dtype="bf16", max_model_len=4096, max_num_seqs=max_running,
                        max_num_batched_tokens=1 << 20, watermark=0.0, reserve_full_isl=False,
                        enable_prefix_caching=True, async_scheduling=False)
    kvm = build_scheduler(setup).kv_cache_manager
    kvu, hashing = import_vllm("vllm.v1.core.kv_cache_utils"), import_vllm("vllm.utils.hashing")
    hash_fn = hashing.get_hash_fn_by_name("sha256")  # CacheConfig.prefix_caching_hash_algo's default
    kvu.init_none_hash(hash_fn)
    hasher = kvu.get_request_block_hasher(block_size, hash_fn)
    Request, SamplingParams = import_vllm("vllm.v1.request").Request, import_vllm("vllm.sampling_params").SamplingParams
    cpu = time.thread_time_ns
    spent, hits = [0, 0, 0], 0  # CPU ns: admissions, decode tokens, frees
    ids = {s.seq_id: s.token_ids.tolist() for s in trace}
    waiting, running = list(reversed(trace)), []
    while waiting or running:
        t0 = cpu()
        while waiting and len(running) < max_running:
            s = waiting.pop()
            req = Request(str(s.seq_id), ids[s.seq_id][: s.num_prompt_tokens],
                          SamplingParams(max_tokens=s.max_tokens, ignore_eos=True), None, block_hasher=hasher)
            blocks, num_hit, _ = kvm.get_computed_blocks(req)
            assert kvm.allocate_slots(req, s.num_prompt_tokens - num_hit, num_hit, blocks) is not None
            req.num_computed_tokens = s.num_prompt_tokens
            hits += num_hit
            req.kvsim = s
            running.append(req)
        spent[0] += cpu() - t0
        sampled = [ids[req.kvsim.seq_id][req.num_tokens] for req in running]  # the step's sampled tokens
        t0 = cpu()
        for req, token in zip(running, sampled):  # (its blocks hash as they fill: the request's block_hasher)
            req.append_output_token_ids(token)
            assert kvm.allocate_slots(req, 1) is not None
        spent[1] += cpu() - t0
        still, done = [], []
        for req in running:
            req.num_computed_tokens += 1
            (done if req.num_computed_tokens >= req.kvsim.num_final_tokens else still).append(req)
        t0 = cpu()
        for req in done:
            kvm.free(req)
        spent[2] += cpu() - t0
        running = still
    return spent, hits


def _pool_blocks(block_size: int, max_running: int) -> int:
    """Room for `max_running` requests of the longest length (2048 + 1024 tokens) and the null block: no preemption."""
    return max_running * -(-(2048 + 1024) // block_size) + 1


def _spans(spent: list[int]) -> dict:
    """A run's CPU nanoseconds per kind of call (admissions, decode tokens, frees) as seconds, their sum first."""
    return {"cpu_s": sum(spent) / 1e9, "phases_s": [t / 1e9 for t in spent]}


def _phase_text(r: dict) -> str:
    return " / ".join(f"{t:.3f}" for t in r["phases_s"])


def bench_allocator(args, out: list) -> None:
    nano = _load_nano(args.nano_vllm)
    if nano is None:
        print(f"[4] nano-vllm not found under {args.nano_vllm} (git clone https://github.com/GeeeekExplorer/nano-vllm "
              f"there, or --nano-vllm DIR; it needs xxhash): its column skipped", flush=True)
    try:
        from kvsim.conformance.vllm_import import import_vllm

        import_vllm("vllm.v1.core.kv_cache_manager")
        have_vllm = True
    except Exception as exc:  # noqa: BLE001  (the cache may be missing on this machine)
        print(f"[4] vLLM's modules could not be loaded ({exc}): its column skipped", flush=True)
        have_vllm = False
    for block_size in (16, 256):
        trace = _trace(args.alloc_requests, 0, block_keys=not args.hash_token_ids)
        row = {"item": 4, "what": f"allocator alone, block size {block_size}, prefix caching, {args.alloc_requests} requests "
                                  f"(shared-prefix stream), {args.alloc_running} running",
               "command": f"{ME} --only allocator", "load": None}
        k = best(args.runs, lambda: _spans(run_kvsim(trace, block_size, args.alloc_running)[0]))
        row.update(kvsim_cpu_s=k["cpu_s"], kvsim_phases_s=k["phases_s"])
        line = f"[4] block {block_size}: kvsim {k['cpu_s']:.3f} CPU s"
        phases = [f"kvsim {_phase_text(k)}"]
        if nano is not None:
            n = best(args.runs, lambda: _spans(run_nano(nano, trace, block_size, args.alloc_running)[0]))
            row.update(nano_cpu_s=n["cpu_s"], nano_phases_s=n["phases_s"], kvsim_over_nano=k["cpu_s"] / n["cpu_s"])
            line += f", nano-vllm {n['cpu_s']:.3f} ({row['kvsim_over_nano']:.3f}x, goal <= 0.25)"
            phases.append(f"nano-vllm {_phase_text(n)}")
        if have_vllm:
            v = best(args.runs, lambda: _spans(run_vllm(trace, block_size, args.alloc_running)[0]))
            row.update(vllm_cpu_s=v["cpu_s"], vllm_phases_s=v["phases_s"], kvsim_over_vllm=k["cpu_s"] / v["cpu_s"])
            line += f", vLLM {v['cpu_s']:.3f} ({row['kvsim_over_vllm']:.3f}x, goal <= 0.05)"
            phases.append(f"vLLM {_phase_text(v)}")
        line += "\n    admissions / decode tokens / frees, CPU s: " + "; ".join(phases)
        row["load"] = load()
        out.append(row)
        print(f"{line}  [{row['load']}]", flush=True)


def check_hits(args) -> None:
    """The three allocators see the same cache hits on the trace (a sanity check of the harness)."""
    nano = _load_nano(args.nano_vllm)
    for block_size in (16, 256):
        got = {"kvsim": run_kvsim(_trace(args.alloc_requests, 0), block_size, args.alloc_running)[1],
               "vLLM": run_vllm(_trace(args.alloc_requests, 0), block_size, args.alloc_running)[1]}
        if nano is not None:
            got["nano-vllm"] = run_nano(nano, _trace(args.alloc_requests, 0), block_size, args.alloc_running)[1]
        print(f"block {block_size}: prefix-hit tokens {got}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="take the minimum of this many runs of each figure")
    parser.add_argument("--only", default="prefix,aisimulate,allocator,async")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the Mooncake conversation trace")
    parser.add_argument("--nano-vllm", type=Path, default=DEFAULT_NANO, help="a checkout of GeeeekExplorer/nano-vllm")
    parser.add_argument("--alloc-requests", type=int, default=1000)
    parser.add_argument("--alloc-running", type=int, default=128)
    parser.add_argument("--hash-token-ids", action="store_true", help="[4] kvsim's requests carry token ids only (hashed), not block keys")
    parser.add_argument("--check-hits", action="store_true", help="print each allocator's prefix hits and stop")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()
    if args.check_hits:
        check_hits(args)
        return 0
    only = set(args.only.split(","))
    print(f"bench_speed: min of {args.runs} runs; {load()} at start; `uptime`: "
          f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    out: list = []
    if "prefix" in only:
        if args.trace.is_file():
            bench_prefix(args, out)
        else:
            print(f"[1] trace not found: {args.trace}", flush=True)
    if "aisimulate" in only:
        if args.trace.is_file():
            bench_aisimulate(args, out)
        else:
            print(f"[2] trace not found: {args.trace}", flush=True)
    if "allocator" in only:
        bench_allocator(args, out)
    if "async" in only:
        bench_async(args, out)
    print(f"bench_speed: done; {load()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
