"""`--help` of every command at a narrow terminal: every option name shown whole, none cut with an ellipsis."""

from __future__ import annotations

import pytest
import typer.main

from kvsim.cli import app


def _commands():
    root = typer.main.get_command(app)
    stack = [((), root)]
    while stack:
        path, cmd = stack.pop()
        yield path, cmd
        if hasattr(cmd, "commands"):  # a group
            stack += [((*path, name), sub) for name, sub in cmd.commands.items()]


COMMANDS = sorted(_commands(), key=lambda pc: pc[0])


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) or "kvsim" for p, _ in COMMANDS])
@pytest.mark.parametrize("width", [80, 60])
def test_help_shows_every_option_name_whole(cli, path, cmd, width):
    result = cli([*path, "--help"], env={"COLUMNS": str(width)})  # not TERMINAL_WIDTH: typer reads it once, at import
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    words = {w.strip("│,") for line in result.output.splitlines() for w in line.split()}
    names = [name for param in cmd.params for name in (*param.opts, *param.secondary_opts) if name.startswith("-")]
    names.append("--help")
    missing = [name for name in names if name not in words]
    assert not missing, f"cut or missing at COLUMNS={width}: {missing}"


NAMED_RUNS = [
    ["size", "--help"],
    ["size", "--model", "qwen3-0.6b", "--json"],
    ["size", "--model", "qwen3-0.6b", "--tp", "x"],
    ["size", "--no-such-option"],
    ["bench", "--help"],
    ["bench", "allocator", "--help"],
    ["cache-curve", "--help"],
    ["replay"],
    ["models", "--json"],
]


@pytest.mark.parametrize("args", NAMED_RUNS, ids=" ".join)
def test_a_named_command_run_alone_prints_what_the_whole_app_does(args):
    """`kvsim NAME ...` builds the one command it names (app_for): its help, output, errors and exit code are
    the whole app's."""
    from typer.testing import CliRunner

    from kvsim.cli import app_for

    alone = app_for(args)
    assert alone is not app
    assert [c.callback.__name__.replace("_", "-") for c in alone.registered_commands] + [g.name for g in alone.registered_groups] == [args[0]]
    runner = CliRunner()
    whole, one = runner.invoke(app, args), runner.invoke(alone, args)
    assert (one.exit_code, one.output) == (whole.exit_code, whole.output)


@pytest.mark.parametrize("args", [[], ["--help"], ["--version"], ["sise"], ["--version", "size"]], ids=repr)
def test_no_command_name_first_gets_the_whole_app(args):
    from kvsim.cli import app_for

    assert app_for(args) is app
