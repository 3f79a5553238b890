"""The CLI's user errors: an empty value of any option or argument is one line naming it, exit code 2."""

from __future__ import annotations

import typing

import pytest
import typer.main

from kvsim.cli import app


def _takes_text(hint) -> bool:
    """Whether an option's type is str (or a list of str, Optional or not)."""
    return hint is str or any(_takes_text(arg) for arg in typing.get_args(hint))


def _text_parameters():
    """(command path, option + empty value, arguments, label) for every option and argument that takes text."""
    root = typer.main.get_command(app)
    stack = [((), root)]
    while stack:
        path, cmd = stack.pop()
        if hasattr(cmd, "commands"):  # a group
            stack += [((*path, name), sub) for name, sub in cmd.commands.items()]
            continue
        hints = typing.get_type_hints(cmd.callback, include_extras=True)
        arguments = [p for p in cmd.params if p.param_type_name == "argument"]
        for param in cmd.params:
            if not _takes_text(typing.get_args(hints[param.name])[0]) or param.name == "out":  # --out: tests/test_out_paths.py
                continue
            if param.param_type_name == "argument":
                yield path, [""], [], ""
            else:
                # every argument given, a file that does not exist: the empty option is refused before anything is read
                yield path, [param.opts[0], ""], ["no-such-file.yaml" for _ in arguments], param.opts[0]


CASES = sorted(_text_parameters())


@pytest.mark.parametrize("path, option, arguments, label", CASES, ids=[f"{' '.join(c[0])} {c[3]}" for c in CASES])
def test_an_empty_value_is_one_line_naming_it(cli, tmp_path, monkeypatch, path, option, arguments, label):
    monkeypatch.chdir(tmp_path)  # nothing may be read or written here
    result = cli([*path, *arguments, *option])
    assert result.exit_code == 2, result.output
    head, _, message = result.output.removeprefix("kvsim: error: ").partition(": ")
    assert message.startswith("an empty value") and result.output.count("\n") == 1, result.output
    assert head == label or not label, result.output  # an option is named by its first long flag
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, line", [
    # each was silently "not given" (exit 0): the workload's synthetic requests, the current directory as the model
    (["replay", "workloads/poisson.yaml", "--no-tensors", "--trace", ""], "--trace: an empty value; give one, or leave the option out"),
    (["cache-curve", "workloads/shared-prefix.yaml", "--model", ""], "--model: an empty value; give one, or leave the option out"),
    (["cache-curve", "workloads/shared-prefix.yaml", "--hardware", " "], "--gpu: an empty value; give one, or leave the option out"),
    (["plot", "size", "-m", "qwen3-0.6b", "-m", ""], "--model: an empty value; give one, or leave the option out"),
    (["replay", ""], "WORKLOAD: an empty value"),
])
def test_empty_values_of_the_reported_commands(cli, tmp_path, monkeypatch, args, line):
    from tests.conftest import REPO

    monkeypatch.chdir(tmp_path)  # a replay that ran anyway would write reports/ here, not into the repository
    result = cli([str(REPO / a) if a.startswith("workloads/") else a for a in args])
    assert result.exit_code == 2, result.output
    assert result.output == f"kvsim: error: {line}\n"
    assert list(tmp_path.iterdir()) == []
