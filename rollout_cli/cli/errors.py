"""Turn user errors into one line on stderr and a non-zero exit."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading

import typer

from rollout_cli.data_parallel import REPLICA_ERRORS_ENV
from rollout_cli.errors import INTERRUPTED, RolloutError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def launcher_folder() -> str | None:
    """In a process that `rollout run --dp N` (or --tp N) started: the folder its launcher reads errors from."""
    folder, rank = os.environ.get(REPLICA_ERRORS_ENV), os.environ.get("RANK")
    return folder if folder and rank is not None and os.path.isdir(folder) else None


def say(message: str) -> None:
    """One line on stderr; in a process a launcher started, the line goes to the launcher, which prints
    each distinct one once (data_parallel.launch_replicas)."""
    folder = launcher_folder()
    if folder is not None:
        with open(os.path.join(folder, f"{int(os.environ['RANK'])}.txt"), "w") as handle:
            handle.write(message)
    else:
        typer.echo(f"error: {message}", err=True)


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    """One line on stderr (`say`) and exit `code`."""
    say(message)
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors():
    """RolloutError -> 'error: ...' and exit 2; Ctrl-C or SIGTERM -> exit 130 after cleanup ran."""

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    def on_unraisable(unraisable):
        # the KeyboardInterrupt raised in a finalizer (a __del__ that ran when the signal came) is dropped
        # there with a traceback on stderr: deliver it again to the main thread, from a thread (from the main
        # thread it would land in this hook; 50 ms: after the hook returned), quietly
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            later = threading.Timer(0.05, _thread.interrupt_main)
            later.daemon = True
            later.start()
        else:
            previous_hook(unraisable)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    previous_hook, sys.unraisablehook = sys.unraisablehook, on_unraisable
    try:
        yield
    except RolloutError as err:
        fail(str(err))
    except KeyboardInterrupt:
        if launcher_folder() is None:  # a launcher's processes: it says this once (a sibling's failure stops them too)
            typer.echo(INTERRUPTED, err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = previous_hook
        sys.stderr.flush()
