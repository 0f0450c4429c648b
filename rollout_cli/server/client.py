"""HTTP client of the daemon (httpx): a Unix socket path, or http://host:port with a bearer token."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx

from rollout_cli.errors import EngineUnreachable, RolloutError
from rollout_cli.server.address import ENV_ENGINE, default_socket_path, is_tcp
from rollout_cli.server.daemon import read_token

START_HINT = "start one with rollout serve --model DIR"

# Seconds an idle pooled connection is kept; below the daemon's keep-alive (daemon.KEEP_ALIVE_SECONDS),
# so the daemon never closes a connection this client is about to reuse.
KEEPALIVE_EXPIRY = 5.0

# Raised when a connection ends before any answer: on a reused connection that is the server
# closing it while idle (a keep-alive timeout, another HTTP server in between), so the request was
# never read and is sent once more on a fresh connection, as browsers do.
_CLOSED_UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def resolve_address(engine: str | None) -> str:
    """--engine, else $ROLLOUT_ENGINE, else the default socket path."""
    return engine or os.environ.get(ENV_ENGINE) or default_socket_path()


class EngineClient:
    def __init__(self, address: str, token_file: str | None = None):
        self.address = address
        headers = {}
        if is_tcp(address):
            if token_file is not None:
                headers["Authorization"] = f"Bearer {read_token(token_file)}"
            transport, base_url = None, address.rstrip("/")
        else:
            if token_file is not None:
                raise RolloutError("--token-file is for an http://HOST:PORT engine; a socket path needs none")
            if not os.path.exists(address):
                raise EngineUnreachable(f"no engine at {address}; {START_HINT}")
            # plain HTTP over the socket: verify=False skips loading a CA bundle no TLS uses (~35 ms)
            transport, base_url = httpx.HTTPTransport(uds=address, verify=False), "http://rollout"
        self._http = httpx.Client(transport=transport, base_url=base_url, headers=headers,
                                  timeout=httpx.Timeout(30.0, read=None),
                                  limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY))

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check(self, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            message = json.loads(response.read()).get("error")
        except (ValueError, AttributeError):
            message = None
        if response.status_code == 401:
            raise RolloutError(f"the engine at {self.address} refused the request (401): "
                               "pass --token-file with the token it was started with")
        raise RolloutError(message or f"the engine at {self.address} answered HTTP {response.status_code}")

    def _json(self, body: bytes | str) -> dict:
        """The daemon answers JSON objects; anything else (an HTML page of another HTTP server at that
        address) is a wrong --engine, said in one line rather than a JSONDecodeError."""
        try:
            value = json.loads(body)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            value = None
        if not isinstance(value, dict):
            text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
            raise RolloutError(f"{self.address} answered with something that is not the rollout daemon's JSON "
                               f"({' '.join(text.split())[:80]!r}); is the address a rollout serve daemon?")
        return value

    def _open(self, method: str, path: str, body: dict | None) -> httpx.Response:
        """Send the request and return the response with its body not yet read.

        A reused connection that ends before the answer began is retried once on a new one
        (_CLOSED_UNANSWERED); a new connection that does is a daemon that went away.
        """
        request = self._http.build_request(method, path, json=body)
        for attempt in (1, 2):
            opened = []

            def trace(event: str, info: dict) -> None:
                # httpcore names each new connection (connection.connect_tcp / connect_unix_socket);
                # none for this request means the pool reused an idle one
                if event.startswith("connection.connect_"):
                    opened.append(event)

            request.extensions["trace"] = trace
            try:
                return self._http.send(request, stream=True)
            except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError) as err:
                raise EngineUnreachable(f"no engine at {self.address}; {START_HINT}") from err
            except _CLOSED_UNANSWERED as err:
                if attempt == 1 and not opened:
                    continue
                raise EngineUnreachable(f"no engine at {self.address} (the connection closed before an answer: "
                                   f"{type(err).__name__}); {START_HINT}") from err
        raise AssertionError("unreachable")

    def _send(self, method: str, path: str, body: dict | None = None) -> dict:
        response = self._open(method, path, body)
        try:
            response.read()
        except _CLOSED_UNANSWERED as err:
            raise RolloutError(f"the engine at {self.address} closed the connection mid-answer ({err}); "
                               "check its log") from err
        finally:
            response.close()
        self._check(response)
        return self._json(response.content)

    def get(self, path: str) -> dict:
        return self._send("GET", path)

    def post(self, path: str, body: dict | None = None) -> dict:
        return self._send("POST", path, body or {})

    # ---- weight updates from a trainer process (README: "Weight updates from a trainer") ----

    def update_weights_from_tensor(self, named_tensors, weight_version: str | None = None,
                                   partial: bool = False) -> dict:
        """(name, tensor) pairs, a dict or a FlattenedBucket, passed by handle (CUDA IPC / shared memory):
        the daemon must run on this machine, and the tensors stay alive until this returns."""
        # heavy: torch (clients run in CLI processes)
        from rollout_cli.engine.weights.tensor_ipc import serialize_named_tensors

        return self.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize_named_tensors(named_tensors)],
            "weight_version": weight_version, "partial": partial})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None,
                                  timeout_seconds: float = 600.0) -> dict:
        """Blocks until the trainer (rank 0) joined too: call it in a thread next to the trainer's own join."""
        return self.post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
            "timeout_seconds": timeout_seconds})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", weight_version: str | None = None,
                                        partial: bool = False) -> dict:
        """Blocks until the broadcast arrived: call it in a thread while the trainer broadcasts."""
        return self.post("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": weight_version, "partial": partial})

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self.post("/destroy_weights_update_group", {"group_name": group_name})

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """POST and yield the newline-delimited JSON events of the answer."""
        response = self._open("POST", path, body)
        try:
            self._check(response)
            for line in response.iter_lines():
                if line.strip():
                    yield self._json(line)
        except httpx.RemoteProtocolError as err:
            raise RolloutError(f"the engine at {self.address} closed the connection mid-job ({err}); "
                               "check its log, then rerun with --resume") from err
        finally:
            response.close()
