"""A sweep's results: a journal (rows.jsonl, one line per finished task, appended as results arrive, what a
rerun resumes from) and the table built from it (results.parquet, results.csv on request), rows in task order.

The table is a function of the journal's rows alone (every row round-trips through JSON first), so a fresh
run, a resumed one, the local backend and Ray write the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.sweep.points import Task

JOURNAL = "rows.jsonl"
META = "sweep.json"  # the sweep's axes and chart metrics, for `kvsim plot`
TABLE = "results.parquet"
TABLE_CSV = "results.csv"


class Results:
    """The rows of one sweep under `out_dir`: those already journaled and those added now."""

    def __init__(self, out_dir: Path, tasks: list[Task], *, meta: dict | None = None):
        self.out_dir = Path(out_dir)
        self.tasks = tasks
        self.meta = meta or {}
        self.rows: dict[str, dict] = {}  # key -> row (a later line for a key replaces an earlier one)
        self._journal = None
        wanted = {t.key for t in tasks}
        path = self.out_dir / JOURNAL
        if path.is_file():
            for lineno, line in enumerate(path.read_text().splitlines(), start=1):
                try:
                    entry = json.loads(line)
                    key, row = entry["key"], entry["row"]
                except (ValueError, KeyError, TypeError):  # a line cut short by a kill: that task reruns
                    continue
                if key in wanted:
                    self.rows[key] = row

    def pending(self) -> list[Task]:
        """Tasks without a finished row: never run, or failed (a failure is retried on a rerun)."""
        return [t for t in self.tasks if t.key not in self.rows or self.rows[t.key].get("error") is not None]

    def add(self, task: Task, row: dict) -> None:
        """Journal `row` at once (flushed), so a kill loses nothing finished."""
        if self._journal is None:
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                self._journal = open(self.out_dir / JOURNAL, "a")
            except OSError as exc:
                raise KvsimError(f"cannot write {self.out_dir / JOURNAL}: {exc.strerror or exc}", field="--out") from None
        line = json.dumps({"key": task.key, "row": row}, allow_nan=False)
        self._journal.write(line + "\n")
        self._journal.flush()
        self.rows[task.key] = json.loads(line)["row"]

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    @property
    def num_failed(self) -> int:
        return sum(1 for t in self.tasks if self.rows.get(t.key, {}).get("error") is not None)

    def frame(self):
        """The table: one row per finished task in task order; columns in the order rows first name them."""
        import pandas as pd

        rows = [self.rows[t.key] for t in self.tasks if t.key in self.rows]
        columns: dict[str, None] = {}
        for row in rows:
            columns.update(dict.fromkeys(k for k in row if k != "error"))
        columns["error"] = None
        cells = {c: [row.get(c) for row in rows] for c in columns}
        for name, values in cells.items():  # an axis mixing kinds ("4GiB" and 2**32) becomes text
            kinds = {float if type(v) is int else type(v) for v in values if v is not None}
            if len(kinds) > 1:
                cells[name] = [None if v is None else str(v) for v in values]
        return pd.DataFrame(cells, columns=list(columns))

    def write(self, *, csv: bool = False) -> list[Path]:
        """Write results.parquet (and results.csv); the paths written."""
        frame = self.frame()
        paths = [self.out_dir / TABLE]
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            frame.to_parquet(paths[0], index=False)
            (self.out_dir / META).write_text(json.dumps(self.meta, indent=1) + "\n")
            if csv:
                paths.append(self.out_dir / TABLE_CSV)
                frame.to_csv(paths[1], index=False)
        except OSError as exc:  # a directory where the table goes, a full disk
            raise KvsimError(f"cannot write {exc.filename or self.out_dir}: {exc.strerror or exc}", field="--out") from None
        return paths
