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
