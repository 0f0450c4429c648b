"""`rollout` help and version, in process (typer's CliRunner): what a new user reads first."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from rollout_cli.cli.main import app

COMMANDS = ["run", "bench", "serve", "reload-weights", "release-memory", "resume-memory", "pause", "continue",
            "abort", "flush-cache", "status", "shutdown"]


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_boolean_flags_show_no_value_placeholder(command):
    text = _help(*([command] if command else []))
    assert "--help" in text
    assert "<bool>" not in text, text


def test_a_flag_refuses_a_value_as_an_extra_argument():
    """A flag takes no value (as its help now shows): `--json true` leaves `true` an unexpected argument."""
    result = CliRunner().invoke(app, ["status", "--json", "true"])
    assert result.exit_code == 2 and "true" in result.output


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and re.fullmatch(r"rollout \d+\.\d+\.\d+\S*\n", result.output), result.output


def test_serve_help_gives_each_default_under_its_own_option():
    rows = {m.group(1): m.group(2) for m in re.finditer(r"(--[a-z-]+)\s+<\w+>\s+(.*)", _help("serve"))}
    assert "127.0.0.1" in rows["--host"] and "127.0.0.1" not in rows["--port"], rows
    assert "413" in rows["--max-request-bytes"]


def _usage_error(*args: str) -> str:
    """The one line a usage error prints (typer drew a multi-line box under the usage); exit 2."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "╭" not in result.output and "Usage:" not in result.output
    return lines[0]


@pytest.mark.parametrize("command", [*COMMANDS, "score"])
def test_an_unknown_option_is_one_line_for_every_command(command):
    line = _usage_error(command, "--bogus")
    assert line.startswith("error: no such option: --bogus") and line.endswith(f"; see 'rollout {command} --help'")


@pytest.mark.parametrize("args, line", [
    (["reload-weights"], "error: missing argument 'checkpoint'; see 'rollout reload-weights --help'"),
    (["score", "--model", "m"], "error: missing option '--data'; see 'rollout score --help'"),
    (["run", "--dtype"], "error: option '--dtype' requires an argument; see 'rollout run --help'"),
    (["nosuch"], "error: no such command 'nosuch'; see 'rollout --help'"),
    (["rn"], "error: no such command 'rn' (did you mean 'run'?); see 'rollout --help'"),
    (["--bogus"], "error: no such option: --bogus; see 'rollout --help'"),
])
def test_missing_arguments_and_unknown_commands_are_one_line(args, line):
    assert _usage_error(*args) == line


def test_a_bad_value_names_the_option():
    assert _usage_error("run", "--n", "abc").startswith("error: invalid value for '--n': ")
