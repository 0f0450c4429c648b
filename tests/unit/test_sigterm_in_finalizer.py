"""SIGTERM under user_errors becomes KeyboardInterrupt (cleanup runs, exit 130). When the signal lands
while a finalizer runs (a `__del__` the garbage collector called), Python drops the exception there
with a traceback on stderr: user_errors delivers it again to the main thread instead, quietly. Seen
as noise from the data-parallel replica the launcher stops after its sibling failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, signal, time
import typer
from rollout_cli.cli.errors import user_errors

class SignalsInItsFinalizer:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here, inside the finalizer

try:
    with user_errors():
        SignalsInItsFinalizer()
        for _ in range(2000):
            time.sleep(0.001)
        print("not interrupted")
except typer.Exit as done:
    print("exit", done.exit_code)
"""


def test_a_sigterm_inside_a_finalizer_still_interrupts_without_a_traceback():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.stdout.strip() == "exit 130"
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
    assert result.stderr.strip().startswith("interrupted: finished trajectories are saved")
