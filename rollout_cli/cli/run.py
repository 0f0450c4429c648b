"""`rollout run`: generate trajectories for a prompt Parquet file."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

from rollout_cli.cli import options as opt
from rollout_cli.cli.display import RunProgressBar, run_summary_table
from rollout_cli.cli.errors import user_errors

DATA = "Input and output"


@opt.with_engine_options()
def run_command(
    model: Annotated[Optional[str], typer.Option(help="HuggingFace checkpoint directory or hub id (e.g. Qwen/Qwen3-8B): run an embedded engine. Leave out to run on a daemon (--engine).", rich_help_panel=opt.ENGINE)] = None,
    data: Annotated[str, typer.Option(help="Prompt Parquet file.", rich_help_panel=DATA)] = ...,
    out: Annotated[str, typer.Option(help="Output directory (trajectories/part-NNNNN.parquet, manifest.json).", rich_help_panel=DATA)] = ...,
    n: opt.N = 1,
    max_new_tokens: Annotated[int, typer.Option(help="Longest response in tokens.", rich_help_panel=opt.SAMPLING)] = 256,
    temperature: opt.Temperature = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass; 1 disables.", rich_help_panel=opt.SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 disables.", rich_help_panel=opt.SAMPLING)] = 0,
    min_p: Annotated[float, typer.Option(help="Drop tokens under min_p x the top probability; 0 disables.", rich_help_panel=opt.SAMPLING)] = 0.0,
    seed: opt.Seed = 0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Generate past eos tokens until --max-new-tokens.", rich_help_panel=opt.SAMPLING)] = False,
    logprobs_mode: Annotated[str, typer.Option(help="processed: log_softmax(logits / temperature); raw: before temperature.", rich_help_panel=opt.SAMPLING)] = "processed",
    prompt_key: Annotated[str, typer.Option(help="Column with the prompt: text, chat messages, or token ids.", rich_help_panel=DATA)] = "prompt",
    limit: Annotated[Optional[int], typer.Option(help="Use only the first N rows.", rich_help_panel=DATA)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue a killed run in OUT: generate only missing samples.", rich_help_panel=DATA)] = False,
    skip_invalid: Annotated[bool, typer.Option("--skip-invalid", help="Skip bad rows (listed in the manifest) instead of failing.", rich_help_panel=DATA)] = False,
    shard_rows: Annotated[int, typer.Option(help="Rows per output shard.", rich_help_panel=DATA)] = 1024,
    flush_seconds: Annotated[float, typer.Option(help="Close a shard when its oldest row waited this long.", rich_help_panel=DATA)] = 10.0,
    capture_routing: Annotated[bool, typer.Option("--capture-routing", help="MoE models: write every token's expert ids to OUT/routing/ (routing replay).", rich_help_panel=DATA)] = False,
    dp: Annotated[int, typer.Option(help="Data parallel: run N engine replicas (one per GPU, or N processes on the CPU) that split the prompts and share OUT. Across machines, start `rollout run` with torchrun instead.", rich_help_panel=opt.ENGINE)] = 1,
    tp: Annotated[int, typer.Option(help="Tensor parallel: split the model over N GPUs (N processes on the CPU); dense Llama / Qwen2 / Qwen3, MoE Qwen2-MoE / Qwen3-MoE / Mixtral and hybrid Qwen3-Next / Qwen3.5 models. With --dp M: M such engines share the prompts.", rich_help_panel=opt.ENGINE)] = 1,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar or summary table.")] = False,
    engine: opt.EngineAddress = None,
    token_file: opt.TokenFile = None,
    engine_options: Optional[dict] = None,  # filled by with_engine_options
) -> None:
    """Generate trajectories for every prompt of a Parquet file.

    Example:

        rollout run --model recipes/example_model --data recipes/prompts.parquet --out traj/ --n 4 --max-new-tokens 64

    On a daemon started with rollout serve (same options, same output; the engine reads and writes the files):

        rollout run --engine /tmp/rollout-$USER.sock --data recipes/prompts.parquet --out traj/ --n 4
    """
    import os

    from rollout_cli.server.address import ENV_ENGINE

    remote = model is None or engine is not None or os.environ.get(ENV_ENGINE)
    if dp != 1 and (remote or dp < 1):
        with user_errors():
            from rollout_cli.errors import RolloutError

            raise RolloutError("--dp must be >= 1" if dp < 1 else
                               "--dp starts embedded replicas: give --model (a daemon serves one engine)")
    if tp != 1 and (remote or tp < 1):
        with user_errors():
            from rollout_cli.errors import RolloutError

            raise RolloutError("--tp must be >= 1" if tp < 1 else
                               "--tp starts an embedded engine: give --model (a daemon serves one engine)")
    if tp > 1 and not remote:
        from rollout_cli.cli.tensor_parallel_run import tensor_parallel_run

        tensor_parallel_run(tp, dp, engine_options, quiet, out, job_args=dict(
            data=data, out=out, prompt_key=prompt_key, limit=limit, resume=resume, skip_invalid=skip_invalid,
            shard_rows=shard_rows, flush_seconds=flush_seconds, capture_routing=capture_routing), sampling=dict(
            n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, ignore_eos=ignore_eos, logprobs_mode=logprobs_mode), model=model)
        return
    if remote:
        from rollout_cli.cli.remote_run import remote_run

        remote_run(
            model=model, engine=engine, token_file=token_file, quiet=quiet,
            engine_flags=[name for name, value in engine_options.items() if value != opt.ENGINE_DEFAULTS[name]],
            job=dict(data=data, out=out, prompt_key=prompt_key, limit=limit, resume=resume,
                     skip_invalid=skip_invalid, shard_rows=shard_rows, flush_seconds=flush_seconds,
                     capture_routing=capture_routing),
            sampling=dict(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          min_p=min_p, seed=seed, ignore_eos=ignore_eos, logprobs_mode=logprobs_mode),
        )
        return
    import dataclasses
    import sys

    from rollout_cli.process_gc import freeze_long_lived_objects
    from rollout_cli.data_parallel import ReplicaGroup, launch_replicas, replica_device, without_option
    from rollout_cli.engine.engine import Engine
    from rollout_cli.engine.sampling_params import SamplingParams
    from rollout_cli.job import JobConfig, check_job_inputs, run_job
    from rollout_cli.models.hub import pinned_argv

    with user_errors():
        params = SamplingParams(
            n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, ignore_eos=ignore_eos, logprobs_mode=logprobs_mode,
        )
        job = JobConfig(data=data, out=out, prompt_key=prompt_key, limit=limit, resume=resume,
                        skip_invalid=skip_invalid, shard_rows=shard_rows, flush_seconds=flush_seconds,
                        capture_routing=capture_routing)
        group = ReplicaGroup.from_environment()
        if group is None:
            check_job_inputs(job)  # bad input: one line before any replica or model starts (or download)
        engine_config = opt.engine_config(model=model, quiet=quiet, **engine_options)
        if group is None:
            if dp > 1:
                raise typer.Exit(launch_replicas(dp, pinned_argv(without_option(sys.argv[2:], "--dp"), engine_config)))
        else:
            engine_config = dataclasses.replace(engine_config, device=replica_device(engine_config.device, group))
        # replicas other than the first draw nothing: replica 0's bar shows its share of the prompts
        console = Console(stderr=True, quiet=quiet or (group is not None and not group.is_leader))
        with console.status("loading model"):
            engine = Engine(engine_config)
        freeze_long_lived_objects()
        try:
            with RunProgressBar(console) as update:
                manifest = run_job(engine, params, job, on_progress=update, group=group)
        finally:
            if group is not None:
                group.close()
        if not quiet and (group is None or group.is_leader):
            console.print(run_summary_table(manifest, out))

