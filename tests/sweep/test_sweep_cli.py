"""`kvsim sweep` through the CLI: exit codes, one-line errors, the table's paths on stdout."""

from __future__ import annotations

import sys

import pandas as pd

from tests.sweep.test_sweep import make_sweep


def test_sweep_writes_the_table_and_csv_and_resumes(cli, tmp_path):
    path = make_sweep(tmp_path, axes={"kv_budget": ["128MiB", "256MiB"]})
    out = tmp_path / "out"
    result = cli(["sweep", str(path), "--out", str(out), "--csv", "-q", "-j", "1"])
    assert result.exit_code == 0, result.output
    assert f"{out / 'results.parquet'}\n{out / 'results.csv'}\n" in result.output
    assert "4 rows (0 failed); 4 run now, 0 already done" in result.output
    assert pd.read_csv(out / "results.csv").shape[0] == 4
    again = cli(["sweep", str(path), "--out", str(out), "-q", "--no-tensors"])  # --no-tensors: the default, spelt out
    assert "4 rows (0 failed); 0 run now, 4 already done" in again.output


def test_user_mistakes_are_one_line_and_exit_2(cli, tmp_path):
    def sweep(**fields):  # each case its own file
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        return make_sweep(folder, **fields)

    cases = [
        (["sweep", str(sweep(axes={"kv_dtype": ["fp9"]}))], "axes.kv_dtype: kv_dtype = 'fp9': "),
        (["sweep", str(tmp_path / "missing.yaml")], "cannot read"),
        (["sweep", str(sweep(axes={"kv_budget": ["1GiB"]})), "-j", "0"], "--workers: must be >= 1"),
        (["sweep", str(sweep(axes={"kv_budget": ["1GiB"]})), "--timing", "measured"], "--timing: measured timing needs"),
        (["sweep", str(sweep(axes={"kv_budget": ["1GiB"]}, axis={"x": [1]}))], "unknown field(s) axis"),
    ]
    for args, message in cases:
        result = cli([*args, "--out", str(tmp_path / "out")])
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvsim: error: ") and message in lines[0], result.output


def test_ray_without_ray_installed_says_how_to_get_it(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    path = make_sweep(tmp_path, axes={"kv_budget": ["1GiB"]})
    result = cli(["sweep", str(path), "--ray", "auto", "-q", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "--ray: the Ray backend needs ray: pip install 'kvsim[ray]'" in result.output


def test_a_real_ctrl_c_keeps_the_finished_rows_and_exits_130(tmp_path):
    """SIGINT to `kvsim sweep -j 2` mid-run: the table holds exactly the journaled rows, and a rerun finishes."""
    import os
    import signal
    import subprocess
    import time

    from tests.sweep.test_sweep import REPO

    path = make_sweep(tmp_path, axes={"seed": list(range(12))}, set={"requests.count": 400, "kv_budget": "64MiB"})
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "kvsim", "sweep", str(path), "--out", str(out), "-j", "2", "-q"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    journal = out / "rows.jsonl"
    deadline = time.monotonic() + 120
    while not (journal.is_file() and journal.read_text().count("\n") >= 2) and proc.poll() is None:
        assert time.monotonic() < deadline, "no rows within 120 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    kept = journal.read_text().count("\n")
    assert proc.returncode == 130, err
    assert f"interrupted: {kept} of 24 rows kept in {out}; rerun to resume" in err and "Traceback" not in err
    assert len(pd.read_parquet(out / "results.parquet")) == kept < 24
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert f"24 rows (0 failed); {24 - kept} run now, {kept} already done" in rerun.stderr
