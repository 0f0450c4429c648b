"""`rollout` command line: one Typer app, one module per command group."""

from __future__ import annotations

from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from rollout_cli.cli import control
from rollout_cli.cli.bench import bench_command
from rollout_cli.cli.run import run_command
from rollout_cli.cli.score import score_command
from rollout_cli.cli.serve import serve_command


def _flags_take_no_value(params: list) -> list:
    """typer >= 0.2x prints a `<bool>` placeholder after boolean flags (--quiet, --help), as if they
    took a value; `--quiet true` is then refused. An empty metavar shows them as the flags they are."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx):
        return _flags_take_no_value(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx):
        return _flags_take_no_value(super().get_params(ctx))


app = typer.Typer(
    name="rollout",
    cls=_Group,
    help="Batch rollout engine for RL on language models: prompts Parquet in, trajectories Parquet out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _command(name: str):
    return app.command(name, cls=_Command)


_command("run")(run_command)
_command("score")(score_command)
_command("bench")(bench_command)
_command("serve")(serve_command)
_command("reload-weights")(control.reload_weights_command)
_command("release-memory")(control.release_memory_command)
_command("resume-memory")(control.resume_memory_command)
_command("pause")(control.pause_command)
_command("continue")(control.continue_command)
_command("abort")(control.abort_command)
_command("flush-cache")(control.flush_cache_command)
_command("status")(control.status_command)
_command("shutdown")(control.shutdown_command)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"rollout {version('rollout-cli')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("rollout (not installed: run bash scripts/setup.sh)")
        raise typer.Exit()


@app.callback()
def main(
    show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
) -> None:
    """rollout: prompts Parquet in, trajectories Parquet out; see `rollout COMMAND --help`."""


if __name__ == "__main__":
    app()
