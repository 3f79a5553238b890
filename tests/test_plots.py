"""kvsim plot: files written, charts skipped with a note when data is missing, drawn data = report numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvsim.errors import KvsimError
from kvsim.plots import plot_report, plot_reports
from kvsim.plots.report import CATEGORIES, load_report

BUDGET = 2**30  # 1 GiB
ALLOCATORS = ("flat-max", "flat-oracle", "paged-16")


def make_replay_report(directory: Path, *, workload: str = "poisson", allocators=ALLOCATORS, num_steps: int = 120,
                       num_requests: int = 40, with_steps=True, with_requests=True, with_summary=True) -> Path:
    """A small report in the agreed schema, with numbers chosen per allocator so charts can be checked."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    steps, requests, summary = [], [], []
    for i, label in enumerate(allocators):
        t = np.arange(num_steps) * 0.05
        rank = i / max(len(allocators) - 1, 1)  # 0 for the first allocator, 1 for the last
        flat = label.startswith("flat")
        token = (0.15 + 0.4 * rank) * BUDGET * (0.5 + 0.5 * np.sin(t) ** 2)
        reservation = 0.1 * BUDGET * np.ones(num_steps) * flat
        internal = (0.02 + 0.3 * (1 - rank)) * BUDGET * np.ones(num_steps)
        external = 0.05 * BUDGET * np.ones(num_steps) * flat
        parts = np.stack([token, reservation, internal, external]).astype(np.int64)
        free = BUDGET - parts.sum(axis=0)
        assert (free >= 0).all()
        frame = pd.DataFrame({
            "allocator": label, "step": np.arange(num_steps), "time_s": t, "step_time_s": 0.05,
            "num_running": (4 + 4 * i + 3 * np.sin(t)).round().astype(int),
            "num_waiting": np.maximum(0, 20 - np.arange(num_steps) // (3 + i)),
            "num_prefill_tokens": 0, "num_decode_tokens": 8,
            "token_states_bytes": parts[0], "reservation_bytes": parts[1],
            "internal_fragmentation_bytes": parts[2], "external_fragmentation_bytes": parts[3],
            "free_bytes": free, "shared_saved_bytes": 0,
            "num_preemptions": (np.arange(num_steps) % 40 == 39).astype(int) * (i == 0),
            "write_us": 1.0, "read_us": 1.0, "attention_us": 1.0,
        })
        steps.append(frame)
        ttft = rng.exponential(0.5 / (i + 1), num_requests)
        ttft[0] = np.nan  # one rejected request per allocator
        requests.append(pd.DataFrame({
            "allocator": label, "request_id": np.arange(num_requests), "arrival_s": 0.0, "ttft_s": ttft,
            "tpot_s": rng.uniform(0.01, 0.03, num_requests) * (i + 1), "num_prompt_tokens": 100, "max_tokens": 50,
        }))
        pct = {f"{c}_pct": float(frame[f"{c}_bytes"].mean() / BUDGET * 100) for c in CATEGORIES}
        summary.append({"allocator": label, **pct, "budget_bytes": BUDGET, "model": "qwen3-0.6b",
                        "workload": workload, "preemptions": int(frame["num_preemptions"].sum())})
    if with_steps:
        pd.concat(steps).to_parquet(directory / "steps.parquet", index=False)
    if with_requests:
        pd.concat(requests).to_csv(directory / "requests.csv", index=False)
    if with_summary:
        pd.DataFrame(summary).to_csv(directory / "summary.csv", index=False)
    (directory / "meta.json").write_text(json.dumps({"seed": 0, "workload": workload}))
    return directory


@pytest.fixture
def report_dir(tmp_path):
    return make_replay_report(tmp_path / "poisson")


def draw(report_dir: Path, chart: str):
    from kvsim.plots import _replay_charts

    return dict(_replay_charts())[chart](load_report(report_dir))


def test_every_replay_chart_is_written_as_a_real_image(report_dir):
    notes = []
    paths = plot_report(load_report(report_dir), "png", note=notes.append)
    # block-sizes needs a sweep of paged block sizes; this report has only one
    assert [p.name for p in paths] == ["waste-curves.png", "figure2.png", "timeline.png", "latency.png"]
    assert notes == [f"{report_dir}: skipped block-sizes: summary.csv has fewer than two paged block sizes "
                     "(replay a block-size sweep)"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000
