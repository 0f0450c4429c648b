"""Option types shared by the commands that start an engine (run, bench, later serve).

Each alias carries its help text once; `engine_config(...)` maps the flags
one-to-one onto EngineConfig fields.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

ENGINE = "Engine"
SAMPLING = "Sampling"

Model = Annotated[str, typer.Option(help="HuggingFace checkpoint directory (config.json, *.safetensors, tokenizer).", rich_help_panel=ENGINE)]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.", rich_help_panel=ENGINE)]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.", rich_help_panel=ENGINE)]
MaxModelLen = Annotated[Optional[int], typer.Option(help="Longest prompt + response; default: the model's max_position_embeddings.", rich_help_panel=ENGINE)]
MaxBatchTokens = Annotated[int, typer.Option(help="Token budget of one forward step; longer prompts prefill in chunks.", rich_help_panel=ENGINE)]
MaxRunning = Annotated[int, typer.Option(help="Requests in flight at once.", rich_help_panel=ENGINE)]
KvMemoryFraction = Annotated[float, typer.Option(help="CUDA: share of free GPU memory (after weights and activations) for the KV cache.", rich_help_panel=ENGINE)]
KvCacheTokens = Annotated[Optional[int], typer.Option(help="Exact KV cache size in tokens (overrides --kv-memory-fraction).", rich_help_panel=ENGINE)]
LoadFormat = Annotated[str, typer.Option(help="auto (safetensors) or dummy (random weights from config.json).", rich_help_panel=ENGINE)]
NoPrefixCache = Annotated[bool, typer.Option("--no-prefix-cache", help="Disable prefix sharing through the radix cache.", rich_help_panel=ENGINE)]
AttentionBackend = Annotated[str, typer.Option(help="torch, or triton (kernels + CUDA graphs; CUDA, opt-in until device-verified); auto = torch.", rich_help_panel=ENGINE)]
NoCudaGraphs = Annotated[bool, typer.Option("--no-cuda-graphs", help="Run decode steps eagerly instead of replaying CUDA graphs.", rich_help_panel=ENGINE)]
WeightVersion = Annotated[str, typer.Option(help="Weight version recorded on every trajectory.", rich_help_panel=ENGINE)]

N = Annotated[int, typer.Option(help="Samples per prompt.", rich_help_panel=SAMPLING)]
Temperature = Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.", rich_help_panel=SAMPLING)]
Seed = Annotated[int, typer.Option(help="Seed; each sample's stream is keyed by (seed, prompt, sample, position).", rich_help_panel=SAMPLING)]


def engine_config(*, model, device, dtype, max_model_len, max_batch_tokens, max_running, kv_memory_fraction,
                  kv_cache_tokens, load_format, no_prefix_cache, attention_backend="auto", no_cuda_graphs=False,
                  weight_version="0"):
    from rollout_cli.config import EngineConfig

    return EngineConfig(
        model=model, device=device, dtype=dtype, max_model_len=max_model_len,
        max_batch_tokens=max_batch_tokens, max_running=max_running, kv_memory_fraction=kv_memory_fraction,
        kv_cache_tokens=kv_cache_tokens, load_format=load_format, enable_prefix_cache=not no_prefix_cache,
        attention_backend=attention_backend, cuda_graphs=not no_cuda_graphs, weight_version=weight_version,
    )

CLIENT = "Engine daemon"

EngineAddress = Annotated[Optional[str], typer.Option(
    "--engine", help="Daemon address: a Unix socket path or http://HOST:PORT; default $ROLLOUT_ENGINE, "
    "else the default socket of rollout serve.", rich_help_panel=CLIENT)]
TokenFile = Annotated[Optional[str], typer.Option(
    help="File holding the bearer token of an http:// engine.", rich_help_panel=CLIENT)]
