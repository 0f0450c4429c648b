"""`rollout run`: generate trajectories for a prompt Parquet file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rollout_cli.cli.errors import user_errors

ENGINE = "Engine"
SAMPLING = "Sampling"
DATA = "Input and output"


def run_command(
    model: Annotated[str, typer.Option(help="HuggingFace checkpoint directory (config.json, *.safetensors, tokenizer).", rich_help_panel=ENGINE)],
    data: Annotated[str, typer.Option(help="Prompt Parquet file.", rich_help_panel=DATA)],
    out: Annotated[str, typer.Option(help="Output directory (trajectories/part-NNNNN.parquet, manifest.json).", rich_help_panel=DATA)],
    n: Annotated[int, typer.Option(help="Samples per prompt.", rich_help_panel=SAMPLING)] = 1,
    max_new_tokens: Annotated[int, typer.Option(help="Longest response in tokens.", rich_help_panel=SAMPLING)] = 256,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.", rich_help_panel=SAMPLING)] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass; 1 disables.", rich_help_panel=SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 disables.", rich_help_panel=SAMPLING)] = 0,
    min_p: Annotated[float, typer.Option(help="Drop tokens under min_p x the top probability; 0 disables.", rich_help_panel=SAMPLING)] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed; each sample's stream is keyed by (seed, prompt, sample, position).", rich_help_panel=SAMPLING)] = 0,
    ignore_eos: Annotated[bool, typer.Option(help="Generate past eos tokens until --max-new-tokens.", rich_help_panel=SAMPLING)] = False,
    logprobs_mode: Annotated[str, typer.Option(help="processed: log_softmax(logits / temperature); raw: before temperature.", rich_help_panel=SAMPLING)] = "processed",
    prompt_key: Annotated[str, typer.Option(help="Column with the prompt: text, chat messages, or token ids.", rich_help_panel=DATA)] = "prompt",
    limit: Annotated[Optional[int], typer.Option(help="Use only the first N rows.", rich_help_panel=DATA)] = None,
    resume: Annotated[bool, typer.Option(help="Continue a killed run in OUT: generate only missing samples.", rich_help_panel=DATA)] = False,
    skip_invalid: Annotated[bool, typer.Option(help="Skip bad rows (listed in the manifest) instead of failing.", rich_help_panel=DATA)] = False,
    shard_rows: Annotated[int, typer.Option(help="Rows per output shard.", rich_help_panel=DATA)] = 1024,
    flush_seconds: Annotated[float, typer.Option(help="Close a shard when its oldest row waited this long.", rich_help_panel=DATA)] = 10.0,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.", rich_help_panel=ENGINE)] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.", rich_help_panel=ENGINE)] = "auto",
    max_model_len: Annotated[Optional[int], typer.Option(help="Longest prompt + response; default: the model's max_position_embeddings.", rich_help_panel=ENGINE)] = None,
    max_batch_tokens: Annotated[int, typer.Option(help="Token budget of one forward step; longer prompts prefill in chunks.", rich_help_panel=ENGINE)] = 8192,
    max_running: Annotated[int, typer.Option(help="Requests in flight at once.", rich_help_panel=ENGINE)] = 256,
    kv_memory_fraction: Annotated[float, typer.Option(help="CUDA: share of free GPU memory (after weights and activations) for the KV cache.", rich_help_panel=ENGINE)] = 0.85,
    kv_cache_tokens: Annotated[Optional[int], typer.Option(help="Exact KV cache size in tokens (overrides --kv-memory-fraction).", rich_help_panel=ENGINE)] = None,
    load_format: Annotated[str, typer.Option(help="auto (safetensors) or dummy (random weights from config.json).", rich_help_panel=ENGINE)] = "auto",
    no_prefix_cache: Annotated[bool, typer.Option(help="Disable prefix sharing through the radix cache.", rich_help_panel=ENGINE)] = False,
    weight_version: Annotated[str, typer.Option(help="Weight version recorded on every trajectory.", rich_help_panel=ENGINE)] = "0",
    quiet: Annotated[bool, typer.Option(help="No progress bar or summary table.")] = False,
) -> None:
    """Generate trajectories for every prompt of a Parquet file.

    Example:

        rollout run --model recipes/example_model --data recipes/prompts.parquet --out traj/ --n 4 --max-new-tokens 64
    """
    from rollout_cli.config import EngineConfig
    from rollout_cli.engine.engine import Engine
    from rollout_cli.engine.sampling_params import SamplingParams
    from rollout_cli.job import JobConfig, check_job_inputs, run_job

    console = Console(stderr=True, quiet=quiet)
    with user_errors():
        params = SamplingParams(
            n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, ignore_eos=ignore_eos, logprobs_mode=logprobs_mode,
        )
        engine_config = EngineConfig(
            model=model, device=device, dtype=dtype, max_model_len=max_model_len,
            max_batch_tokens=max_batch_tokens, max_running=max_running,
            kv_memory_fraction=kv_memory_fraction, kv_cache_tokens=kv_cache_tokens, load_format=load_format,
            enable_prefix_cache=not no_prefix_cache, weight_version=weight_version,
        )
        job = JobConfig(data=data, out=out, prompt_key=prompt_key, limit=limit, resume=resume,
                        skip_invalid=skip_invalid, shard_rows=shard_rows, flush_seconds=flush_seconds)
        check_job_inputs(job)
        with console.status("loading model"):
            engine = Engine(engine_config)
        with _progress_bar(console) as (progress, update):
            manifest = run_job(engine, params, job, on_progress=update)
        if not quiet:
            console.print(_summary_table(manifest, out))


class _progress_bar:
    """A rich bar: prompts done / total, output tokens/s, ETA."""

    def __init__(self, console: Console):
        self.progress = Progress(
            TextColumn("[bold]prompts"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[tps]:>9.0f} out tok/s"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=console, transient=False,
        )
        self.task = None

    def __enter__(self):
        self.progress.__enter__()
        self.task = self.progress.add_task("generate", total=None, tps=0.0)
        return self.progress, self.update

    def update(self, state) -> None:
        self.progress.update(self.task, total=state.prompts_total, completed=state.prompts_done,
                             tps=state.output_tokens_per_s)

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)


def _summary_table(manifest: dict, out: str) -> Table:
    table = Table(title=f"rollout run -> {Path(out)}", show_header=False)
    rows = [
        ("status", manifest["status"]),
        ("prompts", f"{manifest['prompts_done']} / {manifest['prompts']}"),
        ("trajectories", str(manifest["trajectories"])),
        ("written this run", str(manifest["trajectories_this_run"])),
        ("output tokens/s", f"{manifest['output_tokens_per_s']:.1f}"),
        ("prefix hit rate", f"{manifest['prefix_hit_rate']:.1%}"),
        ("finish reasons", ", ".join(f"{k}: {v}" for k, v in manifest["finish_reasons_this_run"].items()) or "-"),
        ("skipped rows", str(len(manifest["skipped_rows"]))),
        ("wall time", f"{manifest['wall_seconds']:.1f} s"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table
