"""A sweep's points: the axes expanded (grid or zip) into workload mappings, every one validated through
kvsim's workload reader before anything runs, and split into tasks, one per point and allocator."""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvsim.errors import KvsimError
from kvsim.replay.options import ReplayOptions
from kvsim.sweep.spec import Search, SweepSpec

# Setting one of these drops the other: a workload gives exactly one (kv_budget or gpu_memory_utilization).
_EXCLUSIVE = {"kv_budget": "gpu_memory_utilization", "gpu_memory_utilization": "kv_budget"}


@dataclass(frozen=True)
class Task:
    """One unit of work: a point's workload with one allocator, replayed once or searched over one axis.

    `key` hashes everything the row depends on (the mapping, the options, the search, kvsim's code), so a
    rerun skips a task whose row is in the journal and reruns one whose inputs changed.
    """

    point: int  # index of the point in expansion order
    allocator_index: int  # index of the allocator in the point's list
    axis_values: tuple[tuple[str, Any], ...]  # (column, value) per axis, as the table shows them
    allocator: str  # the allocator's label
    workload: dict  # the point's workload mapping, `allocators` holding this one allocator
    workload_path: str  # where the mapping is read as if from (relative paths, error messages)
    options: ReplayOptions
    search: Search | None
    key: str


def set_path(mapping: dict, path: str, value: Any) -> None:
    """Set `value` at dotted `path` in `mapping`, making mappings on the way (`scheduler.max_num_seqs`); a
    numeric part indexes a list (`allocators.0.block_size`)."""
    parts = path.split(".")
    node: Any = mapping
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise KeyError(f"{'.'.join(parts[:i]) or 'the workload'} is a list of {len(node)}; no item {part}")
            key: Any = int(part)
        elif isinstance(node, dict):
            key = part
            if not last and not isinstance(node.get(key), (dict, list)):
                node[key] = {}
        else:
            raise KeyError(f"{'.'.join(parts[:i])} is a value, not a mapping")
        if last:
            node[key] = copy.deepcopy(value)
            if isinstance(node, dict) and node is mapping and key in _EXCLUSIVE:
                node.pop(_EXCLUSIVE[key], None)
        else:
            node = node[key]


def axis_column(value: Any) -> Any:
    """An axis value as a table cell: scalars as given, a mapping or list as compact JSON."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return value


def expand_points(spec: SweepSpec) -> list[tuple[tuple[tuple[str, Any], ...], dict]]:
    """Every point as (axis values, workload mapping), in grid order (the last axis varies fastest) or zipped."""
    paths = [a.path for a in spec.axes]
    if spec.combine == "zip":
        combos = list(zip(*(a.values for a in spec.axes)))
    else:
        combos = list(itertools.product(*(a.values for a in spec.axes)))
    points = []
    for combo in combos:
        mapping = copy.deepcopy(spec.base)
        for path, value in list(spec.fixed) + list(zip(paths, combo)):
            try:
                set_path(mapping, path, value)
            except KeyError as exc:
                field = "set" if (path, value) in spec.fixed else f"axes.{path}"
                raise KvsimError(f"{path} = {value!r}: {exc.args[0]}", source=str(spec.path), field=field) from None
        if isinstance(mapping.get("allocators"), dict):  # an `allocators` alternative of one allocator
            mapping["allocators"] = [mapping["allocators"]]
        points.append((tuple(zip(paths, combo)), mapping))
    return points


def make_tasks(spec: SweepSpec, options: ReplayOptions) -> list[Task]:
    """Expand and validate every point (one error naming the axis and value of the first bad one), then
    split each into one task per allocator."""
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hardware import get_gpu
    from kvsim.replay.run import rank_bytes_per_token, serve_defaults, with_model_kv_dtype
    from kvsim.workload.spec import workload_from_mapping

    tasks = []
    for point, (values, mapping) in enumerate(expand_points(spec)):
        if spec.search is not None:  # the searched axis gets its lowest value for validation
            _set_or_fail(spec, mapping, spec.search.axis, spec.search.value(0), "search.axis")
        try:
            workload = workload_from_mapping(mapping, spec.base_path, sha256="")
            model = resolve_model(workload.model)
            gpu = get_gpu(workload.hardware)
            rank_bytes_per_token(with_model_kv_dtype(workload, model), model, workload.deployment.tp)  # the tp rules
            serve_defaults(workload.allocators, model, gpu.key, str(spec.base_path))  # the model's allocator rules
        except KvsimError as exc:
            raise _point_error(spec, values, exc) from None
        raw_allocators = mapping["allocators"]
        labels = "+".join(config.label for config in workload.allocators)  # an `allocators` axis shows its labels
        columns = tuple((path, labels if path == "allocators" else axis_column(value)) for path, value in values)
        for index, (config, raw) in enumerate(zip(workload.allocators, raw_allocators)):
            single = copy.deepcopy(mapping)
            single["allocators"] = [raw]
            key = _task_key(single, options, spec.search)
            tasks.append(Task(point, index, columns, config.label, single, str(spec.base_path), options, spec.search, key))
    return tasks


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of kvsim's own source and data files: a row journaled by other code is stale, so a rerun after
    kvsim changed (a scheduler fix, a new metric) replays every point instead of mixing old rows with new."""
    root = Path(__file__).resolve().parents[1]  # the kvsim package
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.yaml")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _set_or_fail(spec: SweepSpec, mapping: dict, path: str, value: Any, field: str) -> None:
    try:
        set_path(mapping, path, value)
    except KeyError as exc:
        raise KvsimError(f"{path}: {exc.args[0]}", source=str(spec.path), field=field) from None


def _point_error(spec: SweepSpec, values: tuple[tuple[str, Any], ...], exc: KvsimError) -> KvsimError:
    """The workload reader's error, led by the axis (and value) it concerns: the one whose path the failing
    field starts with, else every axis value of the point."""
    field = {"--model": "model", "--gpu": "hardware"}.get(exc.field or "", exc.field or "")  # the lookups' flag names

    def concerns(p: str) -> bool:  # the path set or varied is the failing field, inside it, or holds it
        return (field == p or field.startswith(p + ".") or field.startswith(p + "[") or p.startswith(field + ".")
                or (p.split(".")[0] == "allocators" and field.startswith("allocators")))

    named = [(p, v) for p, v in values if concerns(p)]
    if not named and field.split(".")[0] in ("model", "hardware"):
        named = [(p, v) for p, v in values if p == field.split(".")[0]]
    fixed = [(p, v) for p, v in spec.fixed if concerns(p)] if not named else []
    if fixed:  # a `set` value, the same at every point
        what = ", ".join(f"{p} = {v!r}" for p, v in fixed)
        return KvsimError(f"{what}: {exc}", source=str(spec.path), field="set")
    shown = named or list(values)
    where = "axes." + ", axes.".join(p for p, _ in shown) if shown else "base"
    what = ", ".join(f"{p} = {v!r}" for p, v in shown)
    return KvsimError(f"{what + ': ' if what else ''}{exc}", source=str(spec.path), field=where)


def _task_key(mapping: dict, options: ReplayOptions, search: Search | None) -> str:
    blob = json.dumps({"workload": mapping, "options": asdict(options), "search": asdict(search) if search else None,
                       "kvsim": code_fingerprint()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]
