"""`rollout run`: generate trajectories for a prompt Parquet file."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Annotated, Optional

import typer

from rollout_cli.cli import options as opt
from rollout_cli.cli.embedded_run import embedded_run
from rollout_cli.cli.errors import user_errors
from rollout_cli.cli.remote_run import check_daemon_flags, remote_run
from rollout_cli.cli.tensor_parallel_run import tensor_parallel_run
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.episodes import DEFAULT_MAX_TURNS, check_episode_sampling
from rollout_cli.errors import RolloutError
from rollout_cli.server.address import ENV_ENGINE

DATA = "Input and output"
EPISODES = "Multi-turn episodes"

# launch(JobConfig's fields, sampling settings, quiet): runs the job where the flags put it
Launcher = Callable[[dict, SamplingParams, bool], None]


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
    top_logprobs: Annotated[int, typer.Option(help="Also write each response token's K most likely tokens and their logprobs (columns response_top_token_ids, response_top_logprobs); steps with them run without CUDA graphs; 0 = off.", rich_help_panel=opt.SAMPLING)] = 0,
    sampling_mask: Annotated[bool, typer.Option("--sampling-mask", help="Also write, per response token, the ids of the tokens --top-k / --top-p / --min-p kept (column response_sampling_mask): the set it was drawn from, for a trainer to renormalise over; needs a filter and --temperature > 0; steps with it run without CUDA graphs.", rich_help_panel=opt.SAMPLING)] = False,
    seed: opt.Seed = 0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Generate past eos tokens until --max-new-tokens.", rich_help_panel=opt.SAMPLING)] = False,
    stop_token_ids: Annotated[str, typer.Option(help="Comma-separated token ids that also end a sample (finish_reason stop, the id kept as its last token), with or without --ignore-eos.", rich_help_panel=opt.SAMPLING)] = "",
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="A string that also ends a sample, with the token that completes it in the response's text (kept as its last token; finish_reason stop, stop_reason names it; response_text ends before the string, as vLLM's); repeat for several (at most 64, each at most 256 characters).", rich_help_panel=opt.SAMPLING)] = None,
    include_stop_str_in_output: Annotated[bool, typer.Option("--include-stop-str-in-output", help="Keep the --stop string (through its end) and a stop token's or eos's text in response_text, as vLLM's flag of that name; by default the text ends before them (the token ids keep every token either way).", rich_help_panel=opt.SAMPLING)] = False,
    logprobs_mode: Annotated[str, typer.Option(help="processed: log_softmax(logits / temperature) over the tokens top-k / top-p / min-p keep; raw: before temperature and filters.", rich_help_panel=opt.SAMPLING)] = "processed",
    prompt_key: Annotated[str, typer.Option(help="Column with the prompt: text, chat messages, or token ids.", rich_help_panel=DATA)] = "prompt",
    image_key: Annotated[Optional[str], typer.Option(help="Vision-language models: column with each row's images ({bytes, path} structs, a list of them, bytes or paths; paths relative to the Parquet file's folder), placed at the prompt's <image> placeholders or image parts; default: images, else image, if the file has one. Rows gain image_grid_thw.", rich_help_panel=DATA)] = None,
    limit: Annotated[Optional[int], typer.Option(help="Use only the first N rows.", rich_help_panel=DATA)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue a killed run in OUT: generate only missing samples.", rich_help_panel=DATA)] = False,
    continue_aborted: Annotated[bool, typer.Option("--continue-aborted", help="With --resume: continue the samples an aborted job wrote with finish_reason abort from their response so far, on the weights loaded now (each token records its weight version), instead of counting them done.", rich_help_panel=DATA)] = False,
    skip_invalid: Annotated[bool, typer.Option("--skip-invalid", help="Skip bad rows (listed in the manifest) instead of failing.", rich_help_panel=DATA)] = False,
    shard_rows: Annotated[int, typer.Option(help="Rows per output shard.", rich_help_panel=DATA)] = 1024,
    flush_seconds: Annotated[float, typer.Option(help="Close a shard when its oldest row waited this long.", rich_help_panel=DATA)] = 10.0,
    capture_routing: Annotated[bool, typer.Option("--capture-routing", help="MoE models: write every token's expert ids to OUT/routing/ (routing replay).", rich_help_panel=DATA)] = False,
    env: Annotated[Optional[str], typer.Option(help="Multi-turn episodes: a Python file defining make_env(row) (see recipes/envs/calculator.py); every sample becomes an episode of model and environment turns, its row gains response_loss_mask, model_turns, episode_reward, turn_cached_tokens.", rich_help_panel=EPISODES)] = None,
    max_turns: Annotated[Optional[int], typer.Option(help="With --env: model turns per episode at most (--max-new-tokens is per turn); default 8.", rich_help_panel=EPISODES)] = None,
    dp: Annotated[int, typer.Option(help="Data parallel: run N engine replicas (one per GPU, or N processes on the CPU) that split the prompts and share OUT. Across machines, start `rollout run` with torchrun instead.", rich_help_panel=opt.ENGINE)] = 1,
    tp: Annotated[int, typer.Option(help="Tensor parallel: split the model over N GPUs (N processes on the CPU); dense Llama / Qwen2 / Qwen3, MoE Qwen2-MoE / Qwen3-MoE / Mixtral, hybrid Qwen3-Next / Qwen3.5 and vision-language Qwen3-VL / Qwen3.5 models. With --dp M: M such engines share the prompts.", rich_help_panel=opt.ENGINE)] = 1,
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
    with user_errors():
        if continue_aborted and dp != 1:
            raise RolloutError("--continue-aborted runs on one engine for now; drop --dp")
        launch = _pick_launcher(model, engine, token_file, dp, tp, engine_options)
        # one set of sampling settings for every launcher: a bad value is one line before a model loads or
        # a daemon is called
        params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, min_p=min_p, seed=seed, ignore_eos=ignore_eos,
                                stop_token_ids=opt.token_id_list("--stop-token-ids", stop_token_ids),
                                stop=tuple(stop or ()), include_stop_str_in_output=include_stop_str_in_output,
                                logprobs_mode=logprobs_mode, top_logprobs=top_logprobs,
                                return_sampling_mask=sampling_mask)
        if env is not None:
            check_episode_sampling(params)
        elif max_turns is not None:
            raise RolloutError("--max-turns is for multi-turn episodes: give --env FILE too, or drop --max-turns")
    job_fields = dict(data=data, out=out, prompt_key=prompt_key, limit=limit, resume=resume,
                      continue_aborted=continue_aborted, skip_invalid=skip_invalid,
                      shard_rows=shard_rows, flush_seconds=flush_seconds, capture_routing=capture_routing)
    if env is not None:
        job_fields.update(env=env, max_turns=DEFAULT_MAX_TURNS if max_turns is None else max_turns)
    if image_key is not None:  # only when given: a daemon from before --image-key still takes text runs
        job_fields.update(image_key=image_key)
    launch(job_fields, params, quiet)


def _pick_launcher(model: str | None, engine: str | None, token_file: str | None, dp: int, tp: int,
                   engine_options: dict) -> Launcher:
    """Where the job runs, decided once from the flags: on a daemon (no --model, or --engine / $ROLLOUT_ENGINE),
    over tensor-parallel ranks (--tp N; with --dp M, M such engines), or on an engine in this process (with
    --dp N, in N data-parallel replicas of it)."""
    on_daemon = model is None or engine is not None or bool(os.environ.get(ENV_ENGINE))
    if dp != 1 and (on_daemon or dp < 1):
        raise RolloutError("--dp must be >= 1" if dp < 1 else
                           "--dp starts embedded replicas: give --model (a daemon serves one engine)")
    if tp != 1 and (on_daemon or tp < 1):
        raise RolloutError("--tp must be >= 1" if tp < 1 else
                           "--tp starts an embedded engine: give --model (a daemon serves one engine)")
    if on_daemon:
        check_daemon_flags(model, engine, engine_options)
        return functools.partial(remote_run, engine=engine, token_file=token_file)
    if tp > 1:
        return functools.partial(tensor_parallel_run, model=model, engine_options=engine_options, tp=tp, dp=dp)
    return functools.partial(embedded_run, model=model, engine_options=engine_options, dp=dp)
