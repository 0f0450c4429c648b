"""Client commands of a running daemon: reload-weights, release-memory, resume-memory, pause, continue, abort,
flush-cache, status, shutdown."""

from __future__ import annotations

import json
import os
import time
from typing import Annotated, Optional

import typer

from rollout_cli.cli import options as opt
from rollout_cli.cli.errors import user_errors
from rollout_cli.errors import EngineUnreachable, RolloutError
from rollout_cli.models.hub import resolve_model
from rollout_cli.server.address import is_tcp


def _client(engine: str | None, token_file: str | None):
    from rollout_cli.server.client import EngineClient, resolve_address  # httpx: only a call to a daemon needs it

    return EngineClient(resolve_address(engine), token_file)


def _call(engine, token_file, method: str, path: str, body: dict | None = None) -> dict:
    with user_errors(), _client(engine, token_file) as client:
        return client.get(path) if method == "GET" else client.post(path, body)


def reload_weights_command(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint directory with *.safetensors of the served architecture, or a hub id (fetched into the Hugging Face cache here).")],
    version: Annotated[Optional[str], typer.Option(help="New weight version; default: the current one plus 1.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub ids: branch, tag or commit to load; default main.")] = None,
    engine: opt.EngineAddress = None,
    token_file: opt.TokenFile = None,
) -> None:
    """Load new weights into the running engine after checking every tensor's name, shape and dtype.

    A bad checkpoint is refused with the reason and the engine keeps its weights and version.
    Refused while a job runs. Example:

        rollout reload-weights ckpt_1/ --version 1
    """
    with user_errors():
        # a hub id is fetched on this machine; the daemon reads its snapshot directory, whose name is the
        # commit (status and the manifests' weights source show it)
        path = resolve_model(checkpoint, revision, what="CHECKPOINT").path
    result = _call(engine, token_file, "POST", "/update_weights_from_disk",
                   {"model_path": os.path.abspath(path), "weight_version": version})
    typer.echo(f"weight version {result['previous_weight_version']} -> {result['weight_version']} "
               f"({result['seconds']:.2f} s)")


def pause_command(
    mode: Annotated[str, typer.Option(help="wait: hold the running job between steps, its requests kept, weight "
                                           "updates refused; keep: hold it and accept weight updates (its running "
                                           "samples recompute on the new weights and record each token's version); finish: "
                                           "start no new sample, return once the running ones finished, then hold and "
                                           "accept weight updates; abort: end it now (unfinished samples written with finish_reason abort).")] = "wait",
    engine: opt.EngineAddress = None,
    token_file: opt.TokenFile = None,
) -> None:
    """Pause generation until rollout continue; new jobs are refused meanwhile.

    Example:

        rollout pause --mode abort
        rollout pause --mode keep && rollout reload-weights ckpt_8/ && rollout continue
    """
    result = _call(engine, token_file, "POST", "/pause_generation", {"mode": mode})
    typer.echo(f"paused ({mode})" + (f"; {result['aborted']} samples aborted" if result.get("aborted") else ""))


def continue_command(engine: opt.EngineAddress = None, token_file: opt.TokenFile = None) -> None:
    """Resume generation after rollout pause.

    Example:

        rollout continue
    """
    _call(engine, token_file, "POST", "/continue_generation")
    typer.echo("serving")


def abort_command(
    engine: opt.EngineAddress = None, token_file: opt.TokenFile = None,
    request_id: Annotated[Optional[str], typer.Option(help="Abort only this online request (the id of its OpenAI response, or the request_id it was given).")] = None,
) -> None:
    """End the running job (its unfinished samples are written with finish_reason abort) and every
    online request (each returns its tokens so far), or one online request with --request-id.

    Example:

        rollout abort
        rollout abort --request-id cmpl-3f2a...
    """
    result = _call(engine, token_file, "POST", "/abort_request", {"request_id": request_id} if request_id else None)
    if result["job_aborted"]:
        typer.echo(f"aborted {result['aborted']} samples")
    elif result["aborted"]:
        typer.echo(f"aborted {result['aborted']} online samples")
    else:
        typer.echo("nothing was running" if request_id is None else f"no request {request_id} in flight")


MemoryTags = Annotated[Optional[str], typer.Option(
    help="Comma-separated: weights, kv_cache, cuda_graph; default all.")]


def _tag_list(tags: str | None) -> list[str] | None:
    """--tags as the list the daemon takes; None (no --tags) is every tag. An empty value ('', ','; an unset
    variable in a script) is refused: the daemon reads an empty list as every tag, and releasing the weights
    without --weights-cpu-backup leaves them to be reloaded."""
    if tags is None:
        return None
    names = [tag for tag in tags.split(",") if tag.strip()]
    if not names:
        with user_errors():
            raise RolloutError(f"--tags {tags!r} names no tag; give some of weights, kv_cache, cuda_graph "
                               "(comma-separated), or drop --tags for all of them")
    return names


def _gib(value) -> str:
    return "?" if value is None else f"{value / 2**30:.1f} GiB"


def release_memory_command(tags: MemoryTags = None, engine: opt.EngineAddress = None,
                           token_file: opt.TokenFile = None) -> None:
    """Free the engine's GPU memory for a trainer; returns once the memory is free.

    Refused while a job runs (rollout pause --mode abort or rollout abort first). Without
    serve --weights-cpu-backup the weights must be reloaded after resume-memory. Example:

        rollout release-memory && python train.py && rollout resume-memory && rollout reload-weights ckpt_1/
    """
    result = _call(engine, token_file, "POST", "/release_memory_occupation",
                   {"tags": _tag_list(tags)})
    what = ", ".join(result["released"]) or "nothing (already released)"
    line = f"released {what} in {result['seconds']:.2f} s"
    if result.get("free_bytes_after") is not None:  # None on the CPU: no device memory to report
        line += f"; device free {_gib(result['free_bytes_after'])}"
    typer.echo(line)


def resume_memory_command(tags: MemoryTags = None, engine: opt.EngineAddress = None,
                          token_file: opt.TokenFile = None) -> None:
    """Take back the memory released by rollout release-memory.

    Example:

        rollout resume-memory
    """
    result = _call(engine, token_file, "POST", "/resume_memory_occupation",
                   {"tags": _tag_list(tags)})
    what = ", ".join(result["resumed"]) or "nothing (none was released)"
    line = f"resumed {what} in {result['seconds']:.2f} s"
    if result.get("cuda_graph_capture_seconds") is not None:
        line += f" (CUDA graphs re-captured in {result['cuda_graph_capture_seconds']:.2f} s)"
    if result.get("weights_stale"):
        line += "; weights must be reloaded before the next run (rollout reload-weights CKPT_DIR)"
    typer.echo(line)


def flush_cache_command(engine: opt.EngineAddress = None, token_file: opt.TokenFile = None) -> None:
    """Drop the engine's prefix cache (refused while a job runs).

    Example:

        rollout flush-cache
    """
    _call(engine, token_file, "POST", "/flush_cache")
    typer.echo("prefix cache flushed")


def _wait_until_serving(engine, token_file, seconds: float) -> dict:
    """The server info once the daemon answers in a state other than loading (a daemon just started has
    no socket yet, then loads its weights); one line and exit 1 when `seconds` run out first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with _client(engine, token_file) as client:
                info = client.get("/get_server_info")
            if info.get("state") != "loading":
                return info
            last = "it was still loading"
        except EngineUnreachable as err:  # not a wrong token or another server there: waiting would not help those
            last = str(err)
        left = deadline - time.monotonic()
        if left <= 0:
            raise RolloutError(f"the engine did not serve within {seconds:g} s; {last}")
        time.sleep(min(0.5, left))


def status_command(
    engine: opt.EngineAddress = None,
    token_file: opt.TokenFile = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the server info as JSON.")] = False,
    wait: Annotated[Optional[float], typer.Option(
        help="Wait up to this many seconds for the engine to serve (a daemon just started answers once its "
             "socket is up, and reports state loading until its weights are in); exit 1 if it does not.")] = None,
) -> None:
    """Model, weight version, state (loading / serving / paused / released), memory held and job progress.

    Example:

        rollout serve --model ckpt/ & rollout status --wait 600 && rollout run --engine ...
    """
    if wait is not None:
        with user_errors():
            if not wait >= 0:  # NaN too
                raise RolloutError(f"--wait must be a number of seconds, 0 or more (got {wait:g})")
            info = _wait_until_serving(engine, token_file, wait)
    else:
        info = _call(engine, token_file, "GET", "/get_server_info")
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    memory = info.get("memory") or {}
    lines = [
        f"model           {info['model']}",
        f"weights         {info['weights_path']}",
        f"weight version  {info['weight_version']}",
        f"state           {info['state']}",
    ]
    if info.get("tensor_parallel", 1) > 1:
        lines.append(f"tensor parallel {info['tensor_parallel']} ranks (memory below: rank 0's)")
    if memory:
        held = memory["weights_bytes"] + memory["kv_cache_bytes"]
        line = (f"memory held     {held / 2**20:.1f} MiB on {memory['device']} "
                f"(weights {memory['weights_bytes'] / 2**20:.1f}, KV cache {memory['kv_cache_bytes'] / 2**20:.1f})")
        if memory.get("device_free_bytes") is not None:
            line += f"; device free {_gib(memory['device_free_bytes'])} of {_gib(memory['device_total_bytes'])}"
        lines.append(line)
        if memory.get("released"):
            lines.append(f"released        {', '.join(memory['released'])}")
        if memory.get("weights_stale"):
            lines.append("weights         stale: reload weights before the next run")
    job = info.get("job")
    if job:
        lines.append(f"job             {job['data']} -> {job['out']}: prompts {job.get('prompts_done', 0)}/"
                     f"{job.get('prompts_total', '?')}, {job.get('trajectories', 0)} trajectories, "
                     f"{job.get('output_tokens_per_s', 0):.0f} out tok/s")
    else:
        lines.append("job             none")
    lines.append(f"online requests {info.get('online_requests', 0)} in flight, {info.get('sessions', 0)} sessions open")
    typer.echo("\n".join(lines))


def shutdown_command(engine: opt.EngineAddress = None, token_file: opt.TokenFile = None) -> None:
    """Stop the engine (a running job is aborted first; its finished rows are kept).

    Example:

        rollout shutdown
    """
    from rollout_cli.server.client import resolve_address  # httpx: only a call to a daemon needs it

    _call(engine, token_file, "POST", "/shutdown")
    address = resolve_address(engine)
    if not is_tcp(address):  # return once the engine is gone: it removes its socket last
        deadline = time.monotonic() + 60
        while os.path.exists(address) and time.monotonic() < deadline:
            time.sleep(0.1)
    typer.echo("engine stopped")
