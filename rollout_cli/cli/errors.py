"""Turn user errors into one line on stderr and a non-zero exit."""

from __future__ import annotations

import contextlib
import signal
import sys

import typer

from rollout_cli.errors import RolloutError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors():
    """RolloutError -> 'error: ...' and exit 2; Ctrl-C or SIGTERM -> exit 130 after cleanup ran."""

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except RolloutError as err:
        fail(str(err))
    except KeyboardInterrupt:
        typer.echo("interrupted: finished trajectories are saved; re-run with --resume to complete the rest",
                   err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.stderr.flush()
