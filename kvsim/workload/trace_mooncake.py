"""Mooncake's trace JSONL (FAST'25 release): lengths, arrivals in ms, and chained ids of 512-token prompt blocks.

One object a line: {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [id, ...]}.
"""

from __future__ import annotations

import json

import numpy as np

from kvsim.workload.distributions import MAX_TOKENS
from kvsim.errors import KvsimError
from kvsim.workload.jsonl_row import JsonlRowReader

# Tokens named by one hash id: the prompt's blocks in Mooncake's own hashing (the last one may be partial).
MOONCAKE_BLOCK_TOKENS = 512
KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
# The largest hash id: a replay keys a block by its id in 40 bits (kvsim.workload.requests.make_block_keys).
MAX_HASH_ID = 2**40 - 1


def is_mooncake(first_line: str) -> bool:
    """Whether a JSONL trace is Mooncake's form (its first object has `hash_ids`)."""
    try:
        obj = json.loads(first_line)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and "hash_ids" in obj


def read_mooncake(text: str, source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """(arrival seconds, prompt tokens, output tokens, hash ids) in file order; arrays (n,) float64/int64.

    `hash_ids` must cover the prompt: ceil(input_length / 512) ids. Ids are chained (an id stands for its block
    and everything before it), so an id always sits at the same position, after the same parent, covering the
    same number of tokens; a trace where it does not is an error naming both lines, since prefix sharing read
    from it would be wrong.
    """
    arrival, prompt, output, ids, lines = [], [], [], [], []
    reader = JsonlRowReader(KEYS)
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        field = f"line {lineno}"
        obj = reader.read(line, source, field)
        t = obj["timestamp"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise KvsimError(f"expected milliseconds >= 0, got {t!r}", source=source, field=f"{field}, key timestamp")
        p = _count(obj["input_length"], 1, source, f"{field}, key input_length")
        o = _count(obj["output_length"], 0, source, f"{field}, key output_length")
        h = obj["hash_ids"]
        need = -(-p // MOONCAKE_BLOCK_TOKENS)
        if not isinstance(h, list) or len(h) != need or not all(type(x) is int for x in h) or min(h) < 0:
            raise KvsimError(f"expected {need} ids >= 0 (one per {MOONCAKE_BLOCK_TOKENS} prompt tokens), got {h!r:.80}",
                             source=source, field=f"{field}, key hash_ids")
        if max(h) > MAX_HASH_ID:  # was an OverflowError (int64) or an AssertionError (the replay's block keys)
            raise KvsimError(f"hash id {max(h)} is past {MAX_HASH_ID:,} (2^40 - 1, the largest a replay keys blocks by)",
                             source=source, field=f"{field}, key hash_ids")
        arrival.append(t / 1000.0)
        prompt.append(p)
        output.append(o)
        ids.append(tuple(h))
        lines.append(lineno)
    prompt_arr = np.array(prompt, dtype=np.int64)
    _check_chained(ids, prompt_arr, lines, source)
    return np.array(arrival, dtype=np.float64), prompt_arr, np.array(output, dtype=np.int64), ids


def _check_chained(ids: list[tuple[int, ...]], prompt: np.ndarray, lines: list[int], source: str) -> None:
    """Every id at one position, after one parent, covering one number of tokens; else a KvsimError naming
    the first line that disagrees with the id's first use."""
    lengths = np.array([len(h) for h in ids], dtype=np.int64)  # (r,)
    if not len(lengths):
        return
    flat = np.fromiter((x for h in ids for x in h), dtype=np.int64, count=int(lengths.sum()))  # (n,)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # (r,)
    position = np.arange(len(flat), dtype=np.int64) - np.repeat(starts, lengths)  # (n,)
    parent = np.concatenate([[-1], flat[:-1]])
    parent[starts] = -1
    covered = np.minimum(MOONCAKE_BLOCK_TOKENS, np.repeat(prompt, lengths) - position * MOONCAKE_BLOCK_TOKENS)
    _, first = np.unique(flat, return_index=True)  # first use of each id, in file order
    owner = first[np.searchsorted(flat[first], flat)]  # (n,) index of each id's first use
    bad = np.flatnonzero((position != position[owner]) | (parent != parent[owner]) | (covered != covered[owner]))
    if len(bad):
        i, f = int(bad[0]), int(owner[bad[0]])
        row = np.repeat(np.arange(len(ids)), lengths)
        raise KvsimError(
            f"hash id {flat[i]} is block {position[i]} after id {parent[i]} covering {covered[i]} tokens here, but block "
            f"{position[f]} after id {parent[f]} covering {covered[f]} tokens at line {lines[row[f]]} (ids must be chained)",
            source=source, field=f"line {lines[row[i]]}, key hash_ids")


def _count(value: object, minimum: int, source: str, field: str) -> int:
    if type(value) is not int or not minimum <= value <= MAX_TOKENS:
        raise KvsimError(f"expected a whole number from {minimum} to {MAX_TOKENS:,}, got {value!r}", source=source, field=field)
    return value
