"""Waiting for a test's `rollout serve` to answer: a readiness probe, not a timing assumption."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_for_daemon(proc: subprocess.Popen, sock: Path, log: Path, timeout: float = 120) -> None:
    """Poll /health on the daemon's socket until it answers 200; fail with its log if it exits or never does."""
    deadline = time.monotonic() + timeout
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://rollout") as http:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"daemon exited {proc.returncode}:\n{log.read_text()}"
            try:
                if http.get("/health").status_code == 200:
                    return
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, FileNotFoundError):
                pass
            time.sleep(0.1)
    raise AssertionError(f"daemon not ready after {timeout} s:\n{log.read_text()}")
