"""`--tp N` for run, bench and serve: one engine split over N processes (rollout_cli.engine.tensor_parallel).

The command re-starts itself as N ranks under torch.distributed.run, as `--dp` does; rank 0 does the
command's work (the job with its progress bar, the benchmark and its report, the daemon) and the
other ranks build their shards of the engine and follow rank 0's steps and control operations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys

import typer
from rich.console import Console

from rollout_cli.cli import options as opt
from rollout_cli.cli.display import RunProgressBar, run_summary_table
from rollout_cli.cli.embedded_run import load_engine
from rollout_cli.cli.errors import user_errors
from rollout_cli.cli.rank_failure import closing_files, exit_process, rank_failures, watching
from rollout_cli.data_parallel import ReplicaGroup, launch_replicas, replica_device
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.errors import RolloutError
from rollout_cli.models.hub import pinned_argv
from rollout_cli.process_gc import freeze_long_lived_objects


def is_rank() -> bool:
    """Whether this process is one of the ranks torch.distributed.run started (else: the command typed)."""
    return "RANK" in os.environ


def launch_ranks(tp: int, command: str, config, signal_exit_code: int | None = None) -> None:
    """The command the user typed, its inputs checked: run it again as `tp` ranks; exits with their code
    (`signal_exit_code`, if given, after SIGINT / SIGTERM: a daemon's normal way out). A hub id in
    `config` (the engine config resolved here) is pinned to its commit in every rank."""
    code = launch_replicas(tp, pinned_argv(sys.argv[2:], config), what="tensor-parallel rank", command=command)
    if signal_exit_code is not None and code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        code = signal_exit_code
    raise typer.Exit(code)


def rank_config(config, tp: int, command: str | None = None):
    """(this rank's engine config: --tp and its device, rank) inside a process torch.distributed.run started.
    `command` (bench, serve) runs one engine: a world of more than `tp` processes is refused."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if command is not None and world != tp:
        raise RolloutError(f"{command} --tp {tp} runs one engine: start {tp} processes, not {world} "
                           f"(several engines: `rollout run --tp {tp} --dp M`)")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = replica_device(config.device, ReplicaGroup(rank, tp, local_rank))
    return dataclasses.replace(config, tensor_parallel_size=tp, device=device), rank


def follow_leader(config, daemon: bool = False) -> None:
    """A rank other than 0: build its shard of the engine, then follow rank 0 until it sends stop.

    SIGINT and SIGTERM (torchrun passes them to every rank) are left to rank 0, which ends the job (and a
    daemon's clients) and then stops the followers: under a daemon (serve), and wherever rank_failures
    watches (the follower leaves on rank 0's claim; rank_failure's docstring). On an error under
    rank_failures the follower leaves with no collective: rank 0 may be gone, or waiting in the forward's
    all-reduce for this rank."""
    # heavy: torch and the model code
    from rollout_cli.engine.engine import Engine
    from rollout_cli.engine.tensor_parallel import follow

    if daemon or watching():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    engine = None
    try:
        engine = Engine(config)
        freeze_long_lived_objects()
        follow(engine)
    except BaseException:
        if not watching():  # watched, the other ranks learn it from this rank's claim, with no collective
            _leave_group(engine)
        raise
    _leave_group(engine)
    exit_rank()


def _leave_group(engine) -> None:
    """This rank's weight update groups, then the process group (also when its engine was never built)."""
    from rollout_cli.models.tensor_parallel import close_tensor_parallel  # heavy: torch

    if engine is not None:
        engine.control.close()
    else:
        close_tensor_parallel()


def exit_rank() -> None:
    """End a rank's process once its work is done and its files are closed, skipping interpreter
    finalization (rank_failure.exit_process; seen in CI on a follower after a weight-update group was
    used, and on rank 0 of `run --tp 2` on a loaded machine: exit -6, which torch.distributed.run
    reports as a failed command)."""
    exit_process(0)


@contextlib.contextmanager
def leading(engine):
    """Rank 0's engine for the length of the command: the followers are released at the end. On an error
    under rank_failures, they leave when it claims the failure: a "stop" sent now could wait forever
    (a follower stuck in the forward's all-reduce, or gone)."""
    with closing_files():
        try:
            yield engine
        except BaseException:
            if not watching():
                engine.control.close()
            raise
    engine.control.close()


def tensor_parallel_run(job_fields: dict, params: SamplingParams, quiet: bool, *, model: str, engine_options: dict,
                        tp: int, dp: int) -> None:
    """`run --tp N [--dp M]`: M engines of N ranks each (ranks r*N .. r*N + N - 1 form engine r); each
    engine's rank 0 runs its share of the job (JobConfig's fields) as a data-parallel replica, the other
    ranks follow it. In the command typed: check the inputs and start the ranks (exits)."""
    from rollout_cli.job import JobConfig, check_job_inputs, run_job  # heavy: loads the engine (torch)
    from rollout_cli.models.build import load_model_config  # heavy: torch
    from rollout_cli.models.tensor_parallel_support import check_tensor_parallel  # heavy: torch

    with user_errors(), rank_failures():  # rank_failures: a no-op in the command typed
        job = JobConfig(**job_fields)
        if not is_rank():
            check_job_inputs(job)  # before a hub id is downloaded
        config = opt.engine_config(model=model, quiet=quiet, **engine_options)
        if not is_rank():  # the command the user typed: its inputs checked, start the ranks
            check_tensor_parallel(load_model_config(config.model), tp)
            launch_ranks(tp * dp, "run", config)
        config, rank = rank_config(config, tp)
        if rank % tp != 0:
            follow_leader(config)
            return
        # replicas other than the first draw nothing: engine 0's bar shows its share of the prompts
        console = Console(stderr=True, quiet=quiet or rank != 0)
        engine = load_engine(config, console)
        # the engines' leaders are the replicas (one engine alone, without --dp, is a group of one)
        replicas = ReplicaGroup(engine.tp.replica, engine.tp.num_replicas, int(os.environ.get("LOCAL_RANK", "0")),
                                process_group=engine.tp.leaders_group)
        with leading(engine), RunProgressBar(console) as update:
            manifest = run_job(engine, params, job, on_progress=update, group=replicas)
        if not quiet and rank == 0:
            console.print(run_summary_table(manifest, job.out))
    exit_rank()  # every file is closed and the followers are released
