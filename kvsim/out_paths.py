"""Output paths checked before a command does its work: a directory or a file that can be written.

Every `--out` goes through here, so a path that cannot be used is one KvsimError, raised before a
benchmark or replay runs, never an OSError traceback after it.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvsim.errors import KvsimError


def out_option(value: str | None, *, field: str = "--out") -> Path | None:
    """`--out` as typed: None when not given; an empty path is refused (it would mean the default, or the
    current directory, without saying so)."""
    if value is None:
        return None
    if not value.strip():
        raise KvsimError("an empty path; give a directory, or leave the option out for the default", field=field)
    return Path(value)


def output_dir(path: str | Path, *, field: str = "--out", create: bool = True) -> Path:
    """Create directory `path` (and its parents) if needed and check it is writable; returns it.

    With `create` False nothing is made: the nearest existing ancestor must be a writable directory (a
    check before a long run whose failure should leave no empty directory behind).
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise KvsimError(f"{out} is a file, not a directory", field=field)
    if not create:
        ancestor = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
        if not ancestor.is_dir():
            raise KvsimError(f"cannot create the directory {out}: {ancestor} is a file", field=field)
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise KvsimError(f"cannot write into the directory {ancestor}: permission denied", field=field)
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file among the parents, no permission, a read-only or virtual file system
        raise KvsimError(f"cannot create the directory {out}: {exc.strerror or exc}", field=field) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise KvsimError(f"cannot write into the directory {out}: permission denied", field=field)
    return out


def output_file(path: str | Path, *, field: str = "--out") -> Path:
    """Check that file `path` can be written (creating its parent directory); returns it.

    An existing file is overwritten; an existing directory is refused.
    """
    out = Path(path)
    if out.is_dir():
        raise KvsimError(f"{out} is a directory; give a file name such as {out / 'result.csv'}", field=field)
    output_dir(out.parent, field=field)
    if out.exists() and not os.access(out, os.W_OK):
        raise KvsimError(f"cannot overwrite {out}: permission denied", field=field)
    return out
