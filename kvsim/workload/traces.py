"""Request traces from files: Vidur's CSV, the Azure LLM inference trace CSV, BurstGPT's CSV, JSONL and Mooncake's JSONL.

The form is told by the header (CSV) or by a leading '{' (JSONL) and its keys:

    vidur     arrived_at,num_prefill_tokens,num_decode_tokens     seconds
    azure     TIMESTAMP,ContextTokens,GeneratedTokens             date-times
    burstgpt  Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type   seconds; filter by Model, Log Type
    jsonl     {"arrival_time": s, "prompt_tokens": n, "output_tokens": n}   seconds, one object per line
    mooncake  {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}   see kvsim.workload.trace_mooncake

Arrival times become seconds from the first request (which arrives at t = 0, as in a synthetic workload), so
epoch seconds or a slice from the middle of a day replay the same. Extra columns (named in the header) or keys are
ignored; a row with more cells than the header has is an error, as is one short of the columns read ('1.0,396,10,9'
under a 3-column header was read as 10 output tokens). A bad row is a KvsimError naming the file, line number and column.
"""

from __future__ import annotations

import csv
import sys
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Literal

import numpy as np

from kvsim.workload.distributions import MAX_ARRIVAL_S, MAX_TOKENS
from kvsim.workload.jsonl_row import JsonlRowReader
from kvsim.errors import KvsimError
from kvsim.workload.trace_mooncake import is_mooncake, read_mooncake

TraceForm = Literal["vidur", "azure", "burstgpt", "jsonl", "mooncake"]
# The columns (or JSON keys) of each form: arrival, prompt tokens, output tokens.
COLUMNS: dict[str, tuple[str, str, str]] = {
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
    "jsonl": ("arrival_time", "prompt_tokens", "output_tokens"),
}


@dataclass(frozen=True)
class Trace:
    """A trace's requests sorted by arrival (stable: ties keep file order).

    `hash_ids` (Mooncake only) name each request's 512-token prompt blocks, chained: equal leading ids, equal prefix.
    """

    path: Path
    form: TraceForm
    arrival_time: np.ndarray  # (n,) float64 seconds, non-decreasing
    num_prompt_tokens: np.ndarray  # (n,) int64, >= 1
    num_output_tokens: np.ndarray  # (n,) int64, >= 0
    hash_ids: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_time)
        assert len(self.num_prompt_tokens) == len(self.num_output_tokens) == n
        assert self.hash_ids is None or len(self.hash_ids) == n

    def __len__(self) -> int:
        return len(self.arrival_time)


def read_trace(path: str | Path, *, time_scale: float = 1.0, limit: int | None = None,
               model: str | None = None, log_type: str | None = None) -> Trace:
    """Read a trace file; arrival times are multiplied by `time_scale` and only the first `limit` requests
    (by arrival) are kept. `model` and `log_type` keep only BurstGPT rows with that Model / Log Type."""
    assert time_scale > 0 and (limit is None or limit >= 1)
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvsimError(f"cannot read trace: {getattr(exc, 'strerror', None) or exc}", source=source) from None
    hash_ids = None
    stripped = text.lstrip()
    if stripped.startswith("{") and is_mooncake(stripped.split("\n", 1)[0]):
        form, rows = "mooncake", None
        arrival, prompt, output, hash_ids = read_mooncake(text, source)
    elif stripped.startswith("{"):
        form, rows = "jsonl", _jsonl_rows(text, source)
    else:
        form, rows = _csv_rows(text, source, model=model, log_type=log_type)
    if (model is not None or log_type is not None) and form != "burstgpt":
        raise KvsimError(f"model and log_type filter BurstGPT traces; this is a {form} trace", source=source)
    if rows is not None and not rows:
        wanted = [f"{k} {v!r}" for k, v in (("Model", model), ("Log Type", log_type)) if v is not None]
        raise KvsimError("trace has no requests" + (" with " + " and ".join(wanted) if wanted else ""), source=source)
    if rows is not None:
        columns = _columns_fast(form, rows) if form != "jsonl" else None
        arrival, prompt, output = columns if columns is not None else _columns_by_row(form, rows, source)
    # Seconds from the first request, whatever the form: absolute date-times, or epoch seconds in a JSONL, would
    # otherwise start the clock decades in (throughput over that span, and a float's resolution at 1.7e9 s is
    # 2.4e-7 s, coarser than a decode step's share of it).
    arrival -= arrival.min()
    order = np.argsort(arrival, kind="stable")[:limit]  # (n,)
    late = np.flatnonzero(arrival[1:] < arrival[:-1])  # (k,) rows that arrive before the row above them
    if len(late):
        _say_unsorted(source, int(late[0]) + 2, int(len(late)), len(arrival))
    with np.errstate(over="ignore"):
        scaled = arrival[order] * time_scale  # (n,) checked below
    if not np.all(np.isfinite(scaled)):
        raise KvsimError(f"time_scale {time_scale:g} overflows the arrival times (latest {arrival.max():g} s)", source=source)
    if len(scaled) and scaled[-1] > MAX_ARRIVAL_S:  # 1e16 s resolves only 2 s: every TTFT and TPOT would read 0
        scale = f" x time_scale {time_scale:g}" if time_scale != 1 else ""
        raise KvsimError(f"the last arrival is {scaled[-1]:.3g} s after the first{scale}, past {MAX_ARRIVAL_S:g} s, the "
                         "latest arrival kvsim replays (beyond it a double does not resolve a step's time)", source=source)
    ids = tuple(hash_ids[i] for i in order.tolist()) if hash_ids is not None else None
    return Trace(path, form, scaled, prompt[order], output[order], ids)


_told: set[str] = set()  # traces already said to be unsorted by this process (a sweep reads one per point)


def _say_unsorted(source: str, first: int, num_late: int, n: int) -> None:
    """One line on stderr: the trace's rows are replayed in arrival order, not file order, and what ids mean."""
    if source in _told:
        return
    _told.add(source)
    print(f"kvsim: {source}: arrivals are not in file order (request {first:,} of the file arrives before the one above "
          f"it; {num_late:,} of {n:,} do): replayed sorted by arrival, ties in file order; request ids number the "
          "requests in that order (0 arrives first)", file=sys.stderr)


def _columns_fast(form: TraceForm, rows: list) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Whole columns parsed by numpy at once (a CSV's cells are strings); None if any cell is not clean, so
    that `_columns_by_row` finds and names the bad one."""
    _, times, prompts, outputs = zip(*rows)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. numpy's warning on a timezone offset: take the slow path
            if form == "azure":  # nanosecond integers, made relative before they become float seconds
                stamps = np.array(times, dtype="datetime64[ns]")  # (n,)
                arrival = (stamps - stamps.min()) / np.timedelta64(1, "s")
            else:
                arrival = np.array(times, dtype=np.float64)  # (n,)
            prompt, output = np.array(prompts, dtype=np.float64), np.array(outputs, dtype=np.float64)  # (n,)
    except (ValueError, TypeError, Warning):
        return None
    counts_ok = (np.all(prompt >= 1) and np.all(output >= 0) and np.all(prompt <= MAX_TOKENS)
                 and np.all(output <= MAX_TOKENS) and np.all(prompt % 1 == 0) and np.all(output % 1 == 0))
    if not (np.all(np.isfinite(arrival)) and np.all(arrival >= 0) and np.all(np.isfinite(prompt + output)) and counts_ok):
        return None
    return arrival.astype(np.float64), prompt.astype(np.int64), output.astype(np.int64)


def _columns_by_row(form: TraceForm, rows: list, source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Columns parsed cell by cell; the first bad cell raises a KvsimError naming its line and column."""
    arrival_col, prompt_col, output_col = COLUMNS[form]
    # date-times as exact integer microseconds, made relative before they become float seconds
    arrival = np.empty(len(rows), dtype=np.int64 if form == "azure" else np.float64)
    prompt = np.empty(len(rows), dtype=np.int64)
    output = np.empty(len(rows), dtype=np.int64)
    parse_time = _parse_datetime if form == "azure" else _parse_seconds
    for i, (lineno, t, p, o) in enumerate(rows):
        where = f"line {lineno}, column "
        arrival[i] = parse_time(t, source, where + arrival_col)
        prompt[i] = _parse_count(p, source, where + prompt_col, minimum=1)
        output[i] = _parse_count(o, source, where + output_col, minimum=0)
    if form == "azure":
        arrival = (arrival - arrival.min()) / 1e6
    return arrival, prompt, output


def _csv_rows(text: str, source: str, *, model: str | None,
              log_type: str | None) -> tuple[TraceForm, list[tuple[int, object, object, object]]]:
    """(form, [(line number, arrival, prompt, output)]) from a CSV whose header names the form; BurstGPT rows
    of another `model` or `log_type` than asked are left out."""
    lines = text.splitlines()
    skipped = 0
    while skipped < len(lines) and not lines[skipped].strip():  # blank lines above the header
        skipped += 1
    reader = csv.reader(lines[skipped:])
    header = [h.strip() for h in next(reader, [])]
    for form in ("vidur", "azure", "burstgpt"):
        if all(col in header for col in COLUMNS[form]):
            break
    else:
        known = "; ".join(",".join(cols) for cols in COLUMNS.values())
        raise KvsimError(f"unrecognised trace header {','.join(header)!r} (expected columns {known})", source=source, field=f"line {skipped + 1}")
    a, p, o = (header.index(col) for col in COLUMNS[form])
    need = max(a, p, o) + 1
    filters = []  # (column index, wanted value)
    for col, wanted in (("Model", model), ("Log Type", log_type)):
        if wanted is not None and form == "burstgpt":
            if col not in header:
                raise KvsimError(f"no {col!r} column to filter by", source=source, field=f"line {skipped + 1}")
            filters.append((header.index(col), wanted))
            need = max(need, header.index(col) + 1)
    rows = []
    for lineno, row in enumerate(reader, start=skipped + 2):
        if len(row) < need or len(row) > len(header):  # a longer row's cells are not where its header says
            if not any(cell.strip() for cell in row):
                continue  # a blank line
            raise KvsimError(f"expected {len(header)} columns, got {len(row)}", source=source, field=f"line {lineno}")
        if all(row[i].strip() == wanted for i, wanted in filters):
            rows.append((lineno, row[a], row[p], row[o]))
    return form, rows


def _jsonl_rows(text: str, source: str) -> list[tuple[int, object, object, object]]:
    keys = COLUMNS["jsonl"]
    reader = JsonlRowReader(keys)
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        obj = reader.read(line, source, f"line {lineno}")
        rows.append((lineno, obj[keys[0]], obj[keys[1]], obj[keys[2]]))
    return rows


def _parse_seconds(value: object, source: str, field: str) -> float:
    try:
        seconds = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not np.isfinite(seconds) or seconds < 0:
        raise KvsimError(f"expected seconds >= 0, got {value!r}", source=source, field=field)
    return seconds


def _parse_datetime(value: object, source: str, field: str) -> int:
    """POSIX microseconds of an ISO date-time ('2023-11-16 18:15:46.6805900'); naive ones are read as UTC."""
    text = str(value).strip()
    if "." in text:  # fromisoformat takes at most 6 fractional digits; Azure writes 7
        head, _, frac = text.partition(".")
        digits = len(frac) - len(frac.lstrip("0123456789"))
        text = head + "." + frac[: min(digits, 6)] + frac[digits:]
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        raise KvsimError(f"expected a date-time like '2023-11-16 18:15:46.68', got {value!r}", source=source, field=field) from None
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc if stamp.tzinfo is not None else None)
    return (stamp - epoch) // timedelta(microseconds=1)  # exact: a float of POSIX seconds keeps only ~0.2 µs


def _parse_count(value: object, source: str, field: str, *, minimum: int) -> int:
    """A token count: an integer (or integral float, as some CSV writers produce) >= minimum."""
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not np.isfinite(number) or not number.is_integer() or not minimum <= number <= MAX_TOKENS:
        raise KvsimError(f"expected a whole number from {minimum} to {MAX_TOKENS:,}, got {value!r}", source=source, field=field)
    return int(number)
