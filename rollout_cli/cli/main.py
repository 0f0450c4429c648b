"""`rollout` command line: one Typer app, one module per command group."""

from __future__ import annotations

import typer

from rollout_cli.cli import control
from rollout_cli.cli.bench import bench_command
from rollout_cli.cli.run import run_command
from rollout_cli.cli.serve import serve_command

app = typer.Typer(
    name="rollout",
    help="Batch rollout engine for RL on language models: prompts Parquet in, trajectories Parquet out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run")(run_command)
app.command("bench")(bench_command)
app.command("serve")(serve_command)
app.command("reload-weights")(control.reload_weights_command)
app.command("release-memory")(control.release_memory_command)
app.command("resume-memory")(control.resume_memory_command)
app.command("pause")(control.pause_command)
app.command("continue")(control.continue_command)
app.command("abort")(control.abort_command)
app.command("flush-cache")(control.flush_cache_command)
app.command("status")(control.status_command)
app.command("shutdown")(control.shutdown_command)


@app.callback()
def main() -> None:
    """rollout: prompts Parquet in, trajectories Parquet out; see `rollout COMMAND --help`."""


if __name__ == "__main__":
    app()
