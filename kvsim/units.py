"""Byte quantities and dtype widths: parsing '80GiB' / '4GB', formatting for tables."""

from __future__ import annotations

import re

from kvsim.errors import KvsimError

# Bytes per element of each KV / weight dtype kvsim knows. fp8 covers e4m3 and e5m2.
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,  # weights only (GPTQ/AWQ-style); never a KV dtype
}
KV_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def dtype_bytes(name: str, *, field: str = "dtype", source: str | None = None, kv: bool = False) -> float:
    """Bytes per element of dtype `name`; a KvsimError naming `field` if unknown."""
    key = str(name).lower()
    allowed = KV_DTYPES if kv else tuple(DTYPE_BYTES)
    if key not in DTYPE_BYTES or (kv and key == "int4"):
        raise KvsimError(f"unknown dtype {name!r} (choose from {', '.join(allowed)})", source=source, field=field)
    return DTYPE_BYTES[key]


def parse_bytes(text: str | int | float, *, field: str = "bytes", source: str | None = None, allow_zero: bool = False) -> int:
    """'80GiB' -> 85899345920, '4GB' -> 4e9, 1024 -> 1024. Decimal (GB) and binary (GiB) units both accepted.

    Sizes must be positive, except where `allow_zero` (a pool that may be absent, such as swap space).
    """
    if isinstance(text, bool):
        raise KvsimError(f"expected a byte size like '80GiB', got {text!r}", source=source, field=field)
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _BYTES_RE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise KvsimError(f"expected a byte size like '80GiB' or '40GB', got {text!r}", source=source, field=field)
        value, unit = float(m.group(1)), m.group(2).lower()
    if not value * _UNITS[unit] < float("inf"):  # '1e400GB' would overflow int()
        raise KvsimError(f"byte size must be finite, got {text!r}", source=source, field=field)
    if _UNITS[unit] == 1 and not value.is_integer():  # '1.5' bytes: int() would say 1 without a word
        raise KvsimError(f"a count of bytes must be whole, got {text!r} (give a unit: '1.5GiB')", source=source, field=field)
    result = int(value * _UNITS[unit])
    if result < 0 or (result == 0 and not allow_zero):
        raise KvsimError(f"byte size must be {'>= 0' if allow_zero else 'positive'}, got {text!r}", source=source, field=field)
    return result


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary units: 114688 -> '112.0 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
