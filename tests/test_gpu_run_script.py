"""scripts/gpu_run.sh on CPU, with a fake python standing in for torch and kvsim: steps are capped and logged,
output reaches the log unbuffered, outputs are packed after every step (split under the tool's file limit)."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# `$PY -c ...` answers the device slug; `$PY -m kvsim <step>` acts as FAKE_<STEP> says: sleep, big, fail or ok.
FAKE_PYTHON = textwrap.dedent("""\
    #!/usr/bin/env bash
    echo "PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-} $*" >>calls.log
    [ "$1" = -c ] && { echo fake-gpu; exit 0; }
    [ "$1" = -m ] && [ "$2" = pytest ] && exit 0
    step=$3
    case $step in
      bench) mkdir -p reports/bench; echo "op,kernel" >reports/bench/kernels-fake-gpu.csv; action=${FAKE_BENCH:-ok} ;;
      replay) mkdir -p reports/poisson-fake-gpu; action=${FAKE_REPLAY:-ok} ;;
      *) action=ok ;;
    esac
    echo "$step started"
    case $action in
      sleep) sleep 30 ;;
      big) head -c $((20 * 1024 * 1024)) /dev/urandom >reports/poisson-fake-gpu/steps.parquet ;;
      fail) exit 3 ;;
    esac
    echo "$step done"
""")


@pytest.fixture
def run(tmp_path):
    if shutil.which("timeout") is None or shutil.which("split") is None:
        pytest.skip("needs coreutils timeout and split")
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "gpu_run.sh", tmp_path / "scripts" / "gpu_run.sh")
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()

    def invoke(*steps: str, **env: str) -> subprocess.CompletedProcess:
        full = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "OUT": str(out), **env}
        return subprocess.run(["bash", "scripts/gpu_run.sh", *steps], cwd=tmp_path, env=full, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    return invoke, tmp_path, out


def test_a_step_past_its_cap_is_cut_off_and_counted_and_what_it_wrote_comes_back(run):
    invoke, root, out = run
    result = invoke("bench", "profile", STEP_TIMEOUT="2", FAKE_BENCH="sleep")
    assert result.returncode == 1, result.stdout + result.stderr  # one failed step: bench
    bench_log = (root / "reports/gpu-fake-gpu/bench.log").read_text()
    assert "bench started" in bench_log  # printed before the kill: unbuffered all the way to the log
    assert "exit 124 (time limit)" in bench_log
    assert all(line.startswith("PYTHONUNBUFFERED=1 ") for line in (root / "calls.log").read_text().splitlines())
    with tarfile.open(out / "gpu-run-fake-gpu.tar.gz") as tar:
        names = tar.getnames()
    assert "reports/bench/kernels-fake-gpu.csv" in names and "reports/gpu-fake-gpu/profile.log" in names
    assert "profile done" in (out / "gpu-run-fake-gpu.log").read_text()


def test_total_timeout_leaves_later_steps_unrun_but_packs_what_ran(run):
    invoke, root, out = run
    result = invoke("profile", "bench", "replay", TOTAL_TIMEOUT="30", FAKE_BENCH="sleep")
    # 30 s - 25 s margin: bench gets 5 s and is cut off; nothing is left for replay
    assert result.returncode == 2, result.stdout + result.stderr
    assert "exit 124 (time limit)" in (root / "reports/gpu-fake-gpu/bench.log").read_text()
    assert "not run" in (root / "reports/gpu-fake-gpu/replay.log").read_text()
    assert "replay" not in (root / "calls.log").read_text()
    assert (out / "gpu-run-fake-gpu.tar.gz").is_file()


def test_an_archive_over_the_tools_file_limit_comes_back_in_parts(run, tmp_path):
    invoke, root, out = run
    result = invoke("replay", FAKE_REPLAY="big")
    assert result.returncode == 0, result.stdout + result.stderr
    parts = sorted(out.glob("gpu-run-fake-gpu.tar.gz.part-*"))
    assert len(parts) == 2 and not (out / "gpu-run-fake-gpu.tar.gz").exists()
    assert all(p.stat().st_size <= 15 * 2**20 for p in parts)
    whole = tmp_path / "whole.tar.gz"
    whole.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(whole) as tar:
        assert tar.getmember("reports/poisson-fake-gpu/steps.parquet").size == 20 * 2**20
