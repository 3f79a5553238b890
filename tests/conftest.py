"""Shared test setup: a stable terminal width for rich output, and the CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("COLUMNS", "160")
os.environ.setdefault("TERM", "dumb")
os.environ.setdefault("NO_COLOR", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(autouse=True)
def no_hugging_face_hub(tmp_path_factory, monkeypatch):
    """No test reaches the Hugging Face Hub or reads this machine's Hugging Face cache: HF_HUB_OFFLINE, and an
    empty cache folder (tests that need a cache build one and point HF_HUB_CACHE at it)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf-hub-cache")))


@pytest.fixture(autouse=True)
def parsed_data_cache(tmp_path_factory, monkeypatch):
    """The data files' parsed cache (kvsim.models.parsed_cache) in a folder of the test session's, never this
    user's ~/.cache; the tests' subprocesses inherit it."""
    monkeypatch.setenv("KVSIM_DATA_CACHE", str(tmp_path_factory.getbasetemp() / "kvsim-data-cache"))


@pytest.fixture
def cli():
    """Invoke the kvsim CLI in-process: cli(["size", "--model", "qwen3-0.6b"]) -> click Result."""
    from typer.testing import CliRunner

    from kvsim.cli import app

    runner = CliRunner()

    def invoke(args: list[str], **kwargs):
        return runner.invoke(app, args, **kwargs)

    return invoke


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` cleanly when no CUDA device is present."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
