"""The field-by-field YAML reader: typed getters over one mapping that raise KvsimError naming the file and
the field path (`requests.arrival.rate`), and reject keys nobody asked for."""

from __future__ import annotations

import math
from typing import Any

from kvsim.errors import KvsimError
from kvsim.units import parse_bytes

_REQUIRED: Any = object()  # default for fields that must be given


class Fields:
    """One YAML mapping read field by field; each reader checks type and range and names the field in errors.

    `done()` rejects keys that no reader asked for, so typos are caught.
    """

    def __init__(self, raw: Any, *, source: str, prefix: str = ""):
        if not isinstance(raw, dict):
            where = prefix or None
            raise KvsimError(f"expected a mapping of fields, got {_show(raw)}", source=source, field=where)
        self.raw, self.source, self.prefix = raw, source, prefix
        self._seen: set[str] = set()

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str, message: str) -> KvsimError:
        return KvsimError(message, source=self.source, field=self.path(key))

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """The raw value; `default` when absent or null (an error if there is none)."""
        self._seen.add(key)
        value = self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                given = f" (given here: {', '.join(map(str, self.raw))})" if self.raw else ""
                raise self.error(key, f"is required{given}")  # names the keys present, to show a typo
            return default
        return value

    def int(self, key: str, default: Any = _REQUIRED, *, min: int | None = None, max: int | None = None) -> int | None:
        """A whole number in [min, max]; a YAML integer is kept exactly (a seed above 2**53 stays itself)."""
        if not self.has(key):
            return self.get(key, default)
        value = self.get(key)
        number = self._number(value, self.path(key), integer=True, min=min, max=max)
        return value if isinstance(value, int) else int(number)

    def float(self, key: str, default: Any = _REQUIRED, *, min: float | None = None, max: float | None = None,
              exclusive: bool = False) -> float | None:
        """A finite number in [min, max]; `exclusive` makes the bounds strict."""
        if not self.has(key):
            return self.get(key, default)
        return self._number(self.get(key), self.path(key), min=min, max=max, exclusive=exclusive)

    def str(self, key: str, default: Any = _REQUIRED) -> str | None:
        if not self.has(key):
            return self.get(key, default)
        value = self.get(key)
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"must be a non-empty string, got {_show(value)}")
        return value.strip()

    def choice(self, key: str, choices: tuple[str, ...], default: Any = _REQUIRED) -> str:
        value = self.get(key, default)
        if value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}; got {_show(value)}")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {_show(value)}")
        return value

    def bytes(self, key: str, default: Any = _REQUIRED, *, allow_zero: bool = False) -> int | None:
        if not self.has(key):
            return self.get(key, default)
        return parse_bytes(self.get(key), field=self.path(key), source=self.source, allow_zero=allow_zero)

    def int_list(self, key: str, *, min: int, max: int | None = None) -> list[int]:
        return [int(self._number(v, f"{self.path(key)}[{i}]", integer=True, min=min, max=max)) for i, v in enumerate(self._list(key))]

    def float_list(self, key: str, *, min: float) -> list[float]:
        return [self._number(v, f"{self.path(key)}[{i}]", min=min) for i, v in enumerate(self._list(key))]

    def sub(self, key: str, default: Any = _REQUIRED) -> Fields | None:
        """A nested mapping, read with its own Fields (field paths continue: `requests.arrival.rate`)."""
        if not self.has(key):
            return self.get(key, default)
        return Fields(self.get(key), source=self.source, prefix=self.path(key))

    def subs(self, key: str) -> list[Fields]:
        """A list of mappings, each read with its own Fields (`allocators[2].block_size`)."""
        return [Fields(item, source=self.source, prefix=f"{self.path(key)}[{i}]") for i, item in enumerate(self._list(key))]

    def only(self, known: tuple[str, ...]) -> None:
        """Reject, before any field is read, keys outside `known`: a typo (`kv_budgett`) is named as itself,
        not reported as whatever required field it was meant to be."""
        unknown = [k for k in self.raw if k not in known]
        if unknown:
            import difflib

            hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(str(k), known, n=1)) else str(k)
                     for k in unknown]  # fmt: skip
            raise KvsimError(f"unknown field(s) {', '.join(hints)} (known here: {', '.join(sorted(known))})",
                             source=self.source, field=self.prefix or None)

    def done(self) -> None:
        unknown = [k for k in self.raw if k not in self._seen]
        if unknown:
            known = ", ".join(sorted(self._seen))
            raise KvsimError(f"unknown field(s) {', '.join(map(str, unknown))} (known here: {known})",
                             source=self.source, field=self.prefix or None)

    def _list(self, key: str) -> list:
        value = self.get(key)
        if not isinstance(value, list) or not value:
            raise self.error(key, f"must be a non-empty list, got {_show(value)}")
        return value

    def _number(self, value: Any, field: str, *, integer: bool = False, min: float | None = None,
                max: float | None = None, exclusive: bool = False) -> float:
        number = _as_number(value)
        if number is None or (integer and not number.is_integer()):
            kind = "a whole number" if integer else "a number"
            raise KvsimError(f"must be {kind}, got {_show(value)}", source=self.source, field=field)
        if min is not None and (number < min or (exclusive and number == min)):
            raise KvsimError(f"must be {'>' if exclusive else '>='} {_bound(min)}, got {_show(value)}", source=self.source, field=field)
        if max is not None and (number > max or (exclusive and number == max)):
            raise KvsimError(f"must be {'<' if exclusive else '<='} {_bound(max)}, got {_show(value)}", source=self.source, field=field)
        return number


def _as_number(value: Any) -> float | None:
    """A finite float from an int, float or numeric string ('1e-2': YAML 1.1 reads it as a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits
            return None
    elif isinstance(value, str):
        try:
            number = float(value.replace("_", ""))
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def _bound(x: float) -> str:
    """A range bound as a reader writes it: 16,777,216 rather than 1.67772e+07; 0.5 as 0.5."""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
