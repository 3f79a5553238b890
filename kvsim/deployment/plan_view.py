"""`kvsim plan`'s output: the table of every deployment searched, the cheapest plan per GPU kind and why the
next smaller one fails, plan.json (`plans: [{gpu, tp, replicas, gpus, meets_slo, status, ttft_p99_s,
tpot_p99_s, ...}]`, and `pruned`: the deployments not replayed) and the Pareto chart (GPUs vs p99 TTFT)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvsim.deployment.plan import Plan, _dur, status
from kvsim.errors import KvsimError
from kvsim.out_paths import output_dir


def show_plan(target: str, *, model: str | None, gpus: str, tps: str, replicas: str, slo: str, router: str | None,
              timing: str, workers: int | None, ray: str | None, out: Path | None, json_out: bool, quiet: bool,
              async_scheduling: bool | None = None, exhaustive: bool = False) -> Plan:
    """Run the plan and report it; exit 2 (a KvsimError) when no searched deployment meets the SLO."""
    from kvsim.deployment.plan import check_clock, check_requests, parse_ints, parse_slo, plan_tasks, run_plan

    targets = parse_slo(slo)
    gpu_names = [g.strip() for g in gpus.split(",") if g.strip()]
    if not gpu_names:
        raise KvsimError("give at least one GPU", field="--gpu")
    if workers is not None and workers < 1:
        raise KvsimError(f"must be >= 1, got {workers}", field="--workers")
    if timing not in ("kernels-db", "roofline"):
        raise KvsimError(f"must be kernels-db or roofline, got {timing!r}", field="--timing")
    tasks, skipped, _ = plan_tasks(target, model=model, gpus=gpu_names, tps=parse_ints(tps, "--tp"),
                                   replicas=parse_ints(replicas, "--replicas"), timing=timing, router=router,
                                   async_scheduling=async_scheduling)
    check_requests(tasks)
    check_clock(tasks, timing)
    out_dir = output_dir(out if out is not None else Path("reports") / "plan" / Path(target).stem, create=False)
    console = Console(stderr=True)
    if not quiet:
        console.print(f"plan: {len(tasks)} deployments of {Path(target).name} ({timing} clock)", markup=False)
        for line in skipped:
            console.print(f"skipped: {line}", markup=False, style="dim")
    plan = run_plan(tasks, targets, workers=workers, ray=ray, skipped=skipped, exhaustive=exhaustive)
    out_dir = output_dir(out_dir)
    document = {"slo": dict(targets.targets), "plans": plan.plans_json(), "pruned": plan.pruned}
    (out_dir / "plan.json").write_text(json.dumps(document, indent=2) + "\n")
    pareto_chart(plan, out_dir / "plan.png", title=Path(target).name)
    if json_out:
        print(json.dumps(document, indent=2))
    elif not quiet:
        Console().print(plan_table(plan))
        for line in search_notes(plan):
            console.print(line, markup=False, style="dim")
    lines = verdict(plan, gpu_names)
    if all(plan.cheapest(g) is None for g in gpu_names):
        raise KvsimError(lines[-1], field="--slo")
    if not json_out:
        for line in lines:
            Console().print(line, markup=False, highlight=False)
        console.print(f"reports: {out_dir}", markup=False)
    return plan


def verdict(plan: Plan, gpus: list[str]) -> list[str]:
    """Per GPU kind: the cheapest plan and why the next smaller fails; or, when none meets, the closest."""
    lines = []
    for gpu in gpus:
        best = plan.cheapest(gpu)
        if best is None:
            continue
        lines.append(f"{gpu}: {best['replicas']} x tp {best['tp']} = {best['gpus']} GPUs (ttft_p99 {_dur(best['ttft_p99_s'])}, "
                     f"tpot_p99 {_dur(best['tpot_p99_s'])})")
        smaller = plan.next_smaller(gpu)
        if smaller is not None:
            lines.append(f"  the next smaller, {smaller['replicas']} x tp {smaller['tp']} = {smaller['gpus']} GPUs, fails: "
                         f"{'; '.join(plan.slo.misses(smaller))}")
        else:
            lines.append("  it is the smallest searched")
    if not lines:
        c = plan.closest()
        why = "; ".join(plan.slo.misses(c))
        lines.append(f"no searched deployment meets {', '.join(f'{m[:-2]} <= {_dur(b)}' for m, b in plan.slo.targets)}; "
                     f"closest: {c['replicas']} x {c['gpu']} tp {c['tp']} ({c['gpus']} GPUs: {why})")
    return lines


def search_notes(plan: Plan) -> list[str]:
    """What the search did not replay to the end, in words."""
    lines = []
    cut = [r for r in plan.rows if r.get("cut_short")]
    if cut:
        lines.append(f"cut short: {len(cut)} replay(s) stopped once a target was certainly missed "
                     "(>=: a lower bound; the other figures unknown)")
    never = [r for r in plan.rows if r.get("never_fits")]
    if never:
        lines.append(f"no (pool): {len(never)} deployment(s) not replayed: a request can never fit one replica's pool, "
                     "so it is rejected at arrival and never finishes")
    if plan.pruned:
        kinds = sorted({p["gpu"] for p in plan.pruned})
        lines.append(f"not replayed: {len(plan.pruned)} deployment(s) with more GPUs than their kind's cheapest plan "
                     f"({', '.join(kinds)}); --exhaustive replays them")
    return lines


def plan_table(plan: Plan) -> Table:
    table = Table(title="deployments searched")
    for name in ("gpu", "tp", "replicas", "GPUs", "TTFT p50", "TTFT p99", "TPOT p99", "tok/s", "meets SLO"):
        table.add_column(name, justify="left" if name == "gpu" else "right")
    for r in sorted(plan.rows, key=lambda r: (r["gpu"], r["gpus"], r["tp"])):
        meets = "yes" if plan.meets(r) else {"error": "error", "never fits": "no (pool)"}.get(status(r), "no")
        tput = r.get("throughput_tokens_per_s")
        figures = {m: _dur(r.get(m)) for m in ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s")}
        if r.get("cut_short"):
            figures[r["cut_metric"]] = ">= " + _dur(r[r["cut_metric"]], 1)
        table.add_row(r["gpu"], str(r["tp"]), str(r["replicas"]), str(r["gpus"]), figures["ttft_p50_s"],
                      figures["ttft_p99_s"], figures["tpot_p99_s"], "-" if tput is None else f"{tput:,.0f}", meets)
    return table


def pareto_chart(plan: Plan, path: Path, *, title: str) -> Path:
    """GPUs vs p99 TTFT, a marker per deployment (filled where it meets the SLO), each GPU kind's Pareto front."""
    from kvsim.plots.style import new_figure, save, titles

    fig, axes = new_figure(8, 5)
    ax = axes[0][0]
    for j, gpu in enumerate(sorted({r["gpu"] for r in plan.rows})):
        rows = sorted((r for r in plan.rows if r["gpu"] == gpu and r.get("ttft_p99_s") is not None), key=lambda r: r["gpus"])
        color = f"C{j}"
        for r in rows:  # a replay cut short: an upward triangle at its lower bound (the p99 is at least there)
            cut = bool(r.get("cut_short"))
            ax.scatter(r["gpus"], r["ttft_p99_s"], color=color, facecolors=color if plan.meets(r) else "none", s=36,
                       zorder=3, marker="^" if cut else "o")
            ax.annotate(f"tp{r['tp']}" + (" (cut short)" if cut else ""), (r["gpus"], r["ttft_p99_s"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        for r in plan.rows:  # cut short on another target: no TTFT figure; a cross on the x axis
            if r["gpu"] == gpu and r.get("cut_short") and r.get("ttft_p99_s") is None:
                ax.scatter(r["gpus"], 0.03, color=color, marker="x", s=30, zorder=3, transform=ax.get_xaxis_transform())
                ax.annotate(f"tp{r['tp']} (cut short: {r['cut_metric'][:-2]})", (r["gpus"], 0.03), fontsize=7,
                            xytext=(3, 3), textcoords="offset points", xycoords=ax.get_xaxis_transform())
        front, best = [], math.inf
        for r in rows:  # the lowest p99 TTFT reached with at most this many GPUs (a bound is not a reached figure)
            if not r.get("cut_short") and r["ttft_p99_s"] < best:
                best = r["ttft_p99_s"]
                front.append((r["gpus"], best))
        if front:
            xs, ys = zip(*front)
            ax.step(xs, ys, where="post", color=color, lw=1, label=f"{gpu} (Pareto front)")
    bound = dict(plan.slo.targets).get("ttft_p99_s")
    if bound is not None:
        ax.axhline(bound, color="grey", ls="--", lw=1, label=f"SLO ttft_p99 {_dur(bound)}")
    ax.set_yscale("log")
    gpus = [r["gpus"] for r in plan.rows]
    if gpus:  # every deployment searched, those drawn on the x axis included
        ax.set_xlim(min(gpus) - 0.5, max(gpus) + 0.5 + 0.15 * (max(gpus) - min(gpus) + 1))
    ax.set_xlabel("GPUs (replicas x tp)")
    ax.set_ylabel("p99 TTFT (s)")
    if any(r.get("cut_short") and r.get("ttft_p99_s") is not None for r in plan.rows):
        ax.scatter([], [], marker="^", facecolors="none", color="grey", label="cut short: p99 TTFT at least this")
    if any(r.get("cut_short") and r.get("ttft_p99_s") is None for r in plan.rows):
        ax.scatter([], [], marker="x", color="grey", label="cut short on another target (no TTFT figure)")
    ax.legend()
    titles(fig, "Fewest GPUs for the SLO: each deployment's p99 TTFT (filled: meets every target)", title)
    return save(fig, path)
