"""`rollout run --model M [--dp N]`: the job on an engine in this process, or in N data-parallel replicas.

`--dp N` starts the command again as N replicas under torch.distributed.run (rollout_cli.data_parallel);
each replica loads its own engine and generates its share of the prompts into the same OUT. A replica
that fails ends the others as a tensor-parallel rank does (cli/rank_failure.py): each closes its own
shards, replica 0 records the failing replica's line in the manifest, and only that replica speaks.
"""

from __future__ import annotations

import dataclasses
import sys

import typer
from rich.console import Console

from rollout_cli.cli import options as opt
from rollout_cli.cli.display import RunProgressBar, run_summary_table
from rollout_cli.cli.errors import user_errors
from rollout_cli.cli.rank_failure import closing_files, rank_failures, watching
from rollout_cli.data_parallel import ReplicaGroup, launch_replicas, replica_device, without_option
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.models.hub import pinned_argv
from rollout_cli.process_gc import freeze_long_lived_objects


def embedded_run(job_fields: dict, params: SamplingParams, quiet: bool, *, model: str, engine_options: dict,
                 dp: int) -> None:
    """Run the job (JobConfig's fields) here; in the command typed with --dp N, start N replicas instead (exits)."""
    from rollout_cli.job import JobConfig, check_job_inputs, run_job  # heavy: loads the engine (torch)

    with user_errors(), rank_failures():  # rank_failures: a no-op in the command typed
        job = JobConfig(**job_fields)
        group = ReplicaGroup.from_environment()
        if group.alone:  # the command typed: bad input is one line before any replica or model starts (or download)
            check_job_inputs(job)
        config = opt.engine_config(model=model, quiet=quiet, **engine_options)
        if group.alone and dp > 1:
            raise typer.Exit(launch_replicas(dp, pinned_argv(without_option(sys.argv[2:], "--dp"), config)))
        config = dataclasses.replace(config, device=replica_device(config.device, group))
        # replicas other than the first draw nothing: replica 0's bar shows its share of the prompts
        console = Console(stderr=True, quiet=quiet or not group.is_leader)
        engine = load_engine(config, console)
        try:
            with closing_files(), RunProgressBar(console) as update:  # every replica writes its own shards
                manifest = run_job(engine, params, job, on_progress=update, group=group)
        except BaseException:
            if not watching():  # watched, the others learn it from this replica's claim, with no collective
                group.close()
            raise
        group.close()
        if not quiet and group.is_leader:
            console.print(run_summary_table(manifest, job.out))


def load_engine(config, console: Console):
    """The engine of `config`, built under a spinner; its long-lived objects then frozen out of the GC's scans."""
    from rollout_cli.engine.engine import Engine  # heavy: torch and the model code

    with console.status("loading model"):
        engine = Engine(config)
    freeze_long_lived_objects()
    return engine
