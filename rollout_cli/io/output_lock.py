"""One job per output directory at a time.

A second job on the same OUT while the first still writes (a `--resume` typed too early, a daemon job
and an embedded run) would delete the first one's temp shards (resume cleans them) and interleave
shard numbers. The job holds an exclusive flock on the OUT directory itself: no file is added to OUT,
and the kernel releases the lock when the process ends, however it ends (so a run killed outright
can always be resumed). A daemon runs job after job in one process, so the lock is released when
each job returns (flock belongs to the open file description: the same process could not take it
twice).
"""

from __future__ import annotations

import fcntl
import os

from rollout_cli.errors import RolloutError


class OutputLock:
    """`with OutputLock(out) as lock:` holds OUT from the start if it exists (a resume), else from
    `lock.hold()`, called once the job created it; released at the end of the block."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        if os.path.isdir(self.out_dir):
            self.hold()
        return self

    def hold(self) -> None:
        """Take the lock if not held yet; refuse in one line if another job holds it."""
        if self._fd is not None:
            return
        fd = os.open(self.out_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RolloutError(f"another rollout job is writing {self.out_dir}; wait for it to end (then --resume "
                               "if it stopped early), or choose another --out") from None
        self._fd = fd

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None
