"""kvsim.units.parse_bytes: sizes as users type them, and the ones it refuses."""

from __future__ import annotations

import pytest

from kvsim.errors import KvsimError
from kvsim.units import parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 2**30), ("40GB", 40 * 10**9), ("4 gib", 4 * 2**30), ("1.5GiB", 3 * 2**29), (1024, 1024), ("2048", 2048), (4096.0, 4096)],
)
def test_sizes_in_decimal_and_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["1.5", 1.5, "0.5B", "2.25b"])
def test_a_fractional_count_of_bytes_is_refused(text):
    # '1.5' used to become 1 byte without a word
    with pytest.raises(KvsimError, match="a count of bytes must be whole"):
        parse_bytes(text, field="--memory")


def test_the_cli_names_the_option(cli):
    result = cli(["size", "-m", "qwen3-0.6b", "--memory", "1.5"])
    assert result.exit_code == 2
    assert result.output.strip() == "kvsim: error: --memory: a count of bytes must be whole, got '1.5' (give a unit: '1.5GiB')"
