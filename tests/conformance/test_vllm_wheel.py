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


def test_the_first_download_says_what_it_fetches_and_shows_pips_progress(tmp_path, monkeypatch, capsys):
    """No wheel cached: one line on stderr names the wheel and its size, then pip runs with its progress bar
    on stderr (not quiet, not captured); the wheel it saves is moved into the cache."""
    import subprocess
    from pathlib import Path

    monkeypatch.delenv("KVSIM_VLLM_WHEEL", raising=False)
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append((cmd, kwargs))
        dest = Path(cmd[cmd.index("--dest") + 1])
        _fake_wheel(dest / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")
        return subprocess.CompletedProcess(cmd, 0, None, "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    src = vllm_source_root(tmp_path / "cache")
    assert (src / "vllm" / "__init__.py").is_file()
    (cmd, kwargs), = calls
    assert "--quiet" not in cmd and cmd[cmd.index("--progress-bar") + 1] == "on"
    assert kwargs["stdout"] is not subprocess.PIPE and "capture_output" not in kwargs
    err = capsys.readouterr().err
    assert "downloading vLLM 0.33.0's wheel (~340 MB, once)" in err


def test_a_missing_package_names_the_conformance_extra(cli, monkeypatch):
    """`kvsim conformance` without msgspec: one line naming the extra to install, before the table's header."""
    import kvsim.conformance.vllm_import as vi

    monkeypatch.setattr(vi, "_finder", None)
    monkeypatch.setattr(vi, "REQUIRED", ("kvsim_no_such_package",))
    with pytest.raises(vi.VllmImportError, match=r"pip install -e '\.\[conformance\]'"):
        vi.install()
    result = cli(["conformance", "--stream", "plenty"])
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'kvsim_no_such_package'" in lines[0] and "pip install -e '.[conformance]'" in lines[0]


def test_progress_rewrites_one_line_on_a_terminal_and_writes_every_10_s_in_a_log():
    import io

    from kvsim.conformance.progress import StderrProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    progress = StderrProgress(tty)
    progress("a: kvsim's replay")
    progress("a: kvsim's replay, step 1,024")
    progress("")
    assert tty.getvalue() == "\r\033[Ka: kvsim's replay\r\033[Ka: kvsim's replay, step 1,024\r\033[K"
    now = [0.0]
    log = io.StringIO()
    progress = StderrProgress(log, clock=lambda: now[0])
    progress("a: first")  # nothing for 10 s
    now[0] = 10.0
    progress("a: step 1,024")
    progress("a: step 2,048")
    progress("")
    assert log.getvalue() == "a: step 1,024\n"
