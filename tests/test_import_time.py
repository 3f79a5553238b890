"""`kvsim --help` and `kvsim size` must not import torch, pandas or huggingface_hub: they should start in well under a second;
`kvsim replay --no-tensors` imports neither torch nor pandas."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from kvsim.replay.tables import writes_pandas_bytes

HEAVY = ("torch", "pandas", "matplotlib", "huggingface_hub")


def imported_modules(args: list[str]) -> tuple[set[str], subprocess.CompletedProcess]:
    """Run python -X importtime with `args`; the set of top-level modules it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    modules = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            modules.add(name.split(".")[0])
    assert "kvsim" in modules or proc.returncode != 0, proc.stderr[-2000:]
    return modules, proc


def test_importing_the_cli_imports_no_heavy_module():
    modules, proc = imported_modules(["-c", "import kvsim.cli"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kvsim" in modules and "typer" in modules  # the parse saw real imports
    assert not modules & set(HEAVY), modules & set(HEAVY)


def test_size_command_imports_no_heavy_module(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_DATA_CACHE", str(tmp_path / "cache"))
    args = ["-m", "kvsim", "size", "--model", "gemma-2-9b", "--gpu", "h100-80gb", "--layout", "--num-blocks", "4"]
    modules, proc = imported_modules(args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Maximum concurrency for 8,192 tokens per request" in proc.stdout
    assert "yaml" in modules  # a first run: the data files parsed (and their parse cached)
    assert "rich" not in modules  # output to a pipe: the tables drawn by kvsim.size.console, as rich draws them
    assert not modules & set(HEAVY), modules & set(HEAVY)
    again, proc_again = imported_modules(args)  # a later run: the model and the GPU from the parsed cache
    assert proc_again.stdout == proc.stdout
    assert "yaml" not in again and "rich" not in again
    assert not again & set(HEAVY), again & set(HEAVY)


def test_help_imports_no_heavy_module():
    modules, proc = imported_modules(["-m", "kvsim", "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "size" in proc.stdout
    assert not modules & set(HEAVY), modules & set(HEAVY)


def test_size_json_imports_no_table_and_no_hub_step(monkeypatch):
    """--json prints no table: rich stays unloaded; a catalogue name never reaches the Hub's step (kvsim.models.hub,
    which loads logging), the CPU tier without --cpu-offload, nor another command's modules."""
    monkeypatch.setenv("KVSIM_DATA_CACHE", "off")  # PyYAML parses: the imports seen are those of a first run
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvsim", "size", "--model", "llama-3.1-8b",
                           "--gpu", "h100-80gb", "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"memory_bytes": 85029158912' in proc.stdout
    names = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:") and "|" in line}
    assert "kvsim.size.report" in names and "yaml" in names  # the parse saw real imports
    assert not {n.split(".")[0] for n in names} & {"rich", "logging", *HEAVY}
    assert not {"kvsim.models.hub", "kvsim.size.cpu_offload", "kvsim.replay", "kvsim.engine", "kvsim.workload", "kvsim.clock"} & names


@pytest.mark.skipif(not writes_pandas_bytes(),
                    reason="without pandas 3 and pyarrow 22+, the reports are written through pandas")
def test_replay_accounting_only_imports_no_heavy_module_and_no_table(tmp_path):
    """`kvsim replay --no-tensors --quiet --json` writes its reports through Arrow (no pandas), draws nothing (no
    rich) and never touches the cache tensors (no torch)."""
    from tests.replay.test_replay import write_tiny

    path = write_tiny(tmp_path, count=4)
    modules, proc = imported_modules(["-m", "kvsim", "replay", str(path), "--no-tensors", "--quiet", "--json",
                                      "--out", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"allocator": "paged-16+prefix"' in proc.stdout and (tmp_path / "out" / "steps.parquet").is_file()
    assert "pyarrow" in modules  # the parse saw the writer's import
    assert not modules & {"rich", *HEAVY}, modules & {"rich", *HEAVY}
