"""Where `kvsim size` prints: rich on a terminal; elsewhere (a file, a pipe) the same bytes drawn here, without
importing rich.

Where rich would write no escape codes (the output is not a terminal and no colour is forced), what `kvsim size`
prints is plain text: its tables (rich's heavy-headed box with a left-justified title, or a grid) when they fit
the width, and its word-wrapped lines. `SizeConsole` draws those as rich draws them, byte for byte
(tests/size/test_size_output.py holds rich's output of 12 commands at several widths); what it does not draw (a
table wider than the width, a word longer than a line, text that is not one-cell printable ASCII) and every
terminal go to rich, imported then: its import is ~100 M instructions, a sixth of a bare typer app's start-up.
Text is literal on both paths (no markup, no emoji codes).
"""

from __future__ import annotations

import os
import re
import sys

_WORD = re.compile(r"\s*\S+\s*")  # rich._wrap's word: its leading and trailing whitespace


class Table:
    """A table as `kvsim size` prints it: rich's default table (heavy-headed box, bold header, the title justified
    left) or, as a `grid`, rich's `Table(show_header=False, box=None, padding=(0, 2))`."""

    def __init__(self, title: str | None = None, *, grid: bool = False) -> None:
        self.title = title
        self.grid = grid
        self.headers: list[str] = []
        self.justify: list[str] = []  # "left" or "right", per column
        self.rows: list[tuple[str, ...]] = []

    def add_column(self, header: str = "", justify: str = "left") -> None:
        self.headers.append(header)
        self.justify.append(justify)

    def add_row(self, *cells: str) -> None:
        assert len(cells) == len(self.headers), (cells, self.headers)
        self.rows.append(cells)

    def as_rich(self):
        """The same table as a rich Table."""
        from rich.table import Table as RichTable

        table = RichTable(show_header=False, box=None, padding=(0, 2)) if self.grid else RichTable(title=self.title, title_justify="left")
        for header, justify in zip(self.headers, self.justify):
            table.add_column(header, justify=justify)
        for row in self.rows:
            table.add_row(*row)
        return table


class SizeConsole:
    """Prints text and `Table`s as rich's Console(markup=False, emoji=False) would, drawing them itself where the
    output is plain text and the lines are ones it draws exactly."""

    def __init__(self) -> None:
        self.width: int | None = _console_width() if _plain_output() else None  # None: rich draws everything
        self._rich = None

    def print(self, item: str | Table, *, style: str | None = None, highlight: bool = True, soft_wrap: bool = False) -> None:
        """rich's Console.print of one text (style, highlight and soft_wrap as rich takes them) or one table."""
        lines = None
        if self.width is not None:
            lines = table_lines(item, self.width) if isinstance(item, Table) else text_lines(item, self.width, soft_wrap=soft_wrap)
        if lines is None:
            self._rich_console().print(item.as_rich() if isinstance(item, Table) else item, style=style, highlight=highlight,
                                       soft_wrap=soft_wrap)
            return
        sys.stdout.write("".join(f"{line}\n" for line in lines))
        sys.stdout.flush()  # as rich does after each print: an error line on stderr comes after the tables

    def _rich_console(self):
        if self._rich is None:
            from rich.console import Console

            self._rich = Console(markup=False, emoji=False)
        return self._rich


def text_lines(text: str, width: int, *, soft_wrap: bool = False) -> list[str] | None:
    """The lines rich prints for `text` on a console `width` cells wide (soft_wrap: the text whole, unwrapped);
    None where rich would draw it otherwise than here."""
    if not _one_cell_printable(text):
        return None
    return [text] if soft_wrap else wrap(text, width)


def wrap(text: str, width: int) -> list[str] | None:
    """rich's word wrap (rich._wrap.divide_line, then Text.rstrip_end and truncate) of one-cell text: a word goes
    to the next line when the line has no room for it without its trailing spaces; None where a word is longer
    than the width (rich folds it)."""
    starts, offset = [0], 0
    for word in _WORD.finditer(text):
        start, end = word.span()
        length = len(word.group().rstrip())
        if width - offset >= length:
            offset += end - start
        elif length > width:
            return None
        elif offset and start:
            starts.append(start)
            offset = end - start
    lines = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]
    return [_rstrip_end(line, width)[:width] for line in lines]


def table_lines(table: Table, width: int) -> list[str] | None:
    """The lines rich prints for `table` on a console `width` cells wide, when every column has its natural width
    (its widest cell and the padding); None where rich would shrink the columns, or draw a cell otherwise."""
    cells = table.rows if table.grid else [tuple(table.headers), *table.rows]
    texts = [text for row in cells for text in row] + ([table.title] if table.title else [])
    if not table.rows or not all(_one_cell_printable(text) for text in texts):
        return None
    pad = 2 if table.grid else 1
    widths = [max(len(row[i]) for row in cells) + 2 * pad for i in range(len(table.headers))]
    borders = 0 if table.grid else len(widths) + 1
    if sum(widths) > width - borders:
        return None

    def row_cells(row: tuple[str, ...]) -> list[str]:
        return [" " * pad + (text.rstrip().rjust(w - 2 * pad) if justify == "right" else text.ljust(w - 2 * pad)) + " " * pad
                for text, justify, w in zip(row, table.justify, widths)]

    if table.grid:
        return ["".join(row_cells(row)) for row in table.rows]
    table_width = sum(widths) + borders
    title = wrap(table.title, table_width) if table.title else []
    if title is None:
        return None
    return [
        *(line.ljust(table_width) for line in title),
        "┏" + "┳".join("━" * w for w in widths) + "┓",
        "┃" + "┃".join(row_cells(tuple(table.headers))) + "┃",
        "┡" + "╇".join("━" * w for w in widths) + "┩",
        *("│" + "│".join(row_cells(row)) + "│" for row in table.rows),
        "└" + "┴".join("─" * w for w in widths) + "┘",
    ]


def _rstrip_end(line: str, width: int) -> str:
    """rich's Text.rstrip_end: trailing whitespace beyond the width removed."""
    excess = len(line) - width
    if excess <= 0:
        return line
    return line[: len(line) - min(len(line) - len(line.rstrip()), excess)]


def _one_cell_printable(text: str) -> bool:
    """Text whose every character takes one cell and that rich prints as it is (no tabs, newlines or controls)."""
    return text.isascii() and text.isprintable()


def _plain_output() -> bool:
    """Whether rich's Console() on stdout would write plain text: not a terminal (rich's `is_terminal`:
    TTY_COMPATIBLE, FORCE_COLOR, else isatty), a UTF-8 stream (else rich draws ASCII boxes), outside Windows'
    legacy consoles and Jupyter."""
    if os.name == "nt" or "IPython" in sys.modules:
        return False
    tty_compatible = os.environ.get("TTY_COMPATIBLE", "")
    if tty_compatible == "1":
        return False
    if tty_compatible != "0":
        force_color = os.environ.get("FORCE_COLOR")
        if force_color is not None:
            if force_color != "":
                return False
        else:
            try:
                if sys.stdout.isatty():
                    return False
            except ValueError:  # a closed stream: rich takes it as no terminal
                pass
    return (getattr(sys.stdout, "encoding", None) or "utf-8").lower().startswith("utf")


def _console_width() -> int:
    """rich's console width: COLUMNS, else the size of the first standard stream that is a terminal, else 80."""
    columns = os.environ.get("COLUMNS")
    if columns is not None and columns.isdigit():
        return int(columns)
    width = None
    for fd in (0, 1, 2):
        try:
            width = os.get_terminal_size(fd).columns
        except (AttributeError, ValueError, OSError):
            continue
        break
    return width or 80
