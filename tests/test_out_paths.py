"""`--out` paths that cannot be used: one error line and exit 2, checked before the work, never a traceback."""

from __future__ import annotations

import pytest

from kvsim.errors import KvsimError
from kvsim.out_paths import output_dir, output_file


def test_output_file_refuses_directory_and_file_parent(tmp_path):
    a_file = tmp_path / "a.csv"
    a_file.write_text("x")
    with pytest.raises(KvsimError, match="is a directory"):
        output_file(tmp_path)
    with pytest.raises(KvsimError, match="a.csv is a file, not a directory"):
        output_file(a_file / "x.csv")
    assert output_file(a_file) == a_file  # an existing file is overwritten
    assert output_file(tmp_path / "new" / "b.csv").parent.is_dir()


def test_output_dir_refuses_a_file(tmp_path):
    a_file = tmp_path / "a.csv"
    a_file.write_text("x")
    with pytest.raises(KvsimError, match="is a file"):
        output_dir(a_file)
    with pytest.raises(KvsimError, match="--out"):
        output_dir(a_file / "sub")
    assert output_dir(tmp_path / "d" / "e").is_dir()


def _bad_outs(tmp_path):
    a_file = tmp_path / "a.csv"
    a_file.write_text("x")
    return {"directory": str(tmp_path), "file as parent": str(a_file / "x.csv"), "proc": "/proc/x/y.csv"}, a_file


@pytest.mark.parametrize("case", ["directory", "file as parent", "proc"])
def test_bench_allocator_bad_out_is_one_line(cli, tmp_path, monkeypatch, case):
    from kvsim.bench import allocator

    monkeypatch.setattr(allocator, "run_allocator_bench", lambda **kw: pytest.fail("ran before checking --out"))
    outs, _ = _bad_outs(tmp_path)
    result = cli(["bench", "allocator", "--num-requests", "4", "--out", outs[case]])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "kvsim: error: --out:" in result.output
    assert not isinstance(result.exception, OSError)


@pytest.mark.parametrize("case", ["existing file", "file as parent", "proc"])
def test_bench_kernels_bad_out_is_one_line(cli, tmp_path, case):
    outs, a_file = _bad_outs(tmp_path)
    target = {"existing file": str(a_file), "file as parent": outs["file as parent"], "proc": "/proc/x/y"}[case]
    result = cli(["bench", "kernels", "--device", "cpu", "--block-sizes", "16", "--context-lens", "16", "--out", target])
    assert result.exit_code == 2, result.output
    assert "kvsim: error: --out:" in result.output.splitlines()[-1]
    assert not isinstance(result.exception, OSError)


def test_output_dir_check_without_creating(tmp_path):
    a_file = tmp_path / "a.csv"
    a_file.write_text("x")
    assert output_dir(tmp_path / "x" / "y", create=False) == tmp_path / "x" / "y"
    assert not (tmp_path / "x").exists()
    with pytest.raises(KvsimError, match="a.csv is a file"):
        output_dir(a_file / "y", create=False)


def test_replay_out_under_a_file_fails_before_the_replay(cli, tmp_path, monkeypatch):
    import kvsim.replay.run

    monkeypatch.setattr(kvsim.replay.run, "run_replay", lambda *a, **kw: pytest.fail("replayed before checking --out"))
    a_file = tmp_path / "a.csv"
    a_file.write_text("x")
    from tests.conftest import REPO

    result = cli(["replay", str(REPO / "workloads" / "poisson.yaml"), "--no-tensors", "--out", str(a_file / "r")])
    assert result.exit_code == 2 and result.output.strip().startswith("kvsim: error: --out:")


@pytest.mark.parametrize(
    "args",
    [
        ["replay", "workloads/poisson.yaml", "--no-tensors", "--limit", "3"],  # was: silently the default reports/poisson/
        ["bench", "allocator", "--num-requests", "4"],  # was: silently no CSV
        ["plot", "size", "-m", "qwen3-0.6b"],  # was: the current directory
        ["cache-curve", "workloads/shared-prefix.yaml"],
        ["sweep", "workloads/sweeps/block-size-x-budget.yaml"],
    ],
    ids=lambda a: a[0] if a[0] != "bench" else "bench-allocator",
)
def test_empty_out_is_refused_before_any_work(cli, tmp_path, monkeypatch, args):
    from tests.conftest import REPO

    monkeypatch.chdir(tmp_path)
    args = [str(REPO / a) if a.startswith("workloads/") else a for a in args]
    result = cli([*args, "--out", ""])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == "kvsim: error: --out: an empty path; give a directory, or leave the option out for the default"
    assert list(tmp_path.iterdir()) == []  # nothing written here either


def test_help_shows_the_perfdb_extra_in_brackets(cli):
    # rich reads `[perfdb]` as markup and drops it unless escaped: "pip install kvsim" names no extra
    assert "pip install kvsim[perfdb]" in " ".join(cli(["replay", "--help"]).output.split())
    assert "(needs kvsim[perfdb])" in " ".join(cli(["size", "--help"]).output.split())


@pytest.mark.parametrize("case", ["existing file", "file as parent"])
def test_sweep_out_on_a_file_says_so_before_any_replay(cli, tmp_path, monkeypatch, case):
    # it said "cannot write a.csv/rows.jsonl: File exists" (or "Not a directory")
    from kvsim.sweep import runners
    from tests.conftest import REPO

    monkeypatch.setattr(runners, "run_local", lambda *a, **kw: pytest.fail("replayed before checking --out"))
    a_file = tmp_path / "a.csv"
    a_file.write_text("x")
    target = a_file if case == "existing file" else a_file / "sub"
    result = cli(["sweep", str(REPO / "workloads" / "sweeps" / "block-size-x-budget.yaml"), "-q", "--out", str(target)])
    assert result.exit_code == 2, result.output
    expected = f"{a_file} is a file, not a directory" if case == "existing file" else f"cannot create the directory {target}: {a_file} is a file"
    assert result.output.strip() == f"kvsim: error: --out: {expected}"
