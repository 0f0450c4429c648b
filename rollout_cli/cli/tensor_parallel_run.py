"""`rollout run --tp N`: one engine split over N processes (rollout_cli.engine.tensor_parallel).

The command re-starts itself as N ranks under torch.distributed.run, as `--dp` does; rank 0 runs
the job (scheduler, sampler, writer, progress bar) and the other ranks follow its steps.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import typer
from rich.console import Console

from rollout_cli.cli import options as opt
from rollout_cli.cli.errors import user_errors


def tensor_parallel_run(tp: int, engine_options: dict, quiet: bool, out: str, job_args: dict, sampling: dict,
                        model: str) -> None:
    from rollout_cli.cli.run import _progress_bar, _summary_table
    from rollout_cli.data_parallel import ReplicaGroup, launch_replicas, replica_device
    from rollout_cli.engine.engine import Engine
    from rollout_cli.engine.sampling_params import SamplingParams
    from rollout_cli.engine.tensor_parallel import follow, stop_followers
    from rollout_cli.job import JobConfig, check_job_inputs, run_job
    from rollout_cli.models.build import load_model_config
    from rollout_cli.models.tensor_parallel import check_tensor_parallel, close_tensor_parallel

    with user_errors():
        params = SamplingParams(**sampling)
        config = dataclasses.replace(opt.engine_config(model=model, **engine_options), tensor_parallel_size=tp)
        job = JobConfig(**job_args)
        if "RANK" not in os.environ:  # the command the user typed: check the inputs, then start the ranks
            check_job_inputs(job)
            check_tensor_parallel(load_model_config(model), tp)
            raise typer.Exit(launch_replicas(tp, sys.argv[2:], what="tensor-parallel rank"))
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        config = dataclasses.replace(config, device=replica_device(config.device, ReplicaGroup(rank, tp, local_rank)))
        console = Console(stderr=True, quiet=quiet or rank != 0)
        try:
            with console.status("loading model"):
                engine = Engine(config)
            if rank != 0:
                follow(engine)
                return
            try:
                with _progress_bar(console) as (_, update):
                    manifest = run_job(engine, params, job, on_progress=update)
            finally:
                stop_followers(engine)
        finally:
            close_tensor_parallel()
        if not quiet:
            console.print(_summary_table(manifest, out))
