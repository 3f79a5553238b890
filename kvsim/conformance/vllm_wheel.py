"""Fetch the pinned vLLM wheel and extract its Python sources into a cache (never into the repository).

`vllm_source_root()` returns the directory that holds the extracted `vllm/` package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.vllm_version import VLLM_VERSION  # the release kvsim follows: the one fetched

WHEEL_GLOB = f"vllm-{VLLM_VERSION}-*.whl"
_DONE = ".extracted"  # written last: a source tree without it is a partial extraction


class VllmWheelUnavailable(KvsimError):
    """The pinned vLLM wheel could not be found, downloaded or read."""


def cache_dir() -> Path:
    """Where the wheel and its sources live: `$KVSIM_VLLM_CACHE`, default `~/.cache/kvsim/vllm-<version>`."""
    env = os.environ.get("KVSIM_VLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvsim" / f"vllm-{VLLM_VERSION}"


def vllm_source_root(cache: Path | None = None) -> Path:
    """The directory holding vLLM's extracted `vllm/**/*.py`, fetching and extracting on first use.

    Order of sources for the wheel: one already in the cache, then `$KVSIM_VLLM_WHEEL` (a local file,
    copied in), then `pip download --no-deps vllm==<version>`.
    """
    cache = cache or cache_dir()
    src = cache / "src"
    if (src / _DONE).exists():
        return src
    wheel = fetch_wheel(cache)
    _extract_sources(wheel, src)
    return src


def fetch_wheel(cache: Path) -> Path:
    """The path of the pinned wheel inside `cache`, copied or downloaded there when absent."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(WHEEL_GLOB))
    if found:
        return found[0]
    local = os.environ.get("KVSIM_VLLM_WHEEL")
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise VllmWheelUnavailable("no such file", source="KVSIM_VLLM_WHEEL", field=str(path))
        if not path.name.startswith(f"vllm-{VLLM_VERSION}-"):
            raise VllmWheelUnavailable(f"not a vllm {VLLM_VERSION} wheel", source="KVSIM_VLLM_WHEEL", field=str(path))
        return _move_in(path, cache, copy=True)
    return _pip_download(cache)


WHEEL_SIZE = "~340 MB"  # vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl: 336,361,138 B


def _pip_download(cache: Path) -> Path:
    # The wheel's Python files are the same on every platform; pinning one lets any machine fetch them.
    print(f"kvsim: downloading vLLM {VLLM_VERSION}'s wheel ({WHEEL_SIZE}, once) into {cache}; only its Python "
          "sources are extracted and kept beside it", file=sys.stderr, flush=True)
    try:  # pip's progress bar (on its stdout) shown on our stderr, so a piped table stays clean
        shown = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        shown = subprocess.DEVNULL
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "--dest", tmp,
               "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12",
               f"vllm=={VLLM_VERSION}"]
        try:
            proc = subprocess.run(cmd, stdout=shown, stderr=subprocess.PIPE, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise VllmWheelUnavailable(f"pip download failed: {exc}") from None
        wheels = sorted(Path(tmp).glob(WHEEL_GLOB))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no wheel"]
            raise VllmWheelUnavailable(f"pip download vllm=={VLLM_VERSION} failed: {tail[0]}")
        return _move_in(wheels[0], cache, copy=False)


def _move_in(wheel: Path, cache: Path, *, copy: bool) -> Path:
    """Place `wheel` in `cache` atomically (a concurrent reader sees the whole file or none)."""
    dest = cache / wheel.name
    part = cache / f".{wheel.name}.{os.getpid()}.part"
    if copy:
        shutil.copyfile(wheel, part)
    else:
        shutil.move(str(wheel), part)
    os.replace(part, dest)
    return dest


def _extract_sources(wheel: Path, src: Path) -> None:
    """Extract only `vllm/**/*.py` from `wheel` into `src`, atomically (temp directory, then rename)."""
    tmp = Path(tempfile.mkdtemp(prefix=".src.", dir=src.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py") and ".." not in name:
                    zf.extract(name, tmp)
        (tmp / _DONE).write_text(wheel.name + "\n")
        if src.exists():  # a partial extraction left by an interrupted run
            shutil.rmtree(src, ignore_errors=True)
        try:
            os.replace(tmp, src)
        except OSError:
            if not (src / _DONE).exists():  # not another process finishing first
                raise
    except zipfile.BadZipFile as exc:
        raise VllmWheelUnavailable(f"unreadable wheel: {exc}", source=str(wheel)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
