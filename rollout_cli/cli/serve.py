"""`rollout serve`: a long-lived engine daemon that the client commands talk to."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer

from rollout_cli.cli import options as opt
from rollout_cli.cli.errors import fail, say
from rollout_cli.cli.rank_failure import closing_files, rank_failures
from rollout_cli.cli.tensor_parallel_run import follow_leader, is_rank, launch_ranks, rank_config
from rollout_cli.engine.scheduling.sessions import DEFAULT_RETENTION_SECONDS
from rollout_cli.errors import RolloutError
from rollout_cli.server.address import DEFAULT_MAX_REQUEST_BYTES, default_socket_path, socket_is_live
from rollout_cli.server.daemon import serve

LISTEN = "Listen"


@opt.with_engine_options()
def serve_command(
    model: opt.Model,
    socket: Annotated[Optional[str], typer.Option(help="Unix socket path (mode 0600); default $XDG_RUNTIME_DIR/rollout.sock or /tmp/rollout-$USER.sock.", rich_help_panel=LISTEN)] = None,
    host: Annotated[Optional[str], typer.Option(help="Listen on TCP at this host instead of a socket (needs --port and --token-file); default 127.0.0.1 when --port is given.", rich_help_panel=LISTEN)] = None,
    port: Annotated[Optional[int], typer.Option(help="Listen on TCP at this port instead of a socket (needs --token-file).", rich_help_panel=LISTEN)] = None,
    token_file: Annotated[Optional[str], typer.Option(help="TCP: file with the bearer token every request must carry.", rich_help_panel=LISTEN)] = None,
    max_request_bytes: Annotated[int, typer.Option(help="Largest request body; larger ones get 413 before they are read. 64 MiB holds the tensor handles of an unbucketed update of ~190,000 tensors.", rich_help_panel=LISTEN)] = DEFAULT_MAX_REQUEST_BYTES,
    served_model_name: Annotated[Optional[str], typer.Option(help="The model name of the OpenAI API (/v1/models, and the `model` requests give); default the --model argument.", rich_help_panel=LISTEN)] = None,
    session_retention_seconds: Annotated[float, typer.Option(help="How long a multi-turn session (session_id of the OpenAI API) keeps its conversation's KV pinned after its last turn.", rich_help_panel=LISTEN)] = DEFAULT_RETENTION_SECONDS,
    weights_cpu_backup: Annotated[bool, typer.Option("--weights-cpu-backup", help="Keep a host copy of the weights while release-memory has freed them, so resume-memory restores them (else reload weights after resuming).", rich_help_panel=opt.ENGINE)] = False,
    tp: Annotated[int, typer.Option(help="Tensor parallel: split the model over N GPUs (N processes on the CPU), as `rollout run --tp`; rank 0 serves, the other ranks follow its steps, reloads and memory releases.", rich_help_panel=opt.ENGINE)] = 1,
    engine_options: Optional[dict] = None,  # filled by with_engine_options
) -> None:
    """Load a model once and serve generation jobs and weight reloads until rollout shutdown.

    Example:

        rollout serve --model recipes/example_model &
        rollout run --data recipes/prompts.parquet --out traj/ --n 4
        rollout reload-weights ckpt_1/
        rollout shutdown

    One model over 2 GPUs: rollout serve --model ckpt/ --tp 2 &
    """
    from rollout_cli.models.build import load_model_config  # heavy: torch

    try:
        with rank_failures():  # a no-op in the command typed; in a rank, inside: it sees the RolloutError
            _check_port(port)  # before the model loads and --tp starts ranks
            engine_config = dataclasses.replace(opt.engine_config(model=model, **engine_options),
                                                weights_cpu_backup=weights_cpu_backup)
            hf_config = load_model_config(engine_config.model)  # a bad --model fails here, before the socket is claimed
            if host is None and port is None and socket is None:
                socket = default_socket_path()
            if tp != 1:
                engine_config = _tensor_parallel_rank(engine_config, hf_config, tp, socket)
                if engine_config is None:
                    raise typer.Exit(0)  # a follower: rank 0 served and stopped it
            with closing_files():  # rank 0 of --tp: a follower's failure leaves the daemon's jobs to close first
                code = serve(engine_config, socket, host, port, token_file, max_request_bytes=max_request_bytes,
                             served_model_name=served_model_name,
                             session_retention_seconds=session_retention_seconds,
                             say_load_error=say if tp != 1 else None)
            # in rank_failures: a daemon that failed (its engine did not load: said already) ends the followers
            raise typer.Exit(code)
    except RolloutError as err:
        fail(str(err))


def _check_port(port: int | None) -> None:
    """A port outside 0..65535 would reach bind() only to fail there with an OverflowError."""
    if port is not None and not 0 <= port <= 65535:
        raise RolloutError(f"--port {port} is not a TCP port; give one in 0..65535 (0: any free port)")


def _tensor_parallel_rank(engine_config, hf_config, tp: int, socket: str | None):
    """--tp N: in the command typed, check and start the ranks (exits: 0 after a shutdown, SIGINT or
    SIGTERM); in a rank, rank 0's engine config, or None on a follower once rank 0 stopped it."""
    from rollout_cli.models.tensor_parallel_support import check_tensor_parallel  # heavy: torch

    if tp < 1:
        raise RolloutError("--tp must be >= 1")
    if not is_rank():
        check_tensor_parallel(hf_config, tp)
        if socket is not None and socket_is_live(socket):
            raise RolloutError(f"an engine is already serving on {socket}; stop it with "
                               f"rollout shutdown --engine {socket}, or pass another --socket")
        launch_ranks(tp, "serve", engine_config, signal_exit_code=0)
    engine_config, rank = rank_config(engine_config, tp, "serve")
    if rank != 0:
        follow_leader(engine_config, daemon=True)
        return None
    return engine_config
