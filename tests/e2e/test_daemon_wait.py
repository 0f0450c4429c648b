"""`rollout status --wait S`: a shell script starts `rollout serve &` and waits for it in one line. The
daemon just started has no socket yet, then answers in state loading; --wait returns once it serves, and
says in one line when the time runs out. A real daemon over a Unix socket, the CLI as subprocesses."""

from __future__ import annotations

import subprocess

from test_daemon import CLI, REPO, Daemon, _cli, _env


def test_status_wait_returns_once_a_daemon_started_beside_it_serves(tmp_path):
    sock = tmp_path / "wait.sock"
    waiting = subprocess.Popen(CLI + ["status", "--wait", "120", "--engine", str(sock)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())  # before the daemon
    daemon = Daemon(["--socket", sock], tmp_path / "daemon.log")
    try:
        stdout, stderr = waiting.communicate(timeout=180)
        assert waiting.returncode == 0, stderr
        assert "state           serving" in stdout
    finally:
        if waiting.poll() is None:
            waiting.kill()
        daemon.kill()


def test_status_wait_gives_up_in_one_line(tmp_path):
    result = _cli(["status", "--wait", "0.3", "--engine", tmp_path / "none.sock"])
    assert result.returncode == 2 and not result.stdout
    assert result.stderr.strip().splitlines() == [
        f"error: the engine did not serve within 0.3 s; no engine at {tmp_path / 'none.sock'}; "
        "start one with rollout serve --model DIR"]
    bad = _cli(["status", "--wait", "-1", "--engine", tmp_path / "none.sock"])
    assert bad.returncode == 2 and "--wait must be a number of seconds, 0 or more (got -1)" in bad.stderr


def test_serve_without_its_web_stack_says_what_to_install(tmp_path):
    """A bare install (the device image had no uvicorn) gets one line naming the package, not a traceback."""
    import sys

    script = ("import sys; sys.modules['uvicorn'] = None\n"  # importing it now raises ModuleNotFoundError
              "from rollout_cli.cli.main import app\n"
              f"sys.argv = ['rollout', 'serve', '--model', 'recipes/example_model', '--device', 'cpu', "
              f"'--socket', {str(tmp_path / 'bare.sock')!r}]\n"
              "app()")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                            env=_env())
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: rollout serve needs the Python package 'uvicorn', which is not installed: pip install uvicorn "
        "(or reinstall rollout, which depends on it)"]
