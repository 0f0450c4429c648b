"""A daemon killed mid-job loses no finished trajectory: SIGTERM ends it like Ctrl-C ends an embedded
run, SIGKILL leaves whole shards and a stale socket the next daemon takes over; `run --resume`
completes the rest either way. Real daemons over Unix sockets, the CLI as subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from test_daemon import CLI, MODEL, PROMPTS, REPO, Daemon, _cli, _env, _ok, _rows


@pytest.fixture
def work(tmp_path) -> Path:
    return tmp_path


def test_sigterm_mid_job_keeps_finished_rows_and_resume_completes(work):
    """SIGTERM ends the daemon like Ctrl-C ends an embedded run: unfinished samples are not written,
    the manifest says interrupted, the socket goes away, and `run --resume` generates the rest."""
    sock, out = work / "term.sock", work / "d_term"
    daemon = Daemon(["--socket", sock], work / "term.log")
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://rollout", timeout=60)
    args = ["--data", PROMPTS, "--out", out, "--n", "2", "--limit", "8", "--max-new-tokens", "400",
            "--ignore-eos", "--seed", "3", "--quiet"]
    try:
        daemon.wait_ready(client)
        run = subprocess.Popen(CLI + ["run", "--engine", str(sock), *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
        deadline = time.monotonic() + 60
        while client.get("/get_server_info").json()["job"] is None:
            assert time.monotonic() < deadline and run.poll() is None, run.communicate()
            time.sleep(0.05)
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(30) == 0
        _, stderr = run.communicate(timeout=30)
        assert run.returncode == 130 and "re-run with --resume" in stderr, stderr
        assert not sock.exists()
        assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"
    finally:
        client.close()
        daemon.kill()
    _ok(_cli(["run", "--model", MODEL, "--resume", *args]))
    rows = _rows(out)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(8) for s in range(2)]
    assert {r["finish_reason"] for r in rows} == {"length"}


def test_kill_9_mid_job_leaves_whole_shards_and_resume_on_a_new_daemon_completes(work):
    """SIGKILL gives the daemon no chance to clean up: the shards already renamed are whole, the
    stale socket is taken over by the next daemon, and `run --resume` there writes exactly the rest."""
    sock, out = work / "kill.sock", work / "d_kill"
    args = ["--data", PROMPTS, "--out", out, "--n", "2", "--limit", "6", "--max-new-tokens", "200", "--ignore-eos",
            "--seed", "7", "--quiet", "--shard-rows", "1"]
    # two requests at a time: rows finish in six waves, so the kill lands between the first and the last
    daemon = Daemon(["--socket", sock, "--max-running", "2"], work / "kill.log")
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://rollout", timeout=60)

    def shards() -> list[Path]:
        return sorted(out.glob("trajectories/part-*.parquet"))

    run = None
    try:
        daemon.wait_ready(client)
        run = subprocess.Popen(CLI + ["run", "--engine", str(sock), *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
        deadline = time.monotonic() + 90
        while not shards():
            assert time.monotonic() < deadline and run.poll() is None, run.communicate()
            time.sleep(0.01)
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(30)
        run.communicate(timeout=30)
        assert run.returncode != 0
    finally:
        client.close()
        daemon.kill()
        if run is not None and run.poll() is None:
            run.kill()
    kept = sum(pq.read_table(path).num_rows for path in shards())  # every renamed shard reads whole
    assert 1 <= kept < 12
    second = Daemon(["--socket", sock], work / "kill2.log")  # over the stale socket the kill left
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://rollout", timeout=60)
    try:
        second.wait_ready(client)
        _ok(_cli(["run", "--engine", sock, "--resume", *args]))
    finally:
        client.close()
        second.kill()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["trajectories_this_run"] == 12 - kept
    rows = _rows(out)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(6) for s in range(2)]
    assert all(len(r["response_token_ids"]) == 200 for r in rows)


def test_abort_ends_a_job_whose_prompt_comes_in_slices(work):
    """A prompt of more samples than the loop queues (--n past 2 x --max-running) comes in slices: an abort
    ended only the slice in flight, the next one was queued and the job ran on (--n 1000000: for hours);
    with the stop flag set no later command (abort, shutdown, SIGTERM) was answered until it ended."""
    sock, out = work / "slices.sock", work / "d_slices"
    daemon = Daemon(["--socket", sock, "--max-running", "2"], work / "slices.log")  # slices of 4 samples
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://rollout", timeout=60)
    run = None
    try:
        daemon.wait_ready(client)
        run = subprocess.Popen(CLI + ["run", "--engine", str(sock), "--data", str(PROMPTS), "--out", str(out),
                                      "--n", "1000000", "--limit", "1", "--max-new-tokens", "1", "--quiet"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
        deadline = time.monotonic() + 60
        while ((client.get("/get_server_info").json()["job"] or {}).get("trajectories") or 0) < 8:
            assert time.monotonic() < deadline and run.poll() is None, run.communicate()
            time.sleep(0.05)
        _ok(_cli(["abort", "--engine", sock], timeout=30))
        _, stderr = run.communicate(timeout=30)  # the job ends with the slice in flight
        assert run.returncode == 130, stderr
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["status"] == "interrupted" and manifest["trajectories"] < 1000000
        _ok(_cli(["shutdown", "--engine", sock], timeout=30))  # commands are answered again
        assert daemon.proc.wait(30) == 0
    finally:
        client.close()
        daemon.kill()
        if run is not None and run.poll() is None:
            run.kill()
