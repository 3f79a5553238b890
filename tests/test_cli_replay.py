"""`kvsim replay` through the CLI: reports written, JSON summary, user errors as one line and exit code 2."""

from __future__ import annotations

import json

import pytest

from tests.test_replay import write_tiny


def test_replay_writes_reports_and_prints_a_table(cli, tmp_path):
    path = write_tiny(tmp_path, count=6)
    out = tmp_path / "reports"
    result = cli(["replay", str(path), "--no-tensors", "--out", str(out), "--csv"])
    assert result.exit_code == 0, result.output
    for name in ("steps.parquet", "steps.csv", "requests.csv", "summary.csv", "summary.json", "meta.json"):
        assert (out / name).is_file(), name
    assert "paged-16+prefix" in result.output and "flat-oracle" in result.output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["command"].startswith("kvsim ") and meta["tensors"] is False


def test_replay_json_summary_on_stdout(cli, tmp_path):
    path = write_tiny(tmp_path, count=6)
    result = cli(["replay", str(path), "--no-tensors", "--quiet", "--json", "--out", str(tmp_path / "o"), "--limit", "4"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert [r["allocator"] for r in records] == ["flat-oracle", "paged-16", "paged-16+prefix"]
    assert all(r["num_requests"] == 4 and r["finished"] == 4 for r in records)


def test_replay_with_tensors_on_cpu(cli, tmp_path):
    path = write_tiny(tmp_path, count=4)
    result = cli(["replay", str(path), "--device", "cpu", "--quiet", "--json", "--out", str(tmp_path / "o"), "--integrity"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert all(r["write_us_p50"] > 0 for r in records)


def test_bad_workload_exits_2_with_one_line(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(write_tiny(tmp_path).read_text().replace("max_num_seqs: 16", "max_num_seqs: -1"))
    result = cli(["replay", str(bad), "--no-tensors", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsim: error: ") and "scheduler.max_num_seqs" in lines[0]
    assert not (tmp_path / "o").exists()


def test_missing_workload_and_bad_flags_exit_2(cli, tmp_path):
    missing = cli(["replay", str(tmp_path / "nope.yaml"), "--no-tensors"])
    assert missing.exit_code == 2 and "nope.yaml" in missing.stderr
    path = write_tiny(tmp_path)
    measured = cli(["replay", str(path), "--no-tensors", "--timing", "measured", "--out", str(tmp_path / "o")])
    assert measured.exit_code == 2 and "--timing" in measured.stderr
    layers = cli(["replay", str(path), "--layers", "0", "--out", str(tmp_path / "o")])
    assert layers.exit_code == 2 and "--layers" in layers.stderr


def test_replay_help_does_not_import_torch_or_pandas():
    import subprocess
    import sys

    code = "import sys; from kvsim.cli import app; assert 'torch' not in sys.modules and 'pandas' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_trace_flag_replaces_the_workload_requests(cli, tmp_path):
    path = write_tiny(tmp_path)
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,40,10\n0.001,100,5\n0.5,30,3\n")
    result = cli(["replay", str(path), "--trace", str(trace), "--no-tensors", "--quiet", "--json", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert all(r["num_requests"] == 3 and r["finished"] == 3 for r in records)
    assert records[0]["throughput_tokens_per_s"] == pytest.approx(18 / records[0]["sim_time_s"])
