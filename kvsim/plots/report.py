"""A report directory read back into the frames the charts draw from.

This is the one place that knows the report files' column names (`kvsim/reports.py` writes them, `kvsim bench`
writes the kernel CSVs): `_ALIASES` maps each name a writer may use to the canonical name every chart uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvsim.errors import KvsimError
from kvsim.units import format_bytes

# The five places a byte of the KV budget can be, in stacking order (useful at the bottom, free on top).
CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")
CATEGORY_LABELS = {
    "token_states": "token states",
    "reservation": "reservation",
    "internal_fragmentation": "internal fragmentation",
    "external_fragmentation": "external fragmentation",
    "free": "free",
}

# canonical name <- other names a report may use for it (first match wins).
_ALIASES: dict[str, tuple[str, ...]] = {
    **{f"{c}_bytes": (f"{c}_bytes", c) for c in CATEGORIES},
    **{f"{c}_pct": (f"{c}_pct", f"{c}_percent", f"avg_{c}_pct", f"mean_{c}_pct") for c in CATEGORIES},
    "allocator": ("allocator", "label", "allocator_label"),
    "time_s": ("time_s", "t_s", "sim_time_s"),
    "num_running": ("num_running", "running"),
    "num_waiting": ("num_waiting", "waiting"),
    "num_preemptions": ("num_preemptions", "preemptions"),
    "ttft_s": ("ttft_s", "ttft"),
    "tpot_s": ("tpot_s", "tpot"),
    "budget_bytes": ("budget_bytes", "kv_budget_bytes"),
    "block_size": ("block_size",),
    "model": ("model",),
    "workload": ("workload", "workload_name", "name"),
}

# Whether steps' `num_preemptions` is a running total (True) or the count at that step (False).
PREEMPTIONS_CUMULATIVE = False

STEP_FILES = ("steps.parquet", "steps.csv")
REPLAY_FILES = (*STEP_FILES, "requests.csv", "summary.csv")


class MissingData(Exception):
    """A chart cannot be drawn from this report: the message says which file or column it lacks."""


def _canonical(frame: pd.DataFrame) -> pd.DataFrame:
    """Rename the columns `_ALIASES` knows to their canonical names; leave the others as they are."""
    renames = {}
    for canonical, names in _ALIASES.items():
        if canonical in frame.columns:
            continue
        for name in names:
            if name in frame.columns and name not in renames:
                renames[name] = canonical
                break
    return frame.rename(columns=renames)


def _read_table(path: Path) -> pd.DataFrame:
    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except Exception as exc:  # pandas/pyarrow raise many types for a corrupt file
        raise KvsimError(f"cannot read report table: {exc}", source=str(path)) from None
    return _canonical(frame)


@dataclass(eq=False)
class Report:
    """What one report directory holds; any table may be missing (None / empty)."""

    path: Path
    steps: pd.DataFrame | None = None
    requests: pd.DataFrame | None = None
    summary: pd.DataFrame | None = None
    meta: dict = field(default_factory=dict)
    bench: dict[str, pd.DataFrame] = field(default_factory=dict)  # CSV stem -> `kvsim bench kernels` rows

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def is_replay(self) -> bool:
        """Replay files present (another command's summary.csv, e.g. `kvsim profile`'s, does not count)."""
        replay_summary = self.summary is not None and "allocator" in self.summary.columns and any(
            f"{c}_pct" in self.summary.columns for c in CATEGORIES)
        return self.steps is not None or self.requests is not None or replay_summary

    @property
    def allocators(self) -> list[str]:
        """Allocator labels in the order the report lists them (summary first, then steps, then requests)."""
        for frame in (self.summary, self.steps, self.requests):
            if frame is not None and "allocator" in frame.columns:
                return list(dict.fromkeys(frame["allocator"].astype(str)))
        return []

    def _summary_value(self, column: str):
        if self.summary is not None and column in self.summary.columns and len(self.summary):
            return self.summary[column].iloc[0]
        return None

    @property
    def model(self) -> str | None:
        return self._summary_value("model") or self.meta.get("model")

    @property
    def workload(self) -> str | None:
        value = self._summary_value("workload") or self.meta.get("workload") or self.meta.get("name")
        if isinstance(value, dict):  # meta may hold {"name": ..., "path": ..., "sha256": ...}
            value = value.get("name") or value.get("path")
        return str(value) if value else None

    @property
    def budget_bytes(self) -> int | None:
        value = self._summary_value("budget_bytes") or self.meta.get("budget_bytes") or self.meta.get("kv_budget_bytes")
        return int(value) if value else None

    def subtitle(self) -> str:
        """'model qwen3-0.6b · KV budget 4.0 GiB · workload poisson · async scheduling' from whatever the report
        states (a report from before meta.json named the loop says nothing of it)."""
        parts = []
        if self.model:
            parts.append(f"model {self.model}")
        if self.budget_bytes:
            parts.append(f"KV budget {format_bytes(self.budget_bytes)}")
        parts.append(f"workload {self.workload or self.name}")
        if isinstance(self.meta.get("async_scheduling"), bool):
            parts.append("async scheduling" if self.meta["async_scheduling"] else "sync scheduling")
        return " · ".join(parts)

    def table(self, which: str, columns: tuple[str, ...]) -> pd.DataFrame:
        """`steps`, `requests` or `summary` with `columns` present, else MissingData naming what is lacking."""
        frame = getattr(self, which)
        filename = {"steps": "steps.parquet", "requests": "requests.csv", "summary": "summary.csv"}[which]
        if frame is None:
            raise MissingData(f"no {filename}")
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise MissingData(f"{filename} lacks column(s) {', '.join(missing)}")
        if frame.empty:
            raise MissingData(f"{filename} has no rows")
        return frame


def load_report(path: str | Path) -> Report:
    """Read every report file `path` holds (steps, requests, summary, meta, kernel-bench CSVs)."""
    path = Path(path)
    if not path.is_dir():
        raise KvsimError("not a report directory (run `kvsim replay` or `kvsim bench` first)", source=str(path))
    report = Report(path=path)
    for name in STEP_FILES:
        if (path / name).is_file():
            report.steps = _read_table(path / name)
            break
    if (path / "requests.csv").is_file():
        report.requests = _read_table(path / "requests.csv")
    if (path / "summary.csv").is_file():
        report.summary = _read_table(path / "summary.csv")
    if (path / "meta.json").is_file():
        try:
            report.meta = json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise KvsimError(f"cannot read meta.json: {exc}", source=str(path / "meta.json")) from None
        if not isinstance(report.meta, dict):  # `null` or a list: every lookup in it would be a traceback
            raise KvsimError(f"expected a JSON object, got {type(report.meta).__name__}", source=str(path / "meta.json"))
    if not report.is_replay:
        tables = {p.stem: _read_table(p) for p in sorted(path.glob("*.csv"))}
        report.bench = {stem: t for stem, t in tables.items() if {"op", "kernel"} <= set(t.columns)}
    return report


def find_reports(root: str | Path) -> list[Path]:
    """Every directory under `root` (itself included) that holds replay files or CSVs, sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for directory in sorted([root, *(p for p in root.rglob("*") if p.is_dir())]):
        if any((directory / f).is_file() for f in REPLAY_FILES) or any(directory.glob("*.csv")):
            found.append(directory)
    return found
