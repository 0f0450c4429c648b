"""EngineClient against a scripted HTTP server on a Unix socket: the keep-alive race, replayed
without timing.

The race: the daemon closes an idle keep-alive connection just as the client sends a request on
it; the request is never read and the client sees the connection end with no answer (httpx
RemoteProtocolError / ReadError). The scripted server closes a connection after reading a
request, which is what the client sees in that race, every time.
"""

from __future__ import annotations

import socket
import threading

import pytest

from rollout_cli.errors import RolloutError
from rollout_cli.server import client as client_module
from rollout_cli.server import daemon
from rollout_cli.server.client import EngineClient

ANSWER = b'{"event": "done"}\n'  # a JSON object for get(), an NDJSON line for stream()


def _read_request(conn: socket.socket) -> bytes | None:
    """One HTTP/1.1 request (headers and Content-Length body), or None when the client closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head


class ScriptedServer:
    """Connection i runs script[i]: per request read, "answer" (200, keep-alive) or "close"
    (close without a byte of answer). Counts connections and requests."""

    def __init__(self, path: str, script: list[list[str]]):
        self.script = script
        self.connections = 0
        self.requests = 0
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(path)
        self.listener.listen(16)
        self.path = path
        self.stopping = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            if self.stopping:
                conn.close()
                return
            actions = self.script[self.connections] if self.connections < len(self.script) else ["close"]
            self.connections += 1
            threading.Thread(target=self._run, args=(conn, actions), daemon=True).start()

    def _run(self, conn: socket.socket, actions: list[str]) -> None:
        with conn:
            for action in actions:
                if _read_request(conn) is None:
                    return
                self.requests += 1
                if action == "close":
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
            _read_request(conn)  # hold the connection until the client closes it

    def stop(self) -> None:
        """Connections are accepted in order: every one the client made before this is counted."""
        self.stopping = True
        with socket.socket(socket.AF_UNIX) as wake:
            wake.connect(self.path)
        self.thread.join(10)
        self.listener.close()


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "engine.sock")


def test_a_reused_connection_closed_unanswered_is_retried_once_on_a_new_one(sock):
    server = ScriptedServer(sock, [["answer", "close"], ["answer"]])
    with EngineClient(sock) as client:
        assert client.get("/get_server_info") == {"event": "done"}
        assert client.get("/get_server_info") == {"event": "done"}  # the reused connection closes: retried
    server.stop()
    assert (server.connections, server.requests) == (2, 3)


def test_stream_retries_the_same_way(sock):
    server = ScriptedServer(sock, [["answer", "close"], ["answer"]])
    with EngineClient(sock) as client:
        assert client.get("/health") == {"event": "done"}
        assert list(client.stream("/generate", {"data": "/d", "out": "/o"})) == [{"event": "done"}]
    server.stop()
    assert (server.connections, server.requests) == (2, 3)


def test_a_new_connection_closed_unanswered_is_not_retried(sock):
    """On a fresh connection no keep-alive race is possible: the daemon went away; one line, no retry."""
    server = ScriptedServer(sock, [["close"], ["answer"]])
    with EngineClient(sock) as client, pytest.raises(RolloutError) as err:
        client.post("/abort_request")
    server.stop()
    assert (server.connections, server.requests) == (1, 1)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"no engine at {sock}")


def test_only_one_retry(sock):
    server = ScriptedServer(sock, [["answer", "close"], ["close"]])
    with EngineClient(sock) as client:
        client.get("/health")
        with pytest.raises(RolloutError, match="no engine at"):
            client.get("/health")
    server.stop()
    assert (server.connections, server.requests) == (2, 3)


def test_the_daemon_keeps_idle_connections_longer_than_the_client_does():
    """The other half of the fix: the client drops an idle connection before the daemon would
    close it, so our own client never meets the race at all."""
    assert daemon.KEEP_ALIVE_SECONDS >= 2 * client_module.KEEPALIVE_EXPIRY
