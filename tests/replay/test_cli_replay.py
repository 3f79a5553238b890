"""`kvsim replay` through the CLI: reports written, JSON summary, user errors as one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.replay.test_replay import BPT, write_tiny


def test_replay_writes_reports_and_prints_a_table(cli, tmp_path):
    path = write_tiny(tmp_path, count=6)
    out = tmp_path / "reports"
    result = cli(["replay", str(path), "--no-tensors", "--out", str(out), "--csv"])
    assert result.exit_code == 0, result.output
    for name in ("steps.parquet", "steps.csv", "requests.csv", "summary.csv", "summary.json", "meta.json"):
        assert (out / name).is_file(), name
    assert "paged-16+prefix" in result.output and "flat-oracle" in result.output
    assert "scheduler: vLLM v1 0.33.0" in " ".join(result.output.split())  # the header names what it follows
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
    assert "integrity: passed: 3 allocator(s)" in result.stderr


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


def test_cpu_tensors_keep_summary_csv_byte_identical_and_count_read_samples(cli, tmp_path):
    """summary.csv holds simulated figures only: byte for byte the same with CPU tensors and without; the
    timed kernels live in kernels.json, which says how many decode steps read + attended."""
    path = write_tiny(tmp_path, count=8)
    on, off = tmp_path / "on", tmp_path / "off"
    result = cli(["replay", str(path), "--device", "cpu", "--read-every", "5", "--quiet", "--out", str(on)])
    assert result.exit_code == 0, result.output
    assert cli(["replay", str(path), "--no-tensors", "--quiet", "--out", str(off)]).exit_code == 0
    assert (on / "summary.csv").read_bytes() == (off / "summary.csv").read_bytes()
    assert b"num_read_samples" not in (on / "summary.csv").read_bytes()
    records = json.loads((on / "kernels.json").read_text())
    for r in records:
        assert r["num_read_samples"] >= 2 and r["read_us_p50"] > 0 and r["write_us_p50"] > 0
    kernels = pd.read_parquet(on / "kernels.parquet")
    assert list(kernels.columns) == ["allocator", "step", "write_us", "read_us", "attention_us"]
    assert (kernels["write_us"] > 0).all()
    assert not (off / "kernels.json").exists()  # accounting only: nothing measured


def test_a_rerun_gives_the_same_bytes_for_every_file_a_report_ships(cli, tmp_path):
    """The files git tracks under reports/ (steps.parquet, requests.csv, summary.csv/.json, meta.json) are the
    same bytes on a rerun with cache tensors; what the host measured sits in the files git ignores."""
    import subprocess

    path = write_tiny(tmp_path, count=8)
    runs = []
    for name in ("a", "b"):
        out = tmp_path / "reports" / name
        result = cli(["replay", str(path), "--device", "cpu", "--read-every", "5", "--quiet", "--out", str(out)])
        assert result.exit_code == 0, result.output
        runs.append(out)
    shipped = ("steps.parquet", "requests.csv", "summary.csv", "summary.json", "meta.json")
    for name in shipped:
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name
    measured = sorted(p.name for p in runs[0].iterdir() if p.name not in shipped)
    assert measured == ["host.json", "kernels.json", "kernels.parquet"]
    repo = Path(__file__).resolve().parents[2]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *(f"reports/poisson/{n}" for n in (*shipped, *measured))],
                             cwd=repo, capture_output=True, text=True).stdout.split()
    assert ignored == [f"reports/poisson/{n}" for n in measured]


def test_read_every_must_be_positive_and_measured_names_the_device_it_measured(cli, tmp_path):
    path = write_tiny(tmp_path, count=4)
    zero = cli(["replay", str(path), "--device", "cpu", "--read-every", "0", "--out", str(tmp_path / "o")])
    assert zero.exit_code == 2 and "--read-every" in zero.output
    measured = cli(["replay", str(path), "--device", "cpu", "--timing", "measured", "--read-every", "3", "--out", str(tmp_path / "o")])
    assert measured.exit_code == 0, measured.output
    assert "timed as measured on cpu (" in measured.stdout and "(not NVIDIA" in measured.stdout


@pytest.mark.parametrize("tensors", [["--no-tensors"], ["--device", "cpu"]])
def test_budget_below_one_block_is_a_user_error(cli, tmp_path, tensors):
    path = write_tiny(tmp_path)
    tiny = tmp_path / "tiny-budget.yaml"
    text = path.read_text()
    budget_line = next(line for line in text.splitlines() if line.startswith("kv_budget:"))
    tiny.write_text(text.replace(budget_line, "kv_budget: 1KiB"))
    result = cli(["replay", str(tiny), *tensors, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "tiny-budget.yaml: kv_budget:" in lines[0] and "holds not one" in lines[0]


@pytest.mark.parametrize("budget,says", [
    ("1e20", "more than the replay can count exactly"),  # flat-max reported free = -9.2%
    ("1000000000000000000000000000000", "more than the replay can count exactly"),  # 10**30: a MemoryError
    ("1e30", "more than the replay can count exactly"),  # ran for minutes
    ("64TiB", "more than the replay builds"),  # 38 million paged-16 blocks: minutes and gigabytes
])
def test_a_budget_the_replay_cannot_hold_is_refused_before_anything_runs(cli, tmp_path, budget, says):
    path = write_tiny(tmp_path)
    huge = tmp_path / "huge-budget.yaml"
    text = path.read_text()
    budget_line = next(line for line in text.splitlines() if line.startswith("kv_budget:"))
    huge.write_text(text.replace(budget_line, f"kv_budget: {budget}").replace("reserve: oracle", "reserve: max"))
    result = cli(["replay", str(huge), "--no-tensors", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "huge-budget.yaml: kv_budget:" in lines[0] and says in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_an_out_dir_that_cannot_be_written_is_one_line(cli, tmp_path):
    """--out naming a file, or a report file's name taken by a directory, was a FileExistsError traceback."""
    path = write_tiny(tmp_path, count=3)
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    result = cli(["replay", str(path), "--no-tensors", "--quiet", "--out", str(blocker)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [f"kvsim: error: --out: {blocker} is a file, not a directory"]
    out = tmp_path / "o"
    (out / "summary.csv").mkdir(parents=True)
    result = cli(["replay", str(path), "--no-tensors", "--quiet", "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"kvsim: error: --out: cannot write {out / 'summary.csv'}: Is a directory"]


def test_rejections_are_counted_and_explained_under_the_table(cli, tmp_path):
    """With every request rejected the table showed only dashes (the rejected column had no room at 80 columns)."""
    path = write_tiny(tmp_path, count=5, budget_tokens=32)  # two 16-token blocks, one usable (block 0 is null); every request needs 24+
    result = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stdout.splitlines() if "rejected 5 of 5 requests" in line]
    assert len(notes) == 3 and notes[0].startswith("flat-oracle: rejected 5 of 5 requests, e.g. request 0: its slab of ")
    assert "rejected" not in cli(["replay", str(write_tiny(tmp_path, count=5)), "--no-tensors", "--out", str(tmp_path / "p")]).stdout


def test_a_cpu_pool_over_the_host_memory_cap_is_refused_before_the_replay(cli, tmp_path, monkeypatch):
    import kvsim.replay.run
    import kvsim.replay.workers

    for module in (kvsim.replay.run, kvsim.replay.workers):
        monkeypatch.setattr(module, "replay_allocator", lambda *a, **kw: pytest.fail("replayed before the check"))
    path = write_tiny(tmp_path, budget_tokens=1024)  # 1024 slots of BPT bytes (all layers); 1 materialised
    result = cli(["replay", str(path), "--device", "cpu", "--max-host-memory", "1KiB", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("kvsim: error: --max-host-memory: flat-oracle's CPU cache pool needs ")
    assert "--no-tensors" in line and "--max-host-memory 1GiB" in line
    assert not (tmp_path / "o").exists()


def test_by_default_a_shipped_workload_whose_pool_would_take_over_2_gb_resident_is_refused(cli, tmp_path, monkeypatch):
    import kvsim.replay.run
    import kvsim.replay.workers

    for module in (kvsim.replay.run, kvsim.replay.workers):
        monkeypatch.setattr(module, "replay_allocator", lambda *a, **kw: pytest.fail("replayed before the check"))
    root = Path(__file__).resolve().parents[2]
    result = cli(["replay", str(root / "workloads" / "mooncake-synthetic.yaml"), "--device", "cpu", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert "1.7 GiB" in result.stderr and "over the 1.0 GiB allowed" in result.stderr and "--max-host-memory 2GiB" in result.stderr


def test_no_tensors_says_which_tensor_flags_it_ignores(cli, tmp_path):
    path = write_tiny(tmp_path, count=3)
    result = cli(["replay", str(path), "--no-tensors", "--quiet", "--layers", "2", "--read-every", "5", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "note: --no-tensors: --layers, --read-every ignored" in result.stderr
    plain = cli(["replay", str(path), "--no-tensors", "--quiet", "--out", str(tmp_path / "p")])
    assert "ignored" not in plain.stderr


def test_the_summary_table_cuts_no_cell_at_80_columns(cli, tmp_path):
    # Piped output is 80 columns wide: long labels and every column must still show whole, never "…".
    path = write_tiny(tmp_path)
    text = path.read_text().replace("  - {kind: flat, reserve: oracle}", "  - {kind: flat, reserve: oracle, placement: best-fit}")
    path.write_text(text)
    result = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "o")], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "…" not in out and "..." not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    records = json.loads((tmp_path / "o" / "summary.json").read_text())
    from kvsim.replay.view import _COLUMNS

    for r in records:
        assert r["allocator"] in out
        for _, cell, essential in _COLUMNS:
            if essential:
                assert f" {cell(r)}" in out, (r["allocator"], cell(r))
    assert "resv: reserved for tokens a request will still" in out and "pre-empt: preemptions" in out


def test_prefill_saved_shows_at_80_columns_only_with_prefix_caching(cli, tmp_path):
    # Essential when an allocator caches prefixes (it goes on to the second table rather than be dropped).
    path = write_tiny(tmp_path)
    result = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "o")], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    records = json.loads((tmp_path / "o" / "summary.json").read_text())
    saved = next(r for r in records if r["allocator"] == "paged-16+prefix")["prefill_saved_pct"]
    assert saved > 0 and "prefill" in result.stdout and f" {saved:.0f}%" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    path.write_text(path.read_text().replace("  - {kind: paged, block_size: 16, prefix_caching: true}\n", ""))
    plain = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "p")], env={"COLUMNS": "80"})
    assert plain.exit_code == 0, plain.output
    assert "prefill" not in plain.stdout.split("tokens: KV")[0]  # the table, not the legend


def _main_in_a_child(tmp_path, argv: list[str], before: str = "", torch: bool = True) -> subprocess.CompletedProcess[str]:
    """`kvsim.cli.main()` in a fresh interpreter, with torch loaded or not (either way it skips the teardown)."""
    program = (
        f"import atexit, sys{', torch' if torch else ''}\n" + before + "from kvsim import cli\n"
        f"sys.argv = ['kvsim', *{argv!r}]\ncli.main()\nprint('main returned')\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, cwd=tmp_path)


@pytest.mark.parametrize("torch", [True, False])
def test_main_exits_with_the_commands_status_after_flushing_and_running_exit_handlers(tmp_path, torch):
    path = write_tiny(tmp_path, count=4)
    argv = ["replay", str(path), "--quiet", "--json", "--out", str(tmp_path / "o")] + ([] if torch else ["--no-tensors"])
    done = _main_in_a_child(tmp_path, argv, before="atexit.register(lambda: print('exit handler ran'))\n", torch=torch)
    assert done.returncode == 0, done.stderr
    assert "main returned" not in done.stdout  # main() leaves the process itself
    head, _, tail = done.stdout.rpartition("]")
    assert len(json.loads(head + "]")) == 3 and tail.strip() == "exit handler ran"  # every byte out, then handlers
    written = json.loads((tmp_path / "o" / "summary.json").read_text())  # the files whole
    assert [r["allocator"] for r in written] == [r["allocator"] for r in json.loads(head + "]")]
    bad = _main_in_a_child(tmp_path, ["replay", str(tmp_path / "missing.yaml")], torch=torch)
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr and "Traceback" not in bad.stderr


def test_main_ends_as_usual_while_a_thread_it_would_join_runs(tmp_path):
    """A non-daemon thread still running when the command is done: the interpreter's own end (which joins it and
    runs what threads registered), not `os._exit`, which would cut it off."""
    path = write_tiny(tmp_path, count=4)
    argv = ["replay", str(path), "--quiet", "--no-tensors", "--out", str(tmp_path / "o")]
    before = ("import threading, time\n"
              "threading.Thread(target=lambda: (time.sleep(1.0), print('thread finished', flush=True))).start()\n")
    done = _main_in_a_child(tmp_path, argv, before=before, torch=False)
    assert done.returncode == 0, done.stderr
    assert "thread finished" in done.stdout


def test_a_flat_allocator_on_an_attention_free_model_is_refused_by_name(cli, tmp_path):
    # mamba keeps no KV per token: a flat reservation has nothing to reserve (it was an AssertionError)
    path = tmp_path / "mamba.yaml"
    path.write_text(write_tiny(tmp_path).read_text().replace("model: tiny-model.json", "model: mamba-2.8b"))
    result = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith(f"kvsim: error: {path}: allocators[0].kind: mamba-2.8b has no attention layer")


@pytest.mark.parametrize(("model", "allocator", "line"), [
    # the paged engine's refusals, said before anything runs with the file and the allocator (they named neither)
    ("qwen3-0.6b", "{kind: paged, block_size: 16, prefix_caching: true, prefix_cache_retention_interval: 64}",
     "allocators[0].prefix_cache_retention_interval: qwen3-0.6b: is 64 but this model has no sliding-window layer group"),
    ("mamba-2.8b", "{kind: paged, block_size: 16}", "allocators[0].kind: mamba-2.8b: it has no attention layer group"),
])
def test_what_the_paged_engine_refuses_names_the_file_and_the_allocator(cli, tmp_path, model, allocator, line):
    path = tmp_path / "w.yaml"
    text = write_tiny(tmp_path).read_text().replace("model: tiny-model.json", f"model: {model}")
    text = text.replace(f"kv_budget: {1024 * BPT}", "kv_budget: 1GiB")
    head, _, _ = text.partition("allocators:")
    path.write_text(head + f"allocators:\n  - {allocator}\nscheduler: {{max_num_seqs: 16, max_num_batched_tokens: 256}}\n")
    for tensors in (["--no-tensors"], []):  # with CPU tensors (the default) too: not a --layers error
        result = cli(["replay", str(path), *tensors, "--out", str(tmp_path / "o")])
        assert result.exit_code == 2 and "Traceback" not in result.output
        (error,) = result.stderr.strip().splitlines()
        assert error.startswith(f"kvsim: error: {path}: {line}")


def test_a_cpu_tier_chunk_size_names_the_workloads_field(cli, tmp_path):
    path = write_tiny(tmp_path)
    path.write_text(path.read_text().replace("allocators:", "offload: {cpu_bytes: 1GiB, block_size: 7}\nallocators:", 1)
                    .replace("  - {kind: flat, reserve: oracle}\n", "").replace("  - {kind: paged, block_size: 16}\n", ""))
    result = cli(["replay", str(path), "--no-tensors", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    (error,) = result.stderr.strip().splitlines()
    assert error == (f"kvsim: error: {path}: offload.block_size: must be a positive multiple of the GPU block (16 tokens), got 7")
