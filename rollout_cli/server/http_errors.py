"""The daemon's answers to requests it refuses before an endpoint runs: every one is the documented
`{"success": false, "error": "<one line>"}`, never FastAPI's `{"detail": ...}`.

- unknown keys in a body (at any depth) -> 400 naming the nearest valid key;
- a body that is not JSON, not an object, or holds wrong types -> 400;
- no such endpoint -> 404, wrong method -> 405;
- a body over --max-request-bytes -> 413, refused before it was read whole.

A value the client sent is echoed as a short prefix only (`clip`): the error of a 100 MB value
must not be 100 MB.
"""

from __future__ import annotations

import difflib
import typing

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.requests import Request

ECHO_CHARS = 80  # the most of a client's value an error message repeats
MAX_PROBLEMS = 3  # problems of one body named in its error line


def clip(value, limit: int = ECHO_CHARS, quote: bool = True) -> str:
    """The value (repr'd when `quote`) cut to `limit` characters, saying how long it was."""
    text = value if isinstance(value, str) else str(value)
    shown = text[:limit]
    shown = repr(shown) if quote else shown
    return shown if len(text) <= limit else f"{shown}... ({len(text):,} chars)"


MESSAGE_CHARS = 1000  # the engine's messages are one line; anything longer is a value echoed back


OPENAI_PREFIX = "/v1/"  # the OpenAI-compatible routes answer errors in OpenAI's shape
OPENAI_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                      405: "BadRequestError", 409: "ConflictError", 413: "BadRequestError",
                      500: "InternalServerError", 503: "ServiceUnavailableError"}


def engine_error(status: int, message: str, path: str = "") -> JSONResponse:
    """An endpoint's refusal: the engine's one-line message (clipped if it echoes a long value)."""
    if len(message) > MESSAGE_CHARS:
        message = f"{message[:MESSAGE_CHARS]}... ({len(message):,} chars)"
    return error_response(status, message, path=path)


def error_response(status: int, message: str, headers: dict | None = None, path: str = "") -> JSONResponse:
    """`{"success": false, "error": "<line>"}`; under /v1/ OpenAI's `{"error": {"message": ..., ...}}`,
    which the openai client shows in its exception."""
    if path.startswith(OPENAI_PREFIX):
        body = {"error": {"message": message, "type": OPENAI_ERROR_TYPES.get(status, "APIError"), "param": None,
                          "code": status}}
    else:
        body = {"success": False, "error": message}
    return JSONResponse(body, status_code=status, headers=headers)


# ---- 400: the body does not fit the endpoint's request model ----

def _submodel(annotation) -> type[BaseModel] | None:
    """The pydantic model inside Optional[...] / list[...] / a model itself, else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _model_at(model: type[BaseModel] | None, path: tuple) -> type[BaseModel] | None:
    """The model that holds the last key of `path` (list indices are stepped over)."""
    for key in path[:-1]:
        if model is None:
            return None
        if isinstance(key, int):
            continue
        field = model.model_fields.get(key)
        model = _submodel(field.annotation) if field is not None else None
    return model


def _unknown_key(model: type[BaseModel] | None, path: tuple) -> str:
    message = f"unknown key {clip('.'.join(str(p) for p in path), quote=False)}"
    parent = _model_at(model, path)
    if parent is None:
        return message
    names = sorted(parent.model_fields)
    if not names:
        return f"{message}; this endpoint takes no parameters: send {{}} or no body"
    key = str(path[-1])
    close = difflib.get_close_matches(key, names, n=1) if len(key) <= 2 * ECHO_CHARS else []
    if close:
        return f"{message}; did you mean {close[0]}?"
    return f"{message}{_VALID_KEYS}{', '.join(names)}"


_VALID_KEYS = "; valid keys: "


def _once(problems: list[str]) -> list[str]:
    """The problems with each list of valid keys given once: three unknown keys name the valid ones once."""
    out, listed = [], set()
    for problem in problems:
        head, sep, keys = problem.partition(_VALID_KEYS)
        out.append(head if sep and keys in listed else problem)
        listed.add(keys)
    return out


def _problem(model: type[BaseModel] | None, error: dict) -> str:
    path = tuple(error["loc"][1:])  # loc[0] is "body"
    kind = error["type"]
    if kind == "extra_forbidden":
        return _unknown_key(model, path)
    if kind == "json_invalid":
        return f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')}); send a JSON object"
    if not path and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "the body must be a JSON object (Content-Type: application/json)"
    where = clip(".".join(str(p) for p in path), quote=False) or "body"
    # pydantic's messages name the expected type or range, not the input; clipped all the same
    return f"{where}: {clip(error['msg'], 2 * ECHO_CHARS, quote=False)}"


def _body_model(request: Request) -> type[BaseModel] | None:
    route = request.scope.get("route")
    body_field = getattr(route, "body_field", None)
    return _submodel(body_field.field_info.annotation) if body_field is not None else None


async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    model = _body_model(request)
    problems = list(dict.fromkeys(_problem(model, e) for e in exc.errors()))
    shown = "; ".join(_once(problems[:MAX_PROBLEMS]))
    if len(problems) > MAX_PROBLEMS:  # a body of 10,000 bad keys gets a line, not 10,000
        shown += f"; and {len(problems) - MAX_PROBLEMS:,} more"
    return error_response(400, f"invalid request to {request.url.path}: {shown}", path=request.url.path)


# ---- 404 / 405 / other HTTP errors raised by the router or FastAPI ----

def _endpoints(request: Request) -> list[str]:
    return sorted({getattr(r, "path", "") for r in request.app.routes} - {""})


async def http_error(request: Request, exc) -> JSONResponse:
    path = request.url.path
    if exc.status_code == 404:
        message = f"no endpoint {clip(path)}"
        close = difflib.get_close_matches(path, _endpoints(request), n=1) if len(path) <= 2 * ECHO_CHARS else []
        message += f"; did you mean {close[0]}?" if close else f"; endpoints: {', '.join(_endpoints(request))}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "another method")
        message = f"{path} does not take {request.method}; use {allowed}"
    elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        message = f"invalid request to {path}: the body is not UTF-8 JSON; send a JSON object"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, headers=exc.headers, path=path)


# ---- 413: the body limit ----

def _too_large(size: str, limit: int) -> str:
    return (f"request body of {size} bytes exceeds the daemon's limit of {limit:,} bytes; send tensors as "
            "handles (serialize_named_tensors of one flattened bucket), or restart serve with a larger "
            "--max-request-bytes")


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes, before it is read whole.

    A Content-Length over the limit is refused before one byte of the body is read; a chunked
    body (no Content-Length) is counted as it arrives and refused at the first chunk past the
    limit. uvicorn then reads and drops the rest of that body without buffering it, and the
    connection stays open, so a client still sending its body gets the 413 rather than a reset.
    """

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            response = error_response(413, _too_large(f"{int(declared):,}", self.limit), path=scope.get("path", ""))
            return await response(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI passes an HTTPException from reading the body on to http_error
                    raise HTTPException(413, _too_large(f"more than {self.limit:,}", self.limit))
            return message

        await self.app(scope, counted, send)
