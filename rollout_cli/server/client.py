"""HTTP client of the daemon (httpx): a Unix socket path, or http://host:port with a bearer token."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx

from rollout_cli.errors import RolloutError
from rollout_cli.server.address import ENV_ENGINE, default_socket_path, is_tcp

START_HINT = "start one with rollout serve --model DIR"


def resolve_address(engine: str | None) -> str:
    """--engine, else $ROLLOUT_ENGINE, else the default socket path."""
    return engine or os.environ.get(ENV_ENGINE) or default_socket_path()


class EngineClient:
    def __init__(self, address: str, token_file: str | None = None):
        self.address = address
        headers = {}
        if is_tcp(address):
            if token_file is not None:
                from rollout_cli.server.daemon import read_token

                headers["Authorization"] = f"Bearer {read_token(token_file)}"
            transport, base_url = None, address.rstrip("/")
        else:
            if token_file is not None:
                raise RolloutError("--token-file is for an http://HOST:PORT engine; a socket path needs none")
            if not os.path.exists(address):
                raise RolloutError(f"no engine at {address}; {START_HINT}")
            transport, base_url = httpx.HTTPTransport(uds=address), "http://rollout"
        self._http = httpx.Client(transport=transport, base_url=base_url, headers=headers,
                                  timeout=httpx.Timeout(30.0, read=None))

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

    def _send(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            response = self._http.request(method, path, json=body)
        except (httpx.ConnectError, httpx.RemoteProtocolError, FileNotFoundError, ConnectionRefusedError) as err:
            raise RolloutError(f"no engine at {self.address}; {START_HINT}") from err
        self._check(response)
        return response.json()

    def get(self, path: str) -> dict:
        return self._send("GET", path)

    def post(self, path: str, body: dict | None = None) -> dict:
        return self._send("POST", path, body or {})

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """POST and yield the newline-delimited JSON events of the answer."""
        try:
            with self._http.stream("POST", path, json=body) as response:
                self._check(response)
                for line in response.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError) as err:
            raise RolloutError(f"no engine at {self.address}; {START_HINT}") from err
        except httpx.RemoteProtocolError as err:
            raise RolloutError(f"the engine at {self.address} closed the connection mid-job ({err}); "
                               "check its log, then rerun with --resume") from err
