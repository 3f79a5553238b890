"""A fleet's charts, one per allocator: each replica's load (waiting + running requests) over time, and its
prefix hit rate so far (prompt tokens served from cache / prompt tokens, over the requests routed to it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvsim.deployment.fleet import FleetResult


def fleet_charts(fleet: FleetResult, out_dir: Path, fmt: str = "png") -> list[Path]:
    """Write fleet-<allocator>.<fmt> under `out_dir`; their paths."""
    from kvsim.plots.style import check_format, new_figure, save, titles

    fmt = check_format(fmt)
    result = fleet.result
    paths = []
    for run in fleet.fleets:
        fig, axes = new_figure(10, 6.5, nrows=2)
        load_ax, hit_ax = axes[0][0], axes[1][0]
        for k, rep in enumerate(run.replicas):
            st = rep.steps
            load = st["num_running"] + st["num_waiting"]
            load_ax.step(st["time_s"], load, where="post", lw=0.8, label=f"replica {k}")
            mine = np.flatnonzero((run.replica_of == k) & ~np.isnan(rep.admitted_s))
            if len(mine):
                prompt = np.cumsum(result.num_prompt_tokens[mine])
                cached = np.cumsum(rep.num_cached_tokens[mine])
                hit_ax.plot(rep.admitted_s[mine], cached / prompt, lw=0.8, label=f"replica {k}")
        load_ax.set_ylabel("waiting + running requests")
        hit_ax.set_ylabel("prefix hit rate so far")
        hit_ax.set_xlabel("simulated time (s)")
        if fleet.num_replicas <= 10:
            load_ax.legend(ncol=min(fleet.num_replicas, 5), loc="upper right")
        titles(fig, f"{fleet.num_replicas} replicas behind {fleet.router.policy}: load and prefix hits per replica",
               f"{result.model_name} on {result.hardware_name} x tp {result.tp}, {run.label}, {result.workload.name}")
        paths.append(save(fig, Path(out_dir) / f"fleet-{run.label}.{fmt}"))
    return paths
