"""The daemon's HTTP/JSON API (FastAPI). Endpoint names follow SGLang where it has one.

Errors are JSON `{"success": false, "error": "<one line with the fix>"}` with 400 (bad request,
unknown key or refused checkpoint), 401 (TCP without the bearer token), 404 / 405 (no such endpoint
or method), 409 (valid, but not in this state), 413 (body over --max-request-bytes) or 503 (engine
not loaded); http_errors.py shapes those refused before an endpoint runs. /generate streams
newline-delimited JSON events.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from dataclasses import fields
from typing import Callable, Literal, Optional, Union, get_type_hints

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.episodes import DEFAULT_MAX_TURNS
from rollout_cli.errors import Conflict, RolloutError
from rollout_cli.job import JobConfig
from rollout_cli.server import http_errors
from rollout_cli.server.address import DEFAULT_MAX_REQUEST_BYTES
from rollout_cli.server.http_errors import clip
from rollout_cli.server.openai_api import register_openai_routes
from rollout_cli.server.worker import EngineWorker

log = logging.getLogger("rollout.serve")


class _Body(BaseModel):
    """A request body: a key it does not name is refused (a typo such as `tempreature` must not
    silently run with the default), with the nearest valid key (http_errors.invalid_body)."""

    model_config = ConfigDict(extra="forbid")


# Strings the engine stores or echoes are bounded, so no error message or manifest repeats a
# megabyte: paths by Linux's PATH_MAX, names and versions by a generous 256.
PATH_CHARS = 4096
NAME_CHARS = 256

# The request body mirrors SamplingParams field for field (values are checked when the
# SamplingParams is built, with its one-line errors).
_SAMPLING_HINTS = get_type_hints(SamplingParams)
SamplingRequest = create_model(
    "SamplingRequest", __base__=_Body,
    **{f.name: (_SAMPLING_HINTS[f.name], f.default) for f in fields(SamplingParams)},
)


class EmptyRequest(_Body):
    """Endpoints that take no parameters: `{}` or no body."""


class GenerateRequest(_Body):
    data: str = Field(max_length=PATH_CHARS, description="Prompt Parquet file, an absolute path on the engine's machine.")
    out: str = Field(max_length=PATH_CHARS, description="Output directory, an absolute path on the engine's machine.")
    sampling_params: SamplingRequest = SamplingRequest()
    prompt_key: str = Field("prompt", max_length=NAME_CHARS)
    image_key: Optional[str] = Field(None, max_length=NAME_CHARS,
                                     description="rollout run --image-key: the column of the rows' images.")
    limit: Optional[int] = None
    resume: bool = False
    continue_aborted: bool = False
    skip_invalid: bool = False
    shard_rows: int = 1024
    flush_seconds: float = 10.0
    capture_routing: bool = False
    env: Optional[str] = Field(None, max_length=PATH_CHARS,
                               description="rollout run --env: an environment file (absolute path), run on the engine.")
    max_turns: int = DEFAULT_MAX_TURNS


class UpdateWeightsRequest(_Body):
    model_path: str = Field(max_length=PATH_CHARS, description="Checkpoint directory with *.safetensors, absolute.")
    weight_version: Optional[str] = Field(None, max_length=NAME_CHARS,
                                          description="New version; default: the current one plus 1.")


class TensorUpdateRequest(_Body):
    serialized_named_tensors: Union[str, list[str]] = Field(
        description="tensor_ipc.serialize_named_tensors text (as SGLang: a list with one entry per engine rank; one here).")
    weight_version: Optional[str] = Field(None, max_length=NAME_CHARS,
                                          description="New version; default: the current one plus 1.")
    partial: bool = Field(False, description="Accept a subset of the model's tensors; by default all are required.")


class InitGroupRequest(_Body):
    master_address: str = Field(max_length=NAME_CHARS)
    master_port: int
    rank_offset: int = Field(description="The engine's rank in the group; the trainer is rank 0.")
    world_size: int
    group_name: str = Field("weight_update_group", max_length=NAME_CHARS)
    backend: Optional[Literal["nccl", "gloo"]] = Field(None, description="Default: nccl on CUDA, gloo on the CPU.")
    timeout_seconds: float = 600.0


class DistributedUpdateRequest(_Body):
    names: list[str]
    dtypes: list[str] = Field(description="torch dtype names (bfloat16, float32, ...), one per name.")
    shapes: list[list[int]]
    group_name: str = Field("weight_update_group", max_length=NAME_CHARS)
    weight_version: Optional[str] = Field(None, max_length=NAME_CHARS)
    partial: bool = False


class DestroyGroupRequest(_Body):
    group_name: str = Field("weight_update_group", max_length=NAME_CHARS)


class MemoryRequest(_Body):
    tags: Optional[list[str]] = Field(None, description="weights, kv_cache, cuda_graph; default all.")


class AbortRequest(_Body):
    request_id: Optional[str] = Field(None, max_length=NAME_CHARS,
                                      description="One online request (its id); default: the job and every online request.")


class SessionRequest(_Body):
    session_id: str = Field(max_length=NAME_CHARS)


class PauseRequest(_Body):
    mode: Literal["abort", "wait", "keep", "finish"] = "wait"


_error = http_errors.engine_error


def create_app(worker: EngineWorker, token: str | None, request_exit: Callable[[], None],
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, served_model_name: str | None = None) -> FastAPI:
    app = FastAPI(title="rollout engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(RequestValidationError, http_errors.invalid_body)
    app.add_exception_handler(HTTPException, http_errors.http_error)  # 404, 405, unparsable body, 413
    app.add_middleware(http_errors.BodyLimit, limit=max_request_bytes)

    @app.middleware("http")  # added last, so it runs first: no token, no body read
    async def bearer_token(request: Request, call_next):
        if token is not None:
            header = request.headers.get("authorization", "")
            given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), token.encode()):
                client = request.client.host if request.client else "?"
                log.warning("refused %s %s from %s: %s bearer token", request.method, request.url.path, client,
                            "wrong" if given else "no")
                return _error(401, "missing or wrong bearer token; pass --token-file with the engine's token (the "
                                   "openai client: api_key=<the token>)", path=request.url.path)
        return await call_next(request)

    async def call(name: str, **args):
        """Run a command on the engine thread and wait for its answer."""
        if not worker.ready.is_set():
            return _error(503, "the engine is still loading; retry in a moment")
        try:
            return await asyncio.wrap_future(worker.submit(name, **args))
        except Conflict as err:
            return _error(409, str(err))
        except RolloutError as err:
            return _error(400, str(err))

    @app.get("/health")
    async def health():
        if worker.load_error is not None:
            return _error(503, f"the engine failed to load: {worker.load_error}")
        if not worker.ready.is_set():
            return _error(503, "the engine is still loading")
        return {"status": "ok"}

    @app.get("/get_server_info")
    async def get_server_info():
        return worker.snapshot()

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": worker.snapshot()["weight_version"]}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsRequest):
        if not os.path.isabs(body.model_path):
            return _error(400, f"model_path {clip(body.model_path)} must be absolute "
                               "(the engine has its own working directory)")
        return await call("update_weights", path=body.model_path, version=body.weight_version)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: TensorUpdateRequest):
        payloads = body.serialized_named_tensors
        payloads = [payloads] if isinstance(payloads, str) else payloads
        if len(payloads) != 1:
            return _error(400, f"serialized_named_tensors has {len(payloads)} entries; this engine is one rank: send one")
        return await call("update_weights_from_tensor", serialized=payloads[0], version=body.weight_version,
                          partial=body.partial)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroupRequest):
        return await call("init_weights_update_group", **body.model_dump())

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: DistributedUpdateRequest):
        return await call("update_weights_from_distributed", names=body.names, dtypes=body.dtypes, shapes=body.shapes,
                          group_name=body.group_name, version=body.weight_version, partial=body.partial)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyGroupRequest = DestroyGroupRequest()):
        return await call("destroy_weights_update_group", group_name=body.group_name)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(body: MemoryRequest = MemoryRequest()):
        return await call("release_memory", tags=body.tags)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(body: MemoryRequest = MemoryRequest()):
        return await call("resume_memory", tags=body.tags)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(body: EmptyRequest = EmptyRequest()):
        return await call("flush_cache")

    @app.post("/pause_generation")
    async def pause_generation(body: PauseRequest = PauseRequest()):
        return await call("pause", mode=body.mode)

    @app.post("/continue_generation")
    async def continue_generation(body: EmptyRequest = EmptyRequest()):
        return await call("continue")

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest = AbortRequest()):
        return await call("abort", request_id=body.request_id)

    @app.post("/close_session")
    async def close_session(body: SessionRequest):
        return await call("close_session", session_id=body.session_id)

    @app.post("/shutdown")
    async def shutdown(body: EmptyRequest = EmptyRequest()):
        if worker.ready.is_set() and worker.is_alive():
            result = await asyncio.wrap_future(worker.submit("shutdown"))
        else:
            result = {"success": True, "aborted": 0}
        # Exit after this answer went out; the job (if any) was aborted and its rows written.
        return JSONResponse(result, background=BackgroundTask(request_exit))

    @app.post("/generate")
    async def generate(body: GenerateRequest):
        for name in ("data", "out", "env"):
            path = getattr(body, name)
            if path is not None and not os.path.isabs(path):
                return _error(400, f"{name} {clip(path)} must be absolute (the engine has its own working directory)")
        if not worker.ready.is_set():
            return _error(503, "the engine is still loading; retry in a moment")
        try:
            params = SamplingParams(**body.sampling_params.model_dump())
            job = JobConfig(data=body.data, out=body.out, prompt_key=body.prompt_key, image_key=body.image_key,
                            limit=body.limit, resume=body.resume, continue_aborted=body.continue_aborted,
                            skip_invalid=body.skip_invalid, shard_rows=body.shard_rows,
                            flush_seconds=body.flush_seconds, capture_routing=body.capture_routing,
                            env=body.env, max_turns=body.max_turns)
            handle = worker.submit_job(job, params)
        except Conflict as err:
            return _error(409, str(err))
        except RolloutError as err:
            return _error(400, str(err))

        async def events():
            seen = -1
            while True:
                if handle.seq != seen:
                    seen = handle.seq
                    if handle.done.is_set():
                        yield json.dumps(handle.outcome) + "\n"
                        return
                    if handle.progress:
                        yield json.dumps({"event": "progress", **handle.progress}) + "\n"
                await asyncio.sleep(0.05)

        return StreamingResponse(events(), media_type="application/x-ndjson")

    register_openai_routes(app, worker, served_model_name or worker.engine_config.model)
    return app
