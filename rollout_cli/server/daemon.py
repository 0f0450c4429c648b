"""`rollout serve`: bind the socket, start the engine thread, serve the API with uvicorn.

The Unix socket is bound by us (not by uvicorn, which would chmod it 0666) under a 0177 umask,
so it is 0600 from its first instant; the path is claimed before the model loads, so a second
`rollout serve` on it is refused at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

from rollout_cli.engine.scheduling.sessions import DEFAULT_RETENTION_SECONDS
from rollout_cli.errors import RolloutError
from rollout_cli.server.address import DEFAULT_MAX_REQUEST_BYTES, is_socket_file, socket_is_live

log = logging.getLogger("rollout.serve")

# Pending connections the kernel queues before we accept them (uvicorn's own default). A burst of
# clients over a smaller backlog is refused at once on a Unix socket (EAGAIN), which a client
# cannot tell from a daemon that is not there.
BACKLOG = 2048

# Seconds an idle keep-alive connection stays open. uvicorn's 5 s equals httpx's pool expiry, so a
# client reusing a connection idle for ~5 s raced the server closing it: the request went out on a
# closing connection and failed (ReadError / RemoteProtocolError) with nothing logged here. Well
# above the client's expiry (client.KEEPALIVE_EXPIRY), the client always lets go first.
KEEP_ALIVE_SECONDS = 75


def read_token(token_file: str) -> str:
    try:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as err:
        raise RolloutError(f"cannot read --token-file {token_file}: {err.strerror}") from err
    if not token:
        raise RolloutError(f"--token-file {token_file} is empty; write a random token into it "
                           "(python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE)")
    return token


MAX_SOCKET_PATH = 107  # bytes of sockaddr_un.sun_path (108) less its terminating NUL


def bind_unix_socket(path: str) -> socket.socket:
    if os.path.lexists(path):
        if not is_socket_file(path):
            raise RolloutError(f"{path} exists and is not a socket; remove it or pass another --socket")
        if socket_is_live(path):
            raise RolloutError(f"an engine is already serving on {path}; stop it with "
                               f"rollout shutdown --engine {path}, or pass another --socket")
        log.info("removing stale socket %s", path)
        os.unlink(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise RolloutError(f"directory {directory} of --socket does not exist")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:  # the kernel's sun_path limit (bind says only "None")
        raise RolloutError(f"--socket {path} is {len(os.fsencode(path))} bytes long; a Unix socket path holds at most "
                           f"{MAX_SOCKET_PATH}: pass a shorter one (a relative path counts as typed)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as err:
        sock.close()
        raise RolloutError(f"cannot bind {path}: {err.strerror}") from err
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(BACKLOG)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RolloutError(f"cannot listen on {host}:{port}: {err.strerror}; pick another --port") from err
    sock.listen(BACKLOG)
    return sock


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """On SIGINT/SIGTERM, first end the running job (its rows are written and its client gets
        the `aborted` event), then let uvicorn close the connections."""

        def __init__(self, config, worker):
            super().__init__(config)
            self.worker = worker

        def handle_exit(self, sig, frame) -> None:
            if self.worker.ready.is_set() and self.worker.load_error is None and not self.should_exit:
                self.worker.submit("shutdown")
            super().handle_exit(sig, frame)

    return Server


def serve(engine_config, socket_path: str | None, host: str | None, port: int | None,
          token_file: str | None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          served_model_name: str | None = None, session_retention_seconds: float = DEFAULT_RETENTION_SECONDS,
          say_load_error: Callable[[str], None] | None = None) -> int:
    """Run the daemon until /shutdown, SIGINT or SIGTERM; return the exit code. say_load_error: how the
    engine's own load failure is told (rank 0 of --tp: to the launcher, which prints one line for every
    rank); by default it is logged."""
    # heavy: uvicorn, fastapi and the engine (torch); `rollout status` and the clients import this module
    try:
        import uvicorn  # heavy: the web stack, loaded by the daemon alone

        from rollout_cli.server.app import create_app  # heavy: fastapi
    except ModuleNotFoundError as err:  # an install that skipped rollout's dependencies (a bare device image)
        raise RolloutError(f"rollout serve needs the Python package {err.name!r}, which is not installed: "
                           f"pip install {err.name} (or reinstall rollout, which depends on it)") from err
    from rollout_cli.server.worker import EngineWorker  # heavy: the engine (torch)

    _Server = _server_class()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout serve: %(message)s", stream=sys.stderr)
    if not 0 < session_retention_seconds < float("inf"):  # NaN too
        raise RolloutError(f"--session-retention-seconds must be a finite number > 0, got {session_retention_seconds}")
    if max_request_bytes < 1:
        raise RolloutError(f"--max-request-bytes must be at least 1 (default {DEFAULT_MAX_REQUEST_BYTES})")
    tcp = host is not None or port is not None
    if tcp:
        if socket_path is not None:
            raise RolloutError("--socket and --host/--port both given; the engine listens on one of them")
        if token_file is None:
            raise RolloutError("TCP needs --token-file FILE: every request must carry that token")
        token = read_token(token_file)
        host = host or "127.0.0.1"
        if port is None:
            raise RolloutError("--host needs --port")
        sock = bind_tcp(host, port)
        where = f"http://{host}:{sock.getsockname()[1]}"
    else:
        if token_file is not None:
            raise RolloutError("--token-file is for TCP (--host/--port); the Unix socket is protected by its 0600 mode")
        token = None
        sock = bind_unix_socket(socket_path)
        where = socket_path
        socket_inode = os.stat(socket_path).st_ino

    worker = EngineWorker(engine_config, weights_path=engine_config.model,
                          session_retention_seconds=session_retention_seconds)
    holder: dict = {}

    def request_exit() -> None:
        holder["server"].should_exit = True

    app = create_app(worker, token, request_exit, max_request_bytes=max_request_bytes,
                     served_model_name=served_model_name)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS)
    server = holder["server"] = _Server(config, worker)
    worker.start()
    log.info("engine loading %s; listening on %s", engine_config.model, where)

    def announce_ready() -> None:
        worker.ready.wait()
        if worker.load_error is not None:
            if not worker.load_error_told:  # else a follower's failure: that rank says it, once
                tell = say_load_error or (lambda line: log.error("error: %s", line))
                tell(worker.load_error)
            request_exit()
        else:
            split = f", over {engine_config.tensor_parallel_size} tensor-parallel ranks" if worker.engine.tp else ""
            log.info("ready: %s, weight version %s%s, on %s", engine_config.model, worker.engine.weight_version,
                     split, where)

    threading.Thread(target=announce_ready, name="announce", daemon=True).start()
    # uvicorn turns SIGINT/SIGTERM into a graceful exit, then re-raises them with the handlers it
    # found: make those no-ops so the cleanup below (abort the job, remove the socket) runs.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if worker.is_alive() and worker.ready.is_set() and worker.load_error is None:
            worker.submit("shutdown")  # a no-op when /shutdown or a signal already stopped it
            worker.join(timeout=60)
        sock.close()
        if not tcp:
            try:
                if os.stat(socket_path).st_ino == socket_inode:
                    os.unlink(socket_path)
            except FileNotFoundError:
                pass
    return 2 if worker.load_error is not None else 0
