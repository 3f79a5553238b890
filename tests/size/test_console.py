"""kvsim.size.console draws text and tables as rich does, byte for byte, or hands them to rich: each case is
drawn both ways at many widths and compared."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvsim.size.console import Table, table_lines, text_lines, wrap

TEXTS = [
    "capped: sliding layers keep only their window, chunked layers their chunk (engines that free blocks outside it); "
    "uncapped: every layer keeps every token.",
    "  vLLM pool: num_gpu_blocks 28,085 = KV budget // 2,097,152 B (32 layers x 65,536 B pages)",
    "two  spaces   between    words,     trailing   ",
    "   leading spaces and a [bracket] and :smile: kept literal",
    "short",
    "a-very-long-word-that-is-longer-than-most-lines-here-and-more-of-it then short words",
]
WIDTHS = [12, 20, 33, 40, 57, 80, 100, 160]


def rich_output(item, width: int, **kwargs) -> str:
    """What rich's Console(markup=False, emoji=False) prints for `item` on a file `width` cells wide."""
    out = io.StringIO()
    Console(file=out, width=width, markup=False, emoji=False, force_terminal=False).print(item, **kwargs)
    return out.getvalue()


def drawn(lines: list[str] | None) -> str | None:
    return None if lines is None else "".join(f"{line}\n" for line in lines)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("text", TEXTS)
def test_text_wraps_as_rich_wraps_it(text, width):
    ours = drawn(text_lines(text, width))
    assert ours is None or ours == rich_output(text, width)
    assert drawn(text_lines(text, width, soft_wrap=True)) == rich_output(text, width, soft_wrap=True)


def test_wrap_hands_rich_only_a_word_longer_than_a_line():
    assert wrap(TEXTS[-1], 80) is not None and wrap(TEXTS[-1], 40) is None  # rich folds a word of 61 characters
    assert all(wrap(text, 33) is not None for text in TEXTS[:-1])
    assert text_lines("tab\there", 80) is None and text_lines("caf\u00e9", 80) is None  # not one-cell printable ASCII


def kinds_table(title: str) -> Table:
    table = Table(title)
    for header in ("layer group", "layers", "KV heads", "per seq @ 131,072"):
        table.add_column(header, justify="left" if header == "layer group" else "right")
    table.add_row("full", "32", "8", "16.0 GiB")
    table.add_row("sliding(4096)", "21", "-", "672.0 MiB")
    return table


def grid_table() -> Table:
    table = Table(grid=True)
    table.add_column(justify="left")
    table.add_column(justify="right")
    table.add_row("KV per token, every per-token layer", "131,072 B (128.0 KiB)")
    table.add_row("    full attention [MLA]", "0 B")
    return table


TITLES = ["", "short title", "llama-3.1-8b (meta-llama/Llama-3.1-8B): KV cache, bf16, tp=1, per rank",
          "a title with a very-long-word-in-it-that-does-not-fit-the-table-width-at-all-and-more"]


@pytest.mark.parametrize("width", [30, 50, 56, 57, 63, 64, 80, 200])
@pytest.mark.parametrize("title", TITLES)
def test_tables_are_drawn_as_rich_draws_them(title, width):
    for table in (kinds_table(title), grid_table()):
        ours = drawn(table_lines(table, width))
        assert ours is None or ours == rich_output(table.as_rich(), width)


def test_tables_that_fit_are_drawn_here():
    assert table_lines(kinds_table(TITLES[2]), 57) is not None  # 57 cells: every column at its natural width
    assert table_lines(kinds_table(TITLES[2]), 56) is None  # rich would shrink a column
    assert table_lines(kinds_table(TITLES[3]), 200) is None  # the title's long word: rich folds it
    assert table_lines(grid_table(), 64) is not None and table_lines(grid_table(), 63) is None
