"""`rollout score`: teacher-forced logprobs of a run's trajectories, and how far they are from the run's."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

from rollout_cli.cli import options as opt
from rollout_cli.cli.display import score_progress_bar, score_summary_table
from rollout_cli.cli.errors import user_errors
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.process_gc import freeze_long_lived_objects

DATA = "Input and output"


@opt.with_engine_options()
def score_command(
    model: Annotated[str, typer.Option(help="HuggingFace checkpoint directory to score with.", rich_help_panel=opt.ENGINE)] = ...,
    data: Annotated[str, typer.Option(help="A run's output directory (or its trajectories/ folder).", rich_help_panel=DATA)] = ...,
    out: Annotated[str, typer.Option(help="Output directory (scores/part-NNNNN.parquet, manifest.json).", rich_help_panel=DATA)] = ...,
    temperature: Annotated[Optional[float], typer.Option(help="Temperature the logprobs are reported at; default: the run's (its manifest.json), else 1.", rich_help_panel=opt.SAMPLING)] = None,
    logprobs_mode: Annotated[Optional[str], typer.Option(help="processed or raw; default: the run's, else processed.", rich_help_panel=opt.SAMPLING)] = None,
    top_p: Annotated[Optional[float], typer.Option(help="The run's nucleus mass (processed logprobs are over the kept set); default: the run's, else 1.", rich_help_panel=opt.SAMPLING)] = None,
    top_k: Annotated[Optional[int], typer.Option(help="The run's top-k; default: the run's, else 0 (off).", rich_help_panel=opt.SAMPLING)] = None,
    min_p: Annotated[Optional[float], typer.Option(help="The run's min-p; default: the run's, else 0 (off).", rich_help_panel=opt.SAMPLING)] = None,
    sampling_mask: Annotated[bool, typer.Option("--sampling-mask", help="Renormalise each token over the run's recorded kept set (column response_sampling_mask, from run --sampling-mask) instead of re-running the filters on the scoring logits: what a trainer replaying the masks computes.", rich_help_panel=opt.SAMPLING)] = False,
    top_logprobs: Annotated[int, typer.Option(help="Also write the K most likely tokens and their logprobs at every response position (teacher scoring for distillation); 0 = off.", rich_help_panel=DATA)] = 0,
    images_from: Annotated[Optional[str], typer.Option(help="An image run's prompt Parquet file (trajectories hold the image tokens, not the pixels); default: the file the run's manifest names.", rich_help_panel=DATA)] = None,
    image_key: Annotated[Optional[str], typer.Option(help="The image column of --images-from; default: the run's.", rich_help_panel=DATA)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue a killed job in OUT: score only the missing samples.", rich_help_panel=DATA)] = False,
    shard_rows: Annotated[int, typer.Option(help="Rows per output shard.", rich_help_panel=DATA)] = 1024,
    flush_seconds: Annotated[float, typer.Option(help="Close a shard when its oldest row waited this long.", rich_help_panel=DATA)] = 10.0,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar or summary table.")] = False,
    engine_options: Optional[dict] = None,  # filled by with_engine_options
) -> None:
    """Teacher-force a run's trajectories and report how far its logprobs are from them.

    Prompt and response go through the model in one prefill, the way a trainer computes old logprobs;
    the summary gives the tokens scored, the mean / p99 / max absolute difference and the share equal
    bit for bit (all of it when both commands use --deterministic).

    Example:

        rollout run --model recipes/example_model --data recipes/prompts.parquet --out traj/ --n 4 --deterministic
        rollout score --model recipes/example_model --data traj/ --out scores/ --deterministic
    """
    # heavy: torch and the model code
    from rollout_cli.engine.engine import Engine
    from rollout_cli.score_job import ScoreJobConfig, run_sampling, run_score_job

    console = Console(stderr=True, quiet=quiet)
    with user_errors():
        recorded = run_sampling(data)
        given = {"temperature": temperature, "logprobs_mode": logprobs_mode, "top_p": top_p, "top_k": top_k,
                 "min_p": min_p}
        defaults = {"temperature": 1.0, "logprobs_mode": "processed", "top_p": 1.0, "top_k": 0, "min_p": 0.0}
        params = SamplingParams(**{name: value if value is not None else recorded.get(name, defaults[name])
                                   for name, value in given.items()})
        job = ScoreJobConfig(data=data, out=out, resume=resume, shard_rows=shard_rows, flush_seconds=flush_seconds,
                             top_logprobs=top_logprobs, images_from=images_from, image_key=image_key,
                             sampling_mask=sampling_mask)
        config = opt.engine_config(model=model, quiet=quiet, **engine_options)
        with console.status("loading model"):
            engine = Engine(config)
        freeze_long_lived_objects()
        with score_progress_bar(console) as update:
            manifest = run_score_job(engine, params, job, on_progress=update)
    if not quiet:
        console.print(score_summary_table(manifest, out))

