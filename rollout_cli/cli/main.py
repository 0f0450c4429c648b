"""`rollout` command line: one Typer app, one module per command group."""

from __future__ import annotations

import re
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.20 carries its own copy of click; older typers raise click's exceptions
    from typer._click import exceptions as click_errors
except ImportError:
    from click import exceptions as click_errors

from rollout_cli.cli import control
from rollout_cli.cli.bench import bench_command
from rollout_cli.cli.errors import fail
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

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click_errors.ClickException as err:  # the parser's errors may carry no context to name us by
            _one_line(err, f"{parent.command_path} {info_name}" if parent is not None else str(info_name))


def _one_line(err: Exception, command: str) -> None:
    """A usage error (unknown option or command, missing argument, bad value) as the CLI's own errors read:
    one `error:` line and the --help to read, exit 2; typer drew a box of several lines under the usage."""
    if isinstance(err, getattr(click_errors, "NoArgsIsHelpError", ())):  # bare `rollout`: the help is the answer
        raise err
    message = " ".join(err.format_message().split()).rstrip(".")
    if message[:2].istitle():  # "No such option" -> "no such option"; "URL ..." stays
        message = message[0].lower() + message[1:]
    # click's suggestion ends a sentence: "... 'rn'. Did you mean 'run'?" reads as one clause before the help
    message = re.sub(r"\. Did you mean (.+)\?$", r" (did you mean \1?)", message)
    if isinstance(err, click_errors.UsageError):
        message += f"; see '{command} --help'"
    fail(message, err.exit_code)


class _Group(TyperGroup):
    def get_params(self, ctx):
        return _flags_take_no_value(super().get_params(ctx))

    # the group's own usage errors (`rollout --bogus`, an unknown command); a subcommand's are _Command's
    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click_errors.ClickException as err:
            _one_line(err, str(info_name or "rollout"))

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click_errors.ClickException as err:
            _one_line(err, ctx.command_path)


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
