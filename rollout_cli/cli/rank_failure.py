"""One failing rank of `--tp N` (or replica of `--dp N`) ends every rank within seconds, and only the
failing rank speaks.

The ranks wait for each other inside C++ (gloo's rendezvous, the broadcast of rank 0's next step,
the forward's all-reduce), where no Python signal handler runs: a rank that failed early left the
others deaf to the launcher's SIGTERM until its SIGKILL 30 s later, a follower printed a gloo
"connection closed" traceback of its own, and rank 0 failing inside a step (the followers in the
forward's all-reduce) waited forever in its "stop" broadcast. So a failure never coordinates; it is
told through the rendezvous store of torchrun's agent (MASTER_ADDR:MASTER_PORT), which outlives
every rank and which each rank reaches before its own rendezvous:

1. A failing rank (any exception out of the command, Ctrl-C included) claims the failure in the
   store: a `compare_set` of one key to its rank, exit code and one line (peer_failure.Claim), which
   only the first claim sets, so the line comes with the claim. A later claim is the consequence of
   the first (a gloo "connection closed": the peer left): that rank leaves silently with PEER_FAILED.
   The first says its one line (cli/errors.say: to the launcher's folder, which prints it once),
   writes its exit code there (the command's exit code, whichever exit torchrun noticed first) and
   leaves with os._exit: no "stop" message, no barrier, no interpreter finalization (gloo's threads
   can abort it).
2. Every rank runs a watchdog thread from its start, polling the claim 10 times a second on a
   connection of its own (the C++ waits release the GIL). When another rank claimed, the thread ends
   the process at once with PEER_FAILED: its main thread may be stuck in C++, and a follower has
   nothing to save.
3. A rank inside `closing_files` (rank 0 with run's job writer or the daemon; every --dp replica in
   its job, each writing its own shards) is the one exception: its main thread closes the finished
   rows and the manifest first. The claimer's sockets closed when it left, so a gloo collective the
   rank waits in raises at once; a --dp replica, which waits for no other mid-run, stops at its next
   step boundary (peer_failure.stop_if_a_peer_failed, once this thread saw the claim). Either way the
   job ends through run_job's cleanup and records the claimer's line, not gloo's
   (peer_failure.caused_by_peer; the daemon's engine thread asks it too). The thread ends the process
   anyway after GRACE_SECONDS (an NCCL collective may never notice a dead peer). While a claim
   stands, SIGTERM (torchrun stopping the other ranks) is ignored: it would cut that cleanup short,
   and the rank is leaving anyway.
4. SIGINT / SIGTERM that torchrun passes on to every rank are rank 0's under --tp: it ends its job as
   interrupted and claims (exit 130), and the followers, which ignore them (tensor_parallel_run.
   follow_leader), leave on that claim; one that left first would make rank 0's job "failed". Each
   --dp replica ends its own job as interrupted, on the signal or on the first one's claim. Should
   rank 0 die without a word, a follower learns it at its next collective with rank 0 (gloo's
   connection error), as before.

vLLM and SGLang get the same end by killing the process group from the parent. Here the parent is
torchrun: shortening its 30 s grace between SIGTERM and SIGKILL would not do (SIGTERM still goes
unheard inside C++ waits, rank 0 needs the time to close its job when a follower failed, and the
ranks of another node have another launcher). Without torchrun's agent store
(TORCHELASTIC_USE_AGENT_STORE unset) nothing is watched and rank 0 stops the followers with its "stop"
message as before. A rank killed outright (SIGKILL, a segfault) claims nothing: its peers learn it
from gloo's connection errors or the launcher's SIGTERM, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from rollout_cli import peer_failure
from rollout_cli.cli.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, launcher_folder, say
from rollout_cli.data_parallel import CLAIMED_EXIT_FILE, PEER_FAILED
from rollout_cli.errors import INTERRUPTED, RolloutError, one_line
from rollout_cli.peer_failure import Claim

POLL_SECONDS = 0.1
GRACE_SECONDS = 10.0  # a rank's cleanup of its files after a peer failed: flush the buffered rows, the manifest
STORE_TIMEOUT = timedelta(seconds=10)  # to connect, and for one store operation (the agent answers in ms)

_WATCH: RankWatch | None = None


def watching() -> bool:
    """Whether a failure here ends the other ranks through the store (so no "stop" message is needed)."""
    return _WATCH is not None and _WATCH.active


@contextlib.contextmanager
def rank_failures():
    """The command's body in a rank that torchrun started (RANK set; a no-op in the command typed):
    watch the other ranks' failures, and end this rank on its own as described above."""
    global _WATCH
    if "RANK" not in os.environ or _WATCH is not None:
        yield
        return
    _WATCH = watch = RankWatch()
    previous = signal.getsignal(signal.SIGTERM)
    if watch.active:
        signal.signal(signal.SIGTERM, _ignored_after_a_claim(watch, previous))
        peer_failure.watch(watch.lookup)
    try:
        yield
    except BaseException as err:
        if not watch.active or _exit_code(err) == 0:
            raise
        watch.fail(err)  # never returns
    finally:  # the command ended without an error (serve's rank 0 leaves through the interpreter)
        peer_failure.watch(None)
        watch.stop()
        signal.signal(signal.SIGTERM, previous)
        _WATCH = None


@contextlib.contextmanager
def closing_files():
    """A rank while it holds files to close: a peer's failure leaves them to its main thread (see 3.)."""
    if _WATCH is None:
        yield
        return
    _WATCH.closing = True
    try:
        yield
    finally:
        _WATCH.closing = False


def exit_process(code: int) -> None:
    """End this process now (from the main thread), skipping interpreter finalization: gloo's worker
    threads can still hold tensors then, and freeing them without a live interpreter aborts
    ("terminate called without an active exception", exit -6)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class RankWatch:
    """This rank's connections to the launcher's store, and the watchdog thread."""

    def __init__(self):
        self.key = f"rollout/rank_failure/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.closing = False  # set by closing_files
        self.claimed_here = False
        self.store = _connect()  # the main thread's (claims, the SIGTERM handler)
        poll_store = _connect() if self.store is not None else None  # the watchdog's
        self.active = poll_store is not None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(poll_store,), name="rank-failure-watch", daemon=True)
        if self.active:
            self._thread.start()

    def stop(self) -> None:
        """End the watchdog before the interpreter does: finalization ends a daemon thread caught inside a
        store call with pthread_exit through C++ frames, which aborts the process (exit -6)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=STORE_TIMEOUT.total_seconds())

    def claimed(self) -> bool:
        """Whether a rank claimed a failure (False when the store cannot tell: the launcher is gone)."""
        try:
            return self.store.check([self.key])
        except Exception:  # noqa: BLE001 - the store's errors are torch's, and mean "cannot tell"
            return False

    def lookup(self) -> Claim | None:
        """The standing claim, if any (None too when the store cannot tell: the launcher is gone)."""
        try:
            return Claim.decode(self.store.get(self.key)) if self.store.check([self.key]) else None
        except Exception:  # noqa: BLE001 - the store's errors are torch's, and mean "cannot tell"
            return None

    def fail(self, err: BaseException) -> None:
        """This rank's command raised `err`: its line and exit code if it claims the failure first, else
        nothing (the consequence of another rank's failure, which that rank tells)."""
        self.claimed_here = True  # before the store has it: the watchdog must not take it for a peer's
        code, line = _verdict(err)
        claim = Claim(int(os.environ["RANK"]), code, line,
                      interrupted=isinstance(err, KeyboardInterrupt) or code == EXIT_INTERRUPTED).encode()
        try:  # the key's value is the first claim's: set here only if no rank claimed before
            first = self.store.compare_set(self.key, "", claim) == claim
        except Exception:  # noqa: BLE001 - the launcher is gone: nobody else can tell it
            first = True
        if not first:
            exit_process(PEER_FAILED)
        _say(err)
        folder = launcher_folder()
        if folder is not None:
            (Path(folder) / CLAIMED_EXIT_FILE).write_text(str(code))
        exit_process(code)

    def _watch(self, store) -> None:
        while True:
            if self._stopping.wait(POLL_SECONDS):
                return
            try:
                if store.check([self.key]) and not self.claimed_here:
                    claim = Claim.decode(store.get(self.key))
                    break
            except Exception:  # noqa: BLE001 - the launcher is gone: nothing left to watch
                return
        peer_failure.seen(claim)  # raised at the main thread's next step boundary (a --dp replica's job ends there)
        if self.closing:  # the main thread closes its files (see 3.); this is the bound
            time.sleep(GRACE_SECONDS)
        # silent, so nothing to flush; and the streams' and logging's locks may be the main thread's
        os._exit(PEER_FAILED)


def _connect():
    """A client of torchrun's agent store, or None outside it (or when it does not answer)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not host or not port:
        return None
    import torch.distributed as dist  # heavy: torch, in a rank only

    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=STORE_TIMEOUT)
    except Exception:  # noqa: BLE001 - no store: the ranks stop each other as before
        return None


def _ignored_after_a_claim(watch: RankWatch, previous):
    """SIGTERM's handler: nothing while a claim stands (see 3.), else what it was."""

    def on_sigterm(signum, frame):
        if watch.claimed():
            return
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action: end the process
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    return on_sigterm


def _exit_code(err: BaseException) -> int | None:
    """The code of typer.Exit / SystemExit (said already by whoever raised it), else None."""
    code = getattr(err, "exit_code", None)
    if code is None and isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int) else 1
    return code


def _verdict(err: BaseException) -> tuple[int, str | None]:
    """(exit code, one line for the other ranks' records) of `err`; no line where it was said already
    (typer.Exit), or is no error (an interrupt)."""
    code = _exit_code(err)
    if code is not None:
        return code, None
    if isinstance(err, RolloutError):
        return EXIT_USER_ERROR, str(err)
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED, None
    return 1, f"{type(err).__name__}: {one_line(err)}"  # a bug: its traceback goes to the output (_say)


def _say(err: BaseException) -> None:
    """Say `err` as cli/errors.user_errors would (a bug keeps its traceback)."""
    if _exit_code(err) is not None:
        return
    if isinstance(err, RolloutError):
        say(str(err))
    elif isinstance(err, KeyboardInterrupt):
        if launcher_folder() is None:  # a launcher says it once for every rank
            print(INTERRUPTED, file=sys.stderr)
    else:
        traceback.print_exception(err)
