"""`rollout` command line: one Typer app, one module per command group."""

from __future__ import annotations

import typer

from rollout_cli.cli.bench import bench_command
from rollout_cli.cli.run import run_command

app = typer.Typer(
    name="rollout",
    help="Batch rollout engine for RL on language models: prompts Parquet in, trajectories Parquet out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run")(run_command)
app.command("bench")(bench_command)


@app.callback()
def main() -> None:
    """rollout: prompts Parquet in, trajectories Parquet out; see `rollout COMMAND --help`."""


if __name__ == "__main__":
    app()
