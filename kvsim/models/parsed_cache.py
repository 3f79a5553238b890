"""The data files' YAML texts kept parsed on disk between runs: `kvsim size` then never loads PyYAML (its import
alone is ~90 M instructions, more than parsing the one model and one GPU it needs).

One file per data file in the cache folder: `$KVSIM_DATA_CACHE`, else `$XDG_CACHE_HOME/kvsim/data`, else
`~/.cache/kvsim/data` (`KVSIM_DATA_CACHE=off` turns the cache off). It maps each YAML text parsed (an entry, or the
one-line fields of every entry) to its parse, written with `marshal` in this Python's format (the file's name holds
`sys.implementation.cache_tag`) behind a CRC-32 of the data. A text is its own key, so an edited entry is a miss,
never a stale hit. The cache is never required: a missing, unreadable, corrupt or foreign file is a miss, a folder
that cannot be written is not written, and a miss parses with PyYAML as without a cache. Files are replaced whole
(written aside, then renamed), so a reader never sees half of one.
"""

from __future__ import annotations

import marshal
import os
import sys
import zlib

_MAGIC = b"kvsim-parsed-1\n"
_MAX_TEXTS = 512  # past this many texts (a data file edited again and again) a cache file starts afresh
_tables: dict[str, dict] = {}  # the texts read from each cache file, by its path


def cache_folder() -> str | None:
    """The folder of the cache files, or None where the cache is off."""
    explicit = os.environ.get("KVSIM_DATA_CACHE")
    if explicit is not None:
        return None if explicit.strip().lower() in ("", "off", "0") else os.path.expanduser(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvsim", "data")


def cache_path(file: str) -> str | None:
    """The cache file of data file `file` (e.g. kvsim/models/data/models.yaml), or None where the cache is off."""
    folder = cache_folder()
    if folder is None:
        return None
    return os.path.join(folder, f"{os.path.basename(file)}.{sys.implementation.cache_tag}.marshal")


def _read(path: str) -> dict:
    """The texts a cache file holds; {} for a missing, unreadable, corrupt or foreign one."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
        if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + 4:
            return {}
        data = blob[len(_MAGIC) + 4:]
        if zlib.crc32(data) != int.from_bytes(blob[len(_MAGIC):len(_MAGIC) + 4], "little"):
            return {}
        table = marshal.loads(data)
    except Exception:  # OSError, EOFError, ValueError, TypeError...: any fault is a miss
        return {}
    return table if isinstance(table, dict) else {}


def _write(path: str, table: dict) -> None:
    """`table` as the cache file at `path`, replaced whole; nothing where the folder cannot be written."""
    try:
        data = marshal.dumps(table)
    except ValueError:  # a value marshal cannot hold
        return
    aside = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(aside, "wb") as f:
            f.write(_MAGIC + zlib.crc32(data).to_bytes(4, "little") + data)
        os.replace(aside, path)
    except OSError:
        try:
            os.remove(aside)
        except OSError:
            pass


def cached_parse(text: str, file: str, parse):
    """`parse(text)`, from the cache of data file `file` where it holds `text`; a miss parses and adds it."""
    path = cache_path(file)
    if path is None:
        return parse(text)
    table = _tables.get(path)
    if table is None:
        table = _tables[path] = _read(path)
    if text in table:
        return table[text]
    parsed = parse(text)
    on_disk = _read(path)  # afresh: what another run added since, and none of the objects handed out here
    if len(on_disk) >= _MAX_TEXTS:
        on_disk = {}
    on_disk[text] = parsed
    _write(path, on_disk)  # none where a value is one marshal cannot hold (a YAML date)
    return parsed
