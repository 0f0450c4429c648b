"""`rollout serve`: a long-lived engine daemon that the client commands talk to."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from rollout_cli.cli import options as opt
from rollout_cli.cli.errors import fail

LISTEN = "Listen"


@opt.with_engine_options()
def serve_command(
    model: opt.Model,
    socket: Annotated[Optional[str], typer.Option(help="Unix socket path (mode 0600); default $XDG_RUNTIME_DIR/rollout.sock or /tmp/rollout-$USER.sock.", rich_help_panel=LISTEN)] = None,
    host: Annotated[Optional[str], typer.Option(help="Listen on TCP at this host instead of a socket (needs --port and --token-file).", rich_help_panel=LISTEN)] = None,
    port: Annotated[Optional[int], typer.Option(help="TCP port (with --host, default 127.0.0.1).", rich_help_panel=LISTEN)] = None,
    token_file: Annotated[Optional[str], typer.Option(help="TCP: file with the bearer token every request must carry.", rich_help_panel=LISTEN)] = None,
    weights_cpu_backup: Annotated[bool, typer.Option("--weights-cpu-backup", help="Keep a host copy of the weights while release-memory has freed them, so resume-memory restores them (else reload weights after resuming).", rich_help_panel=opt.ENGINE)] = False,
    engine_options: Optional[dict] = None,  # filled by with_engine_options
) -> None:
    """Load a model once and serve generation jobs and weight reloads until rollout shutdown.

    Example:

        rollout serve --model recipes/example_model &
        rollout run --data recipes/prompts.parquet --out traj/ --n 4
        rollout reload-weights ckpt_1/
        rollout shutdown
    """
    from rollout_cli.errors import RolloutError
    from rollout_cli.server.address import default_socket_path
    from rollout_cli.server.daemon import serve

    try:
        import dataclasses

        engine_config = dataclasses.replace(opt.engine_config(model=model, **engine_options),
                                            weights_cpu_backup=weights_cpu_backup)
        from rollout_cli.models.build import load_model_config

        load_model_config(model)  # a bad --model fails here, before the socket is claimed
        if host is None and port is None and socket is None:
            socket = default_socket_path()
        code = serve(engine_config, socket, host, port, token_file)
    except RolloutError as err:
        fail(str(err))
    raise typer.Exit(code)
