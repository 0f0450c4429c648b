"""The one exception type users see.

Every problem caused by the user's input (a bad flag, a bad file, a bad
checkpoint) raises `RolloutError` with one line that says what is wrong and
how to fix it. The CLI prints that line and exits non-zero; anything else is a
bug and keeps its traceback.
"""


class RolloutError(Exception):
    """A user-facing error: `str(err)` is one line with the problem and the fix."""


class EngineUnreachable(RolloutError):
    """No daemon answers at the address (none started yet, or it went away): `rollout status --wait` waits on it."""


class Conflict(RolloutError):
    """The request is valid but cannot run in the engine's current state (the daemon answers 409)."""


# what an interrupted `rollout run` says (Ctrl-C, SIGTERM; once, from the launcher, under --dp / --tp)
INTERRUPTED = "interrupted: finished trajectories are saved; re-run with --resume to complete the rest"


class JobInterrupted(Exception):
    """Ends a job on request (the daemon's abort or shutdown) after its finished rows were written:
    the manifest says `interrupted`, and --resume completes the rest."""


def one_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty), for one-line errors."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
