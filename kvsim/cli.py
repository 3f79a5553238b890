"""The command line: declares commands and options, forwards to plain functions, nothing else.

Heavy modules (torch, pandas, matplotlib) are imported inside the commands that need them, so
`kvsim --help` and `kvsim size` start fast.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

import typer

from kvsim.errors import KvsimError

app = typer.Typer(
    name="kvsim",
    help="KV-cache sizing, paged-allocator simulation and real GPU measurements.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable)


def user_errors(fn: F) -> F:
    """The one place a KvsimError becomes one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvsimError as exc:
            typer.echo(f"kvsim: error: {exc}", err=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


# --- commands -----------------------------------------------------------------------------------------
# Each command below only parses options and calls one function of a logic module.


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    sys.exit(main())
