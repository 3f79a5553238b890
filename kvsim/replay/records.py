"""The replay's records: step columns (one row per scheduled row), per-request arrays, one `AllocatorRun` per
allocator config and the `ReplayResult` that holds them all; what reports and plots read."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import numpy as np

from kvsim.engine.factory import AllocatorConfig
from kvsim.replay.options import ReplayOptions

# Step-record columns: (name, array typecode). Bytes and counts are integers, times floats. A row covers
# `num_steps` steps (a decode run): its token counts are totals, its bytes are at the run's middle step, its
# kernel times (µs, NaN when not measured) are per step, the mean of the run's steps.
STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("step", "q"),
    ("num_steps", "q"),
    ("time_s", "d"),
    ("step_time_s", "d"),
    ("num_running", "q"),
    ("num_waiting", "q"),
    ("num_prefill_tokens", "q"),
    ("num_decode_tokens", "q"),
    ("token_states_bytes", "q"),
    ("reservation_bytes", "q"),
    ("internal_fragmentation_bytes", "q"),
    ("external_fragmentation_bytes", "q"),
    ("free_bytes", "q"),
    ("shared_saved_bytes", "q"),
    ("padding_bytes", "q"),  # vLLM's page padding of mixed models, inside internal_fragmentation_bytes
    ("num_preemptions", "q"),
    ("write_us", "d"),
    ("read_us", "d"),
    ("attention_us", "d"),
)
KERNEL_COLUMNS = ("write_us", "read_us", "attention_us")
# With a CPU tier, steps.parquet adds these per row: prompt tokens whose load from the tier started, bytes loaded
# and stored over the host link (one rank's), prompt tokens the GPU prefix cache served to requests admitted
# with compute, and requests waiting on a load.
OFFLOAD_COLUMNS = ("cpu_hit_tokens", "cpu_loaded_bytes", "cpu_stored_bytes", "gpu_hit_tokens", "num_loading")


@dataclass
class AllocatorRun:
    """Everything one allocator config produced: step columns, per-request arrays, prefix-cache counters."""

    config: AllocatorConfig
    label: str
    budget_bytes: int
    steps: dict[str, np.ndarray]  # STEP_COLUMNS, one row per scheduled row
    admitted_s: np.ndarray  # (num_requests,) float64, NaN when never admitted
    first_token_s: np.ndarray
    finished_s: np.ndarray
    num_preemptions: np.ndarray  # (num_requests,) int64
    num_cached_tokens: np.ndarray  # prompt tokens the prefix cache served at first admission
    rejected_reason: list[str | None]
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_read_samples: int = 0  # decode steps that read + attended (kernel-time summaries cover only these)
    offload: dict | None = None  # the CPU tier's totals and per-row OFFLOAD_COLUMNS (`offload_record`); None: no tier


@dataclass
class ReplayResult:
    """A whole replay: the workload, what it resolved to, and one `AllocatorRun` per allocator config."""

    workload: object  # kvsim.workload.Workload
    model_name: str
    hardware_name: str
    budget_bytes: int
    device: str
    options: ReplayOptions
    arrival_s: np.ndarray  # (num_requests,) float64
    num_prompt_tokens: np.ndarray  # (num_requests,) int64
    max_tokens: np.ndarray
    runs: list[AllocatorRun] = field(default_factory=list)
    note: str | None = None  # what the replay decided for the user (e.g. accounting only without CUDA)
    clock: str = "roofline"  # the step clock in words (kernels-db names the database and its vLLM version)
    tp: int = 1  # tensor-parallel ranks: budget_bytes and every byte figure are one rank's
    ep: int = 1  # ranks a MoE's experts are spread over (1: split by tp)


def offload_record(connector, rows: array, num_rows: int) -> dict:
    """The CPU tier's totals (summary.csv) and its per-row OFFLOAD_COLUMNS (steps.parquet)."""
    table = np.frombuffer(rows, dtype=np.float64).reshape(num_rows, len(OFFLOAD_COLUMNS))  # (rows, columns)
    return {
        "cpu_hit_tokens": connector.cpu_hit_tokens,
        "cpu_loaded_bytes": connector.cpu_loaded_bytes,
        "cpu_stored_bytes": connector.cpu_stored_bytes,
        "cpu_load_wait_s": connector.load_wait_s,
        "steps": {name: table[:, j].astype(np.int64) for j, name in enumerate(OFFLOAD_COLUMNS)},
    }


def step_columns(rows: array, num_rows: int) -> dict[str, np.ndarray]:
    """The step records as STEP_COLUMNS arrays; `rows` holds every column as a double, row after row."""
    table = np.frombuffer(rows, dtype=np.float64).reshape(num_rows, len(STEP_COLUMNS))  # (rows, columns)
    return {
        name: table[:, j].astype(np.int64) if code == "q" else table[:, j].copy()
        for j, (name, code) in enumerate(STEP_COLUMNS)
    }


def fill_kernel_columns(steps: dict[str, np.ndarray], timer, timer_steps: array) -> None:
    """Set the KERNEL_COLUMNS of `steps` to each row's mean kernel µs per step over its timer steps.

    `timer_steps` holds, per row, the first and last timer step its kernels ran in; `timer` is the cache's
    `StepTimer`, read once after the replay's loop (one host sync). A kind never measured in a row's steps
    is NaN there; otherwise the mean is over the steps that measured it.
    """
    from kvsim.engine.tensors.timing import KINDS

    us, seen = timer.per_step()  # [kinds, timer steps]
    spans = np.frombuffer(timer_steps, dtype=np.int64).reshape(-1, 2)  # (rows, [first, last] timer step)
    first, end = spans[:, 0], spans[:, 1] + 1
    for name in KERNEL_COLUMNS:
        k = KINDS.index(name[: -len("_us")])
        total = np.concatenate([[0.0], np.cumsum(us[k])])  # prefix sums: a row's total is one subtraction
        count = np.concatenate([[0], np.cumsum(seen[k])])
        n = count[end] - count[first]
        with np.errstate(invalid="ignore", divide="ignore"):
            steps[name] = np.where(n > 0, (total[end] - total[first]) / n, math.nan)
