"""`rollout run` on a daemon: send the job to /generate and draw its streamed progress.

The daemon reads the prompts and writes OUT itself, so both paths go as absolute paths.
Ctrl-C detaches: the job goes on in the engine (`rollout status`, `rollout abort`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from types import SimpleNamespace

import typer
from rich.console import Console

from rollout_cli.cli import options as opt
from rollout_cli.cli.display import RunProgressBar, run_summary_table
from rollout_cli.cli.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, user_errors
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.errors import RolloutError
from rollout_cli.server.address import ENV_ENGINE


def check_daemon_flags(model: str | None, engine: str | None, engine_options: dict) -> None:
    """A run on a daemon takes neither --model nor engine options: the daemon serves its own engine."""
    if model is not None:
        source = "--engine" if engine is not None else f"${ENV_ENGINE}"
        raise RolloutError(f"--model runs an embedded engine but {source} points at a daemon, which serves "
                           f"its own model; drop --model, or {'drop --engine' if engine else f'unset {ENV_ENGINE}'}")
    engine_flags = [name for name, value in engine_options.items() if value != opt.ENGINE_DEFAULTS[name]]
    if engine_flags:
        flags = ", ".join("--" + name.replace("_", "-") for name in engine_flags)
        raise RolloutError(f"engine options ({flags}) belong to rollout serve, not to a run on a daemon")


def remote_run(job_fields: dict, params: SamplingParams, quiet: bool, *, engine: str | None,
               token_file: str | None) -> None:
    """Run the job (JobConfig's fields; the daemon builds and checks the JobConfig) on the daemon at `engine`."""
    from rollout_cli.server.client import EngineClient, resolve_address  # httpx: only a run on a daemon needs it

    console = Console(stderr=True, quiet=quiet)
    outcome = None
    with user_errors():
        if engine is None and not os.environ.get(ENV_ENGINE) and not os.path.exists(resolve_address(None)):
            raise RolloutError(f"no engine at {resolve_address(None)}; start one with rollout serve --model DIR, "
                               "or pass --model DIR to run without one")
        if not math.isfinite(job_fields["flush_seconds"]):  # JSON has no inf or nan: the body was a traceback
            raise RolloutError(f"--flush-seconds {job_fields['flush_seconds']}: a run on a daemon takes a finite "
                               "number of seconds; give one (a large one, such as 86400, closes shards by row count "
                               "alone)")
        body = dict(job_fields, data=os.path.abspath(job_fields["data"]), out=os.path.abspath(job_fields["out"]),
                    sampling_params=dataclasses.asdict(params))
        if job_fields.get("env"):  # the daemon imports it: a path on its machine, as data and out are
            body["env"] = os.path.abspath(job_fields["env"])
        with EngineClient(resolve_address(engine), token_file) as client, RunProgressBar(console) as update:
            try:
                for event in client.stream("/generate", body):
                    if event["event"] == "progress":
                        update(SimpleNamespace(**event))
                    else:
                        outcome = event
            except KeyboardInterrupt:
                typer.echo("detached: the job goes on in the engine; rollout status shows it, rollout abort stops it",
                           err=True)
                raise typer.Exit(EXIT_INTERRUPTED)
    if outcome is None:
        typer.echo("error: the engine ended the job without a result; check its log", err=True)
        raise typer.Exit(EXIT_USER_ERROR)
    if outcome["event"] == "error":
        typer.echo(f"error: {outcome['message']}", err=True)
        raise typer.Exit(EXIT_USER_ERROR)
    if not quiet:
        console.print(run_summary_table(outcome["manifest"], job_fields["out"]))
    if outcome["event"] == "aborted":
        if outcome.get("reason") == "shutdown":
            typer.echo("interrupted: the engine shut down; finished trajectories are saved; "
                       "re-run with --resume to complete the rest", err=True)
        else:
            typer.echo("aborted: unfinished samples were written with finish_reason abort", err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
