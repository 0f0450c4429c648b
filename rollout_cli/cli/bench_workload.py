"""`rollout bench`'s workload: its prompts (random ids, or --data's) read and checked against the model.

Nothing here loads weights: under --tp N the command typed builds and checks the workload before it
starts the ranks, so a workload the model cannot hold is one line at once. Refused on rank 0 after the
start, it left the other ranks waiting for rank 0 in the process group's rendezvous until the launcher
killed them (~45 s on the CPU).
"""

from __future__ import annotations

from transformers import AutoTokenizer

from rollout_cli.bench import BenchConfig, Workload, make_workload
from rollout_cli.bench_limits import check_context_length
from rollout_cli.errors import RolloutError
from rollout_cli.io.prompts import PromptSource
from rollout_cli.models.build import model_positions, resolve_max_model_len


def checked_workload(cfg: BenchConfig, engine_config, hf_config, data: str | None, prompt_key: str,
                     pin_images: bool = False) -> Workload:
    """The benchmark's workload; refused in one line when a sample would run past the max model length
    (the engine would cut it short, and the run would time fewer tokens than asked). pin_images: image
    rows in page-locked memory (the run's own workload on a CUDA device)."""
    data_prompts = read_prompts(data, prompt_key, engine_config.model) if data else None
    workload = make_workload(cfg, hf_config.vocab_size, data_prompts, hf_config, pin_images)
    check_context_length(cfg, [len(p) for p in workload.prompts],
                         resolve_max_model_len(hf_config, engine_config.max_model_len),
                         model_positions(hf_config)[0], data, engine_config.max_model_len is not None)
    return workload


def read_prompts(path: str, prompt_key: str, model: str) -> list[list[int]]:
    """--data's prompts as token ids (through the model's tokenizer, when it has one)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception:
        tokenizer = None
    prompts = [row.prompt_token_ids for row in PromptSource(path, tokenizer, prompt_key=prompt_key)]
    if not prompts:  # the report's means would divide by zero after the timed run
        raise RolloutError(f"--data {path} holds no prompts; give a Parquet file with at least one row")
    return prompts
