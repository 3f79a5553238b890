"""`kvsim cache-curve --cpu-capacities`: the second tier, vLLM's CPU offloading, as a table, JSON, CSV and chart."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from kvsim.cache_curve.blocks import block_unit_arrays
from kvsim.cache_curve.two_tier import TwoTierRequests, two_tier_hits, two_tier_requests
from kvsim.errors import KvsimError
from kvsim.workload.requests import RequestSpec


def tier_requests(requests: list[RequestSpec], *, block_size: int, cpu_block_size: int | None) -> TwoTierRequests:
    """The requests as GPU blocks and CPU chunks (`cpu_block_size` tokens: a multiple of the GPU block, vLLM's
    connector `block_size`; default one GPU block, as vLLM's)."""
    t = block_size if cpu_block_size is None else cpu_block_size
    if t < 1 or t % block_size:
        raise KvsimError(f"must be a positive multiple of --block-size ({block_size}), got {t}", field="--cpu-block-size")
    prompt = np.array([r.num_prompt_tokens for r in requests], dtype=np.int64)  # (r,)
    gpu_units = block_unit_arrays(requests, block_size)
    cpu_units = gpu_units if t == block_size else block_unit_arrays(requests, t)
    return two_tier_requests(*gpu_units, *cpu_units, prompt, block_size=block_size, cpu_block_size=t)


def tier_rows(reqs: TwoTierRequests, capacities: np.ndarray, cpu_capacities: np.ndarray) -> list[dict]:
    """[{capacity_tokens, cpu_capacity_tokens, hit_rate, cpu_hit_rate, total_hit_rate}] at every pair: the GPU
    tier's hits, then the CPU tier's beyond them, as fractions of all prompt tokens.

    One CPU pass per CPU capacity and distinct GPU hit vector (GPU capacities that give every request the same
    GPU hit give the same CPU hits).
    """
    total = max(int(reqs.prompt.sum()), 1)
    rows = []
    done: dict[tuple[bytes, int], int] = {}
    for c in capacities.tolist():
        gpu = reqs.gpu_hit_blocks(c)  # (r,)
        gpu_rate = int(gpu.sum()) * reqs.block_size / total
        for m in cpu_capacities.tolist():
            key = (gpu.tobytes(), m)
            if key not in done:
                done[key] = int(two_tier_hits(reqs, gpu, m // reqs.cpu_block_size).sum())
            cpu_rate = done[key] / total
            rows.append({"capacity_tokens": int(c), "cpu_capacity_tokens": int(m), "hit_rate": gpu_rate,
                         "cpu_hit_rate": cpu_rate, "total_hit_rate": gpu_rate + cpu_rate})
    return rows


def write_tiers_csv(rows: list[dict], bytes_per_token: int | None, path: Path) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["capacity_tokens", "capacity_bytes", "cpu_capacity_tokens", "cpu_capacity_bytes", "hit_rate",
                        "cpu_hit_rate", "total_hit_rate"])
            for r in rows:
                c, m = r["capacity_tokens"], r["cpu_capacity_tokens"]
                w.writerow([c, "" if bytes_per_token is None else c * bytes_per_token, m,
                            "" if bytes_per_token is None else m * bytes_per_token,
                            f"{r['hit_rate']:.6f}", f"{r['cpu_hit_rate']:.6f}", f"{r['total_hit_rate']:.6f}"])
    except OSError as exc:
        raise KvsimError(f"cannot write the tiers: {exc.strerror or exc}", source=str(path)) from None
    return path


def print_tiers(echo, rows: list[dict], cpu_capacities: np.ndarray, bytes_per_token: int | None, cpu_block_size: int) -> None:
    """A table: GPU capacities down, CPU capacities across, each cell the CPU tier's hit rate and the total."""
    gib = (lambda t: f" ({t * bytes_per_token / 2**30:.0f} GiB)") if bytes_per_token else (lambda t: "")
    echo(f"CPU tier (vLLM OffloadingConnector, LRU, CPU block {cpu_block_size} tokens): CPU hit rate / total hit rate")
    heads = [f"CPU {m:,}{gib(m)}" for m in cpu_capacities.tolist()]
    echo(f"{'GPU tokens':>14} {'GPU hit':>8} " + " ".join(f"{h:>24}" for h in heads))
    per_row = len(cpu_capacities)
    for k in range(0, len(rows), per_row):
        group = rows[k:k + per_row]
        cells = " ".join(f"{r['cpu_hit_rate']:>11.1%} / {r['total_hit_rate']:<10.1%}" for r in group)
        echo(f"{group[0]['capacity_tokens']:>14,} {group[0]['hit_rate']:>8.1%} {cells}")
