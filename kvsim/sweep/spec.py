"""The sweep file read and validated once: a base workload, fixed overrides, axes by dotted path (a grid or
zipped) and an optional capacity search; frozen dataclasses, errors naming the file and field."""

from __future__ import annotations

import copy
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.replay.options import TIMINGS
from kvsim.workload.yaml_fields import Fields
from kvsim.workload.yaml_file import parse_yaml

COMBINES = ("grid", "zip")
DEFAULT_METRICS = ("throughput_tokens_per_s", "ttft_p99_s", "preemptions_per_request")
# What a capacity-search target may bound (each `metric <= value`): summary metrics of `kvsim replay` and the
# two a sweep derives (`task.derived_metrics`).
TARGET_METRICS = (
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "rejected", "preemptions",
    "preemptions_per_request", "queue_growth_per_s",
)
# What `metrics:` may name: the table's numeric columns (the summary of `kvsim replay` without kernel columns,
# and the derived two), and with a search its capacity columns. A name outside them would vanish from the charts.
TABLE_METRICS = (
    "budget_bytes", "num_requests", "finished", "rejected", "sim_time_s", "num_steps", "token_states_pct",
    "reservation_pct", "internal_fragmentation_pct", "external_fragmentation_pct", "free_pct", "shared_saved_pct",
    "padding_pct", "mean_running", "peak_running", "throughput_tokens_per_s", "computed_tokens_per_s", "preemptions",
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "prefix_hit_rate", "prefill_tokens_saved",
    "prefill_saved_pct", "preemptions_per_request",
    "queue_growth_per_s",
)
SEARCH_METRICS = ("capacity", "capacity_replays")


@dataclass(frozen=True)
class Axis:
    """One swept workload field: `path` is dotted (`requests.arrival.rate`, `allocators.0.block_size`)."""

    path: str
    values: tuple[Any, ...]


@dataclass(frozen=True)
class Search:
    """Bisect `axis` over `lo + k * step` (k = 0 .. (hi - lo) / step) for the largest value whose replay keeps
    every `targets` metric at or under its bound; assumes a larger value never helps (a rate, not a budget)."""

    axis: str
    lo: float
    hi: float
    step: float
    targets: tuple[tuple[str, float], ...]

    @property
    def num_values(self) -> int:
        return int(round((self.hi - self.lo) / self.step)) + 1

    def value(self, k: int) -> float | int:
        """The k-th candidate, an int when lo and step are (so `scheduler.max_num_seqs` stays whole)."""
        if float(self.lo).is_integer() and float(self.step).is_integer():
            return int(self.lo) + k * int(self.step)
        return round(self.lo + k * self.step, 12)


@dataclass(frozen=True)
class SweepSpec:
    """A sweep file: `base` is the workload mapping every point starts from, read as if from `base_path`."""

    name: str
    path: Path
    base: dict
    base_path: Path
    fixed: tuple[tuple[str, Any], ...]  # `set:` overrides applied to every point, in file order
    axes: tuple[Axis, ...]
    combine: str
    search: Search | None
    metrics: tuple[str, ...] = DEFAULT_METRICS  # what `kvsim plot` draws of the table
    timing: str | None = None  # the replay clock the file names (TIMINGS); None: the CLI's (roofline)

    def meta(self, timing: str | None = None) -> dict:
        """What the table's charts need to know of the sweep (written beside it as sweep.json); `timing`: the
        clock its replays ran on."""
        return {"name": self.name, "axes": [a.path for a in self.axes], "combine": self.combine,
                "search_axis": self.search.axis if self.search else None,
                "search_target": dict(self.search.targets) if self.search else None, "metrics": list(self.metrics),
                "timing": timing or self.timing or "roofline"}


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and validate a sweep YAML (the points themselves are validated by `points.expand_points`)."""
    path = Path(path)
    source = str(path)
    raw = _read_yaml(path, source=source)
    f = Fields(raw if raw is not None else {}, source=source)
    name = f.str("name", path.stem)
    if "/" in name or "\\" in name or name in (".", ".."):
        raise f.error("name", f"must be a plain folder name (no slashes), got {name!r}")
    f.str("description", "")
    base_value = f.get("base")
    if isinstance(base_value, str):  # a workload file, relative to the sweep file
        base_path = path.parent / base_value
        base = _read_yaml(base_path, source=f"{source}: base")
        if not isinstance(base, dict):
            raise f.error("base", f"{base_path} holds no workload mapping")
    elif isinstance(base_value, dict):
        base, base_path = copy.deepcopy(base_value), path
    else:
        raise f.error("base", "must be a workload file (a path) or an inline workload mapping")
    fixed = _dotted_mapping(f, "set")
    axes_raw = _dotted_mapping(f, "axes")
    axes = []
    for key, values in axes_raw:
        if not isinstance(values, list) or not values:
            raise f.error(f"axes.{key}", f"must be a non-empty list of values, got {values!r}")
        axes.append(Axis(key, tuple(values)))
    combine = f.choice("combine", COMBINES, "grid")
    if combine == "zip" and len({len(a.values) for a in axes}) > 1:
        sizes = ", ".join(f"{a.path}: {len(a.values)}" for a in axes)
        raise f.error("combine", f"zip needs axes of one length, got {sizes}")
    search = _search(f.sub("search", None), [a.path for a in axes])
    if not axes and search is None:
        raise f.error("axes", "give at least one axis (or a search)")
    metrics = f.get("metrics", list(DEFAULT_METRICS))
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise f.error("metrics", f"must be a non-empty list of table columns, got {metrics!r}")
    timing = f.choice("timing", TIMINGS) if "timing" in f.raw else None  # validated as the CLI's --timing
    _check_metrics(f, metrics, search is not None)
    f.done()
    return SweepSpec(name, path, base, base_path, tuple(fixed), tuple(axes), combine, search, tuple(metrics), timing)


def _check_metrics(f: Fields, metrics: list[str], has_search: bool) -> None:
    """Refuse a metric that is no column of the table, before any replay runs."""
    known = TABLE_METRICS + SEARCH_METRICS if has_search else TABLE_METRICS
    for metric in metrics:
        if metric in known:
            continue
        if metric in SEARCH_METRICS:
            raise f.error("metrics", f"{metric!r} is a column only of a sweep with a search")
        close = difflib.get_close_matches(metric, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise f.error("metrics", f"{metric!r} is not a column of the table{hint}; columns: {', '.join(known)}")


def _read_yaml(path: Path, *, source: str) -> Any:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KvsimError(f"cannot read {path}: {exc.strerror or exc}", source=source) from None
    return parse_yaml(data, source=source)


def _dotted_mapping(f: Fields, key: str) -> list[tuple[str, Any]]:
    """`{dotted.path: value}` in file order; each path a run of field names and list indices."""
    value = f.get(key, {})
    if not isinstance(value, dict):
        raise f.error(key, f"must be a mapping of dotted field paths, got {value!r}")
    for path in value:
        if not isinstance(path, str) or not all(part.strip() for part in path.split(".")):
            raise f.error(key, f"not a dotted field path: {path!r}")
    return list(value.items())


def _search(f: Fields | None, axes: list[str]) -> Search | None:
    if f is None:
        return None
    axis = f.str("axis")
    if axis in axes:
        raise f.error("axis", f"{axis} is also an axis; a search axis is searched, not swept")
    lo = f.float("lo")
    hi = f.float("hi")
    step = f.float("step", min=0, exclusive=True)
    if hi <= lo:
        raise f.error("hi", f"must be > lo ({lo:g}), got {hi:g}")
    if not math.isclose((hi - lo) / step, round((hi - lo) / step), abs_tol=1e-9):
        raise f.error("step", f"must divide hi - lo ({hi - lo:g}) into whole steps, got {step:g}")
    t = f.sub("target")
    targets = []
    for metric in t.raw:
        if metric not in TARGET_METRICS:
            raise t.error(str(metric), f"not a target metric (choose from {', '.join(TARGET_METRICS)})")
        targets.append((metric, t.float(metric, min=0)))
    if not targets:
        raise f.error("target", f"give at least one bound, e.g. ttft_p99_s: 2.0 (metrics: {', '.join(TARGET_METRICS)})")
    t.done()
    f.done()
    return Search(axis, lo, hi, step, tuple(targets))
