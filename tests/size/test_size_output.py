"""`kvsim size`'s printed output byte for byte, against goldens that rich drew: every command below at several
terminal widths, without colour (output to a file or pipe) and with it (FORCE_COLOR, a colour terminal).

The goldens (tests/size/data/size_output.json) were captured before `kvsim size` drew its tables without rich;
rewrite them only for an intended change of the output: `PYTHONPATH=. python3 tests/size/test_size_output.py --write`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GOLDENS = Path(__file__).parent / "data" / "size_output.json"
CONFIGS = "kvsim/conformance/startup_logs/configs"

COMMANDS = [
    ["-m", "llama-3.1-8b", "--gpu", "h100-80gb"],
    ["-m", "qwen3-0.6b"],
    ["-m", "gemma-2-9b", "--gpu", "h100-80gb"],
    ["-m", "deepseek-v3", "--gpu", "h200", "-tp", "8", "--kv-dtype", "fp8"],
    ["-m", "qwen3-next-80b-a3b", "--gpu", "h100-80gb", "--tp", "4"],
    ["-m", "mamba-2.8b", "--gpu", "a100-80gb"],
    ["-m", "llama-4-scout", "--gpu", "b200", "-tp", "2", "--enforce-eager", "--context", "32768"],
    ["-m", "gemma-3-27b", "--kv-cache-memory", "23290718720", "--context", "32768"],
    ["-m", "qwen3-32b", "-tp", "2", "--gpu", "h100-80gb", "--gpu-memory-utilization", "0.65", "--cpu-offload", "100GiB"],
    ["--config", f"{CONFIGS}/gpt-oss-120b.json", "--gpu", "h100", "--gpu-memory-utilization", "0.9"],  # exit 2
    ["-m", "llama-3.1-8b", "--memory", "80GiB", "--layout", "--num-blocks", "1000", "--address", "1,31,999,15,7,127"],
    ["-m", "jamba-v0.1", "--memory", "80GiB", "-tp", "2", "--no-enable-prefix-caching"],
]
# (COLUMNS, colour): rich's width where the output is not a terminal is COLUMNS, else 80
MODES = [(None, False), (60, False), (100, False), (160, False), (250, False), (100, True), (200, True)]
COLOUR_ENV = {"FORCE_COLOR": "1", "NO_COLOR": None, "TERM": "xterm-256color", "COLORTERM": None}
PLAIN_ENV = {"FORCE_COLOR": None, "NO_COLOR": None, "TERM": "xterm-256color", "TTY_COMPATIBLE": None}


def case_key(args: list[str], columns: int | None, colour: bool) -> str:
    return f"size {' '.join(args)} | COLUMNS={columns or '-'} | {'colour' if colour else 'plain'}"


def run_size(args: list[str], columns: int | None, colour: bool) -> tuple[int, str]:
    """`kvsim size ARGS` in process: its exit code and the bytes it wrote to stdout, as text."""
    from typer.testing import CliRunner

    from kvsim.cli import app

    env = dict(COLOUR_ENV if colour else PLAIN_ENV, COLUMNS=str(columns) if columns else None)
    result = CliRunner().invoke(app, ["size", *args], env=env)
    return result.exit_code, result.stdout


CASES = [(args, columns, colour) for args in COMMANDS for columns, colour in MODES]


@pytest.fixture(scope="module")
def goldens() -> dict[str, dict]:
    return json.loads(GOLDENS.read_text())


@pytest.mark.parametrize("args, columns, colour", CASES, ids=[case_key(*case) for case in CASES])
def test_size_output_is_byte_identical(goldens, args, columns, colour):
    code, out = run_size(args, columns, colour)
    golden = goldens[case_key(args, columns, colour)]
    assert code == golden["exit_code"]
    assert out == golden["stdout"]


def test_the_goldens_cover_every_case(goldens):
    assert sorted(goldens) == sorted(case_key(*case) for case in CASES)
    assert sum("\x1b[" in g["stdout"] for g in goldens.values()) == len(COMMANDS) * sum(c for _, c in MODES)
    assert all("\x1b[" not in g["stdout"] for key, g in goldens.items() if key.endswith("plain"))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import os

    os.environ.setdefault("KVSIM_DATA_CACHE", "off")
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = {}
    for case in CASES:
        code, stdout = run_size(*case)
        out[case_key(*case)] = {"exit_code": code, "stdout": stdout}
    GOLDENS.parent.mkdir(exist_ok=True)
    GOLDENS.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(out)} cases written to {GOLDENS}")
