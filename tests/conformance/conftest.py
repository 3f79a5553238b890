"""vLLM's modules for the conformance tests: loaded once, or every test here skipped with the reason."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vllm_loaded():
    """Install the loader over the cached wheel; skip when the wheel cannot be fetched."""
    from kvsim.conformance.vllm_wheel import VllmWheelUnavailable
    from kvsim.conformance.vllm_import import VllmImportError, install

    try:
        return install()
    except VllmWheelUnavailable as exc:
        pytest.skip(f"vLLM wheel unavailable: {exc}")
    except VllmImportError as exc:
        pytest.skip(str(exc))
