"""The replay's report tables written through Arrow, without importing pandas (~0.2 CPU s of a replay command):
columns of numpy arrays and lists of labels become steps.parquet and kernels.parquet with the schema metadata
pandas' `to_parquet` gives them (the same bytes), requests.csv and steps.csv through Arrow's CSV writer, and
summary.csv as pandas' `to_csv` formats it. Where pandas would have typed a column otherwise (a gap, a mixed
column, a pandas other than 3), the caller writes through pandas instead: `None` or `False` says so.
"""

from __future__ import annotations

import csv
import io
import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np

Columns = dict[str, "np.ndarray | list"]  # name -> (n,) int64/float64 array, or a list of str (or None) of n


@lru_cache(maxsize=None)
def installed_version(package: str) -> str | None:
    """The installed `package`'s version, read from its metadata (importing pandas costs what this module saves;
    each lookup searches the path's distributions, so one per package and process)."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _pandas_version() -> str | None:
    return installed_version("pandas")


def writes_pandas_bytes() -> bool:
    """Whether `write_parquet` can promise pandas' bytes: pandas 3 (its `str` dtype) with a pyarrow of 22 or newer,
    whose pandas metadata carries the frame's `attributes` (apache/arrow#47147), as `pandas_metadata` writes it."""
    pandas, arrow = _pandas_version(), installed_version("pyarrow")
    return (pandas or "").split(".")[0] == "3" and arrow is not None and int(arrow.split(".")[0]) >= 22


def arrow_table(columns: Columns):
    """`columns` as pandas 3 hands a DataFrame of them to Arrow (`pa.Table.from_pandas`, no index): int64 and float64
    arrays as they are (a float NaN becomes a null, pandas' missing value), text as large_string (pandas 3's `str`
    dtype; a column of None only is Arrow's null type, as an object column of them is); None for an array of any
    other dtype; an empty list is text, as the replay's labels were when no row had one). Built from buffers:
    `pa.array` imports pandas to look for its objects."""
    import pyarrow as pa

    arrays = []
    for name, values in columns.items():
        if isinstance(values, np.ndarray):
            if values.dtype not in (np.int64, np.float64) or values.ndim != 1:
                return None
            values = np.ascontiguousarray(values)
            missing = np.isnan(values) if values.dtype == np.float64 else None
            arrays.append(pa.Array.from_buffers(pa.int64() if values.dtype == np.int64 else pa.float64(), len(values),
                                                [_validity(missing), pa.py_buffer(values)]))
        elif values and all(v is None for v in values):
            arrays.append(pa.nulls(len(values)))
        else:
            encoded = [b"" if v is None else v.encode("utf-8") for v in values]
            offsets = np.zeros(len(values) + 1, dtype=np.int64)  # (n + 1,) byte offsets of each string
            np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
            missing = np.fromiter((v is None for v in values), dtype=bool, count=len(values))
            arrays.append(pa.Array.from_buffers(pa.large_string(), len(values),
                                                [_validity(missing), pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]))
    return pa.Table.from_arrays(arrays, names=list(columns))


def _validity(missing: np.ndarray | None):
    """Arrow's validity bitmap (bit i set: value i present), or None where nothing is missing."""
    import pyarrow as pa

    if missing is None or not missing.any():
        return None
    return pa.py_buffer(np.packbits(~missing, bitorder="little"))


# Arrow type -> (pandas_type, numpy_type) in the metadata pandas 3 writes for a DataFrame column of that dtype.
_PANDAS_TYPES = {"int64": ("int64", "int64"), "double": ("float64", "float64"), "large_string": ("object", "str")}


def pandas_metadata(table) -> bytes | None:
    """The b'pandas' schema metadata `pa.Table.from_pandas(frame, preserve_index=False)` gives a pandas 3 DataFrame
    of these columns (pyarrow.pandas_compat.construct_metadata), or None for a column type not in _PANDAS_TYPES."""
    import pyarrow as pa

    columns = []
    for field in table.schema:
        types = _PANDAS_TYPES.get(str(field.type))
        if types is None:
            return None
        columns.append({"name": field.name, "field_name": field.name, "pandas_type": types[0], "numpy_type": types[1],
                        "metadata": None})
    return json.dumps({
        "index_columns": [], "column_indexes": [], "columns": columns, "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": _pandas_version(),
    }).encode("utf8")


def write_parquet(columns: Columns, path: Path) -> bool:
    """Write `columns` as `pd.DataFrame(columns).to_parquet(path, index=False)` does, byte for byte, without pandas;
    False (nothing written) where this cannot promise that (`writes_pandas_bytes`), or for a column type it does not know."""
    if not writes_pandas_bytes():
        return False
    import pyarrow.parquet as pq

    table = arrow_table(columns)
    meta = pandas_metadata(table) if table is not None else None
    if meta is None:
        return False
    with open(path, "wb") as sink:  # opened here, as pandas opens it: an OSError names the file
        pq.write_table(table.replace_schema_metadata({b"pandas": meta}), sink, compression="snappy")
    return True


def write_csv(columns: Columns, path: Path) -> bool:
    """A large table as CSV through Arrow's C++ writer (10x pandas' speed; floats in shortest round-trip form, a
    NaN as an empty field; a field quoted where it needs it, text always); False (nothing written) for a column
    `arrow_table` does not take."""
    import pyarrow.csv as pa_csv

    table = arrow_table(columns)
    if table is None:
        return False
    pa_csv.write_csv(table, path, write_options=pa_csv.WriteOptions(quoting_style="needed"))
    return True


def summary_csv(records: list[dict], float_format: str) -> str | None:
    """`pd.DataFrame(records).to_csv(index=False, float_format=float_format)`'s text, or None where pandas would
    type a column other than by one kind of value: records with different keys (a gap is a NaN, and turns an
    int column to floats) or a column mixing kinds (ints with floats, text with numbers, None)."""
    if not records or any(list(r) != list(records[0]) for r in records):
        return None
    columns = {key: [r[key] for r in records] for key in records[0]}
    cells = []
    for values in columns.values():
        kind = _kind(values)
        if kind is None:
            return None
        if kind == "float":
            cells.append(["" if math.isnan(v) else float_format % v for v in values])
        elif kind == "int":
            cells.append([str(int(v)) for v in values])
        else:  # bool as True/False, str as it is
            cells.append([str(v) for v in values])
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_MINIMAL)  # pandas' CSV writer settings
    writer.writerow(list(columns))
    writer.writerows(zip(*cells))
    return out.getvalue()


def _kind(values: list) -> str | None:
    """'bool', 'int', 'float' or 'str' where every value is one (numpy scalars too), else None."""
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return "bool"
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values):
        return "int" if all(-(2**63) <= int(v) < 2**63 for v in values) else None
    if all(isinstance(v, (float, np.floating)) for v in values):
        return "float"
    if all(isinstance(v, str) for v in values):
        return "str"
    return None
