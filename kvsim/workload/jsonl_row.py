"""One JSON object per line, as the JSONL trace readers take it: the object, or one error naming the line."""

from __future__ import annotations

import json

from kvsim.errors import KvsimError


class JsonlRowReader:
    """Reads lines that must each be a JSON object holding every one of `keys` once.

    json.loads keeps the last of a key given twice, so `{"input_length": 100, "input_length": 5000}` would be read
    as 5000 silently. A line whose names, counted as `":` (one scan of the line), are as many as the object's keys
    repeats none; any other (a repeat, a nested object, `":` inside a string, a space before a colon) is parsed
    again with its pairs kept, and a repeated name at the top level is an error."""

    __slots__ = ("keys",)

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys

    def read(self, line: str, source: str, field: str) -> dict:
        """`line` as a JSON object; else a KvsimError naming `field`."""
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise KvsimError(f"not valid JSON: {exc.msg} at column {exc.colno}", source=source, field=field) from None
        if not isinstance(obj, dict):
            raise KvsimError("expected a JSON object", source=source, field=field)
        for key in self.keys:
            if key not in obj:
                raise KvsimError(f"missing key {key!r}", source=source, field=field)
        if line.count('":') != len(obj):
            self._check_repeats(line, source, field)
        return obj

    def _check_repeats(self, line: str, source: str, field: str) -> None:
        names = [name for name, _ in json.loads(line, object_pairs_hook=list)]  # the top level's, in order
        for name in dict.fromkeys(names):
            if names.count(name) > 1:
                raise KvsimError(f"key {name!r} given {names.count(name)} times (which one holds?)", source=source,
                                 field=field)

