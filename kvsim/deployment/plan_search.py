"""`kvsim plan`'s search: the grid's deployments in order of GPU count, replayed through a pool of workers,
skipping what cannot change the answer.

Three shortcuts, each exact (the cheapest plan of every GPU kind is the one an exhaustive search finds):
- Once a deployment of a GPU kind meets the SLO, none of that kind with more GPUs is replayed: it cannot be
  the cheapest (the fewest GPUs wins). In particular a (GPU, tp) stops at the first replica count that meets.
  Deployments with as many GPUs are still replayed, since the tie goes to the lower p99 TTFT.
- A (GPU, tp) whose pool cannot hold some request is not replayed: the scheduler rejects that request at
  arrival at any replica count, so it never finishes and the deployment misses (asked of the scheduler itself).
- A replay stops once a target is certainly missed (`slo_watch.py`); its row says so, with the lower bound it
  reached. It missed, so it is never a plan; its figures are bounds, not latencies. When no deployment meets
  the SLO, the largest cut short of each GPU kind is replayed to its end, so that the closest has figures.

With several workers a deployment may start before the one that makes it unnecessary has finished; its row
is dropped at the end, so the rows (and plan.json) are those of the search done one deployment at a time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

from kvsim.errors import KvsimError


def search_plan(tasks: list, slo, pool, *, exhaustive: bool = False, on_row=None) -> tuple[list[dict], list[dict]]:
    """Replay `tasks` (PlanTask) on `pool` (`kvsim.sweep.runners.open_pool`) in order of GPU count; returns
    the rows and the deployments not replayed (`{gpu, tp, replicas, gpus, reason}`). `exhaustive` replays every
    deployment to its end."""
    order = deque(sorted(tasks, key=lambda t: (t.gpus, t.gpu, t.tp, t.replicas)))
    never = {} if exhaustive else never_fits(tasks)
    fewest: dict[str, int] = {}  # per GPU kind: the fewest GPUs meeting the SLO so far
    rows = []

    def take(row: dict) -> None:
        rows.append(row)
        if not slo.misses(row):
            fewest[row["gpu"]] = min(fewest.get(row["gpu"], math.inf), row["gpus"])
        if on_row is not None:
            on_row(row)

    def run_out(again) -> None:
        """Replay `again` (tasks without targets) to the end, their rows replacing those cut short."""
        for task in again:
            pool.submit(task)
        while pool.num_running:
            for task, row in pool.wait():
                rows[:] = [r for r in rows if r["point"] != task.point]
                row.setdefault("gpus", task.gpus)
                row.setdefault("gpu", task.gpu)
                take(row)

    try:
        while order or pool.num_running:
            while order and pool.num_running < pool.slots:
                task = order.popleft()
                if not exhaustive and task.gpus > fewest.get(task.gpu, math.inf):
                    continue  # listed as pruned below
                if (task.gpu, task.tp) in never:
                    take(never_fits_row(task, *never[(task.gpu, task.tp)]))
                    continue
                pool.submit(task if exhaustive else replace(task, targets=slo.targets))
            if pool.num_running:
                for task, row in pool.wait():
                    row.setdefault("gpus", task.gpus)  # a row from a worker that died has only its head
                    row.setdefault("gpu", task.gpu)
                    take(row)
        if not exhaustive and not fewest:  # no plan: the largest cut short of each kind, to the end, to name the closest
            cut = {r["point"] for r in rows if r.get("cut_short")}
            largest = {}
            for task in sorted((t for t in tasks if t.point in cut), key=lambda t: (t.gpus, t.tp)):
                largest[task.gpu] = task  # the last of each kind: the most GPUs (then the highest tp)
            run_out(largest.values())
    finally:
        pool.close()
    if exhaustive:
        return sorted(rows, key=lambda r: r["point"]), []
    kept = [r for r in rows if r["gpus"] <= fewest.get(r["gpu"], math.inf)]
    done = {r["point"] for r in kept}
    pruned = [{"gpu": t.gpu, "tp": t.tp, "replicas": t.replicas, "gpus": t.gpus,
               "reason": f"more GPUs than the cheapest {t.gpu} plan ({fewest[t.gpu]})"}
              for t in sorted(tasks, key=lambda t: t.point) if t.point not in done]
    return sorted(kept, key=lambda r: r["point"]), pruned


def never_fits(tasks: list) -> dict[tuple[str, int], tuple[int, str]]:
    """Per (GPU, tp) whose pool cannot hold every request: how many the scheduler rejects at arrival, and the
    first one's reason. The scheduler's own `add_request` decides, on an allocator of the replay's budget."""
    from kvsim.engine.factory import make_allocator
    from kvsim.replay.options import ReplayOptions
    from kvsim.replay.run import resolve_replay
    from kvsim.replay.sched.output import SchedSeq
    from kvsim.replay.sched.scheduler import Scheduler
    from kvsim.workload.spec import workload_from_mapping

    out, seen = {}, set()
    for task in tasks:
        if (task.gpu, task.tp) in seen:
            continue
        seen.add((task.gpu, task.tp))
        try:
            workload = workload_from_mapping(task.workload_mapping(), task.workload_path, sha256="plan")
            _, ctx, requests, _ = resolve_replay(workload, ReplayOptions(tensors=False, timing=task.timing))
        except KvsimError:
            continue  # the replay says it, in the deployment's row
        config = workload.allocators[0]
        allocator = make_allocator(config, ctx.spec(config.block_size), ctx.budget_bytes, max_model_len=ctx.max_model_len)
        sc = ctx.scheduler_config
        sched = Scheduler(allocator, max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                          max_model_len=ctx.max_model_len, reserve_full_isl=sc.scheduler_reserve_full_isl,
                          async_scheduling=sc.async_scheduling)
        reasons = []
        for i, r in enumerate(requests):
            reason = sched.add_request(SchedSeq(r.request_id, r.num_prompt_tokens, r.max_tokens, arrival_time=r.arrival_time, index=i))
            if reason is not None:
                reasons.append(f"request {r.request_id}: {reason}")
        if reasons:
            out[(task.gpu, task.tp)] = (len(reasons), reasons[0])
    return out


def never_fits_row(task, count: int, reason: str) -> dict:
    """The row of a deployment not replayed because `count` requests can never run on its pool."""
    return {"point": task.point, "gpu": task.gpu, "tp": task.tp, "replicas": task.replicas, "gpus": task.gpus,
            "error": None, "cut_short": False, "unfinished": count,
            "never_fits": f"{count} request(s) rejected at arrival, not replayed ({reason})"}
