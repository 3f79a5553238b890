"""`kvsim bench allocator`'s user errors: one line, exit code 2."""

from __future__ import annotations

import pytest

from kvsim.bench.allocator import run_allocator_bench
from kvsim.errors import KvsimError


def test_a_negative_seed_is_refused_naming_the_flag(cli):
    # numpy's default_rng(-1) was a ValueError traceback
    result = cli(["bench", "allocator", "--num-requests", "4", "--seed", "-1"])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == "kvsim: error: --seed: must be a whole number >= 0, got -1"
    with pytest.raises(KvsimError, match="--seed"):
        run_allocator_bench(num_requests=4, max_running=2, seed=-5)
