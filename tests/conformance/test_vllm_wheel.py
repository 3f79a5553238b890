"""The wheel cache: a local wheel is copied in once, only vllm/**/*.py is extracted, a bad path is a user error."""

from __future__ import annotations

import zipfile

import pytest

from kvsim.conformance.vllm_wheel import VllmWheelUnavailable, vllm_source_root


def _fake_wheel(path):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm/__init__.py", "X = 1\n")
        zf.writestr("vllm/v1/core/block_pool.py", "Y = 2\n")
        zf.writestr("vllm/_C.abi3.so", b"\x7fELF")
        zf.writestr("vllm-0.33.0.dist-info/METADATA", "Name: vllm\n")
    return path


def test_local_wheel_is_cached_and_only_python_sources_extracted(tmp_path, monkeypatch):
    wheel = _fake_wheel(tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSIM_VLLM_WHEEL", str(wheel))
    src = vllm_source_root(cache)
    assert (src / "vllm" / "v1" / "core" / "block_pool.py").read_text() == "Y = 2\n"
    assert not (src / "vllm" / "_C.abi3.so").exists()
    assert not (src / "vllm-0.33.0.dist-info").exists()
    assert (cache / wheel.name).read_bytes() == wheel.read_bytes()
    # Reused: neither the env path nor the cached wheel is needed once extracted.
    wheel.unlink()
    (cache / wheel.name).unlink()
    monkeypatch.delenv("KVSIM_VLLM_WHEEL")
    assert vllm_source_root(cache) == src


def test_partial_extraction_is_redone_from_the_cached_wheel(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    _fake_wheel(cache / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    (cache / "src" / "vllm").mkdir(parents=True)  # interrupted: no completion marker
    src = vllm_source_root(cache)
    assert (src / "vllm" / "__init__.py").read_text() == "X = 1\n"


def test_a_wheel_path_of_another_version_is_a_user_error(tmp_path, monkeypatch):
    other = _fake_wheel(tmp_path / "vllm-0.9.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    monkeypatch.setenv("KVSIM_VLLM_WHEEL", str(other))
    with pytest.raises(VllmWheelUnavailable, match="KVSIM_VLLM_WHEEL"):
        vllm_source_root(tmp_path / "cache")


def test_a_missing_wheel_path_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_VLLM_WHEEL", str(tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"))
    with pytest.raises(VllmWheelUnavailable, match="KVSIM_VLLM_WHEEL: .*: no such file"):
        vllm_source_root(tmp_path / "cache")
