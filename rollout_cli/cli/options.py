"""Option types shared by the commands that start an engine (run, bench, serve).

Each alias carries its help text once. The engine flags are declared once in
ENGINE_OPTIONS; `with_engine_options` adds them to a command, and
`engine_config(...)` maps them one-to-one onto EngineConfig fields.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Annotated, Optional

import typer

from rollout_cli.config import EngineConfig
from rollout_cli.errors import RolloutError
from rollout_cli.models.hub import resolve_engine_config

ENGINE = "Engine"
SAMPLING = "Sampling"

Model = Annotated[str, typer.Option(help="HuggingFace checkpoint directory (config.json, *.safetensors, tokenizer), or a hub id such as Qwen/Qwen3-8B (fetched into the Hugging Face cache).", rich_help_panel=ENGINE)]
Revision = Annotated[Optional[str], typer.Option(help="Hub ids: branch, tag or commit to load; default main.", rich_help_panel=ENGINE)]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.", rich_help_panel=ENGINE)]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.", rich_help_panel=ENGINE)]
MaxModelLen = Annotated[Optional[int], typer.Option(help="Longest prompt + response; default: the model's max_position_embeddings.", rich_help_panel=ENGINE)]
MaxBatchTokens = Annotated[int, typer.Option(help="Token budget of one forward step; longer prompts prefill in chunks.", rich_help_panel=ENGINE)]
MaxRunning = Annotated[int, typer.Option(help="Requests in flight at once.", rich_help_panel=ENGINE)]
KvMemoryFraction = Annotated[float, typer.Option(help="CUDA: share of free GPU memory (after weights and activations) for the KV cache.", rich_help_panel=ENGINE)]
LinearStateMemoryRatio = Annotated[float, typer.Option(help="Hybrid linear-attention models: largest share of the cache memory for per-sequence states; the KV cache gets the rest.", rich_help_panel=ENGINE)]
KvCacheTokens = Annotated[Optional[int], typer.Option(help="Exact KV cache size in tokens (overrides --kv-memory-fraction).", rich_help_panel=ENGINE)]
LoadFormat = Annotated[str, typer.Option(help="auto (safetensors) or dummy (random weights from config.json).", rich_help_panel=ENGINE)]
NoPrefixCache = Annotated[bool, typer.Option("--no-prefix-cache", help="Disable prefix sharing through the radix cache.", rich_help_panel=ENGINE)]
AttentionBackend = Annotated[str, typer.Option(help="torch, or triton (kernels + CUDA graphs; CUDA only); auto = triton on CUDA, torch on the CPU.", rich_help_panel=ENGINE)]
NoOverlapSchedule = Annotated[bool, typer.Option("--no-overlap-schedule", help="Plan each step after the previous one finished, instead of while it runs on the GPU.", rich_help_panel=ENGINE)]
NoAdmissionPacing = Annotated[bool, typer.Option("--no-admission-pacing", help="Admit waiting requests at every step that has room, instead of gathering them until the seats left empty cost as much as the eager step that admits them (with CUDA graphs only; see README).", rich_help_panel=ENGINE)]
SharedPrefixAttention = Annotated[bool, typer.Option("--shared-prefix-attention", help="Decode steps read a prompt's KV once for all of its samples running at the time (--n), not once per sample (Triton backend; see README).", rich_help_panel=ENGINE)]
NoCudaGraphs = Annotated[bool, typer.Option("--no-cuda-graphs", help="Run decode steps eagerly instead of replaying CUDA graphs.", rich_help_panel=ENGINE)]
Quantization = Annotated[Optional[str], typer.Option(help="fp8: linear layers in blockwise FP8 e4m3 (weights quantized at load and at every update, activations per token group; the LM head, embeddings, norms, routers and MoE experts stay in --dtype; see README).", rich_help_panel=ENGINE)]
KvCacheDtype = Annotated[str, typer.Option(help="auto (the model's dtype) or fp8: the KV cache in e4m3, per-tensor scale 1.0; twice the tokens in the same memory (see README).", rich_help_panel=ENGINE)]
Deterministic = Annotated[bool, typer.Option("--deterministic", help="On-policy mode: tokens and logprobs bit for bit the same whatever the batch, chunking or cache hits (batch-invariant Triton kernels on a GPU; on the CPU's torch path one forward per token, slow; see README).", rich_help_panel=ENGINE)]
Speculative = Annotated[Optional[str], typer.Option(help="siblings: speculative decoding whose drafts are what the prompt's other samples wrote after the same 3 tokens; mtp: drafts from the checkpoint's multi-token-prediction head (Qwen3-Next, Qwen3.5); verified in one forward, the tokens are those decoding without it gives (see README).", rich_help_panel=ENGINE)]
SpeculativeMaxBatch = Annotated[Optional[int], typer.Option(help="With --speculative: decode steps with more running requests than this carry no drafts (where a step is compute-bound, verifying drafts costs more than it saves); default: draft at every batch size.", rich_help_panel=ENGINE)]
SpeculativeAlways = Annotated[bool, typer.Option("--speculative-always", help="With --speculative: draft at every decode step (within --speculative-max-batch) instead of only at the batch sizes where drafting steps measured more tokens per second than plain ones.", rich_help_panel=ENGINE)]
NumDraftTokens = Annotated[Optional[int], typer.Option(help="With --speculative: the most draft tokens a request verifies per step (default: 4 for siblings, 1 for mtp; mtp drafts further by chaining its head).", rich_help_panel=ENGINE)]
WeightVersion = Annotated[str, typer.Option(help="Weight version recorded on every trajectory.", rich_help_panel=ENGINE)]

N = Annotated[int, typer.Option(help="Samples per prompt.", rich_help_panel=SAMPLING)]
Temperature = Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.", rich_help_panel=SAMPLING)]
Seed = Annotated[int, typer.Option(help="Seed; each sample's stream is keyed by (seed, prompt, sample, position).", rich_help_panel=SAMPLING)]


# (parameter name, option type, default) of every engine flag, in --help order.
ENGINE_OPTIONS = (
    ("revision", Revision, None),
    ("device", Device, "auto"),
    ("dtype", Dtype, "auto"),
    ("max_model_len", MaxModelLen, None),
    ("max_batch_tokens", MaxBatchTokens, 8192),
    ("max_running", MaxRunning, 256),
    ("kv_memory_fraction", KvMemoryFraction, 0.85),
    ("kv_cache_tokens", KvCacheTokens, None),
    ("linear_state_memory_ratio", LinearStateMemoryRatio, 0.5),
    ("load_format", LoadFormat, "auto"),
    ("no_prefix_cache", NoPrefixCache, False),
    ("attention_backend", AttentionBackend, "auto"),
    ("no_cuda_graphs", NoCudaGraphs, False),
    ("no_overlap_schedule", NoOverlapSchedule, False),
    ("no_admission_pacing", NoAdmissionPacing, False),
    ("shared_prefix_attention", SharedPrefixAttention, False),
    ("deterministic", Deterministic, False),
    ("quantization", Quantization, None),
    ("kv_cache_dtype", KvCacheDtype, "auto"),
    ("speculative", Speculative, None),
    ("num_draft_tokens", NumDraftTokens, None),
    ("speculative_max_batch", SpeculativeMaxBatch, None),
    ("speculative_always", SpeculativeAlways, False),
    ("weight_version", WeightVersion, "0"),
)
ENGINE_DEFAULTS = {name: default for name, _, default in ENGINE_OPTIONS}


def with_engine_options(exclude: tuple[str, ...] = ()):
    """Decorator: give a Typer command the engine flags; it receives them as `engine_options: dict`.

    The wrapper's signature is the command's own (minus `engine_options`) plus one keyword
    parameter per ENGINE_OPTIONS entry, which is what Typer reads to build the options.
    """
    added = [(name, kind, default) for name, kind, default in ENGINE_OPTIONS if name not in exclude]

    def decorate(command):
        hints = typing.get_type_hints(command, include_extras=True)
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in inspect.signature(command).parameters.values() if p.name != "engine_options"]
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=kind, default=default)
                 for name, kind, default in added]

        @functools.wraps(command)
        def wrapper(**kwargs):
            engine_options = {name: kwargs.pop(name) for name, _, _ in added}
            return command(engine_options=engine_options, **kwargs)

        wrapper.__signature__ = inspect.Signature(own + extra, return_annotation=None)
        wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
        return wrapper

    return decorate


def engine_config(*, model, device, dtype, max_model_len, max_batch_tokens, max_running, kv_memory_fraction,
                  kv_cache_tokens, load_format, no_prefix_cache, attention_backend="auto", no_cuda_graphs=False,
                  weight_version="0", linear_state_memory_ratio=0.5, no_overlap_schedule=False, deterministic=False,
                  quantization=None, kv_cache_dtype="auto", revision=None, quiet=False, speculative=None,
                  num_draft_tokens=None, speculative_max_batch=None, speculative_always=False,
                  no_admission_pacing=False, shared_prefix_attention=False):
    """The EngineConfig of the flags, a hub id already resolved to its snapshot directory (fetched
    here, before any spinner or replica starts; `quiet` silences the download bars)."""
    return resolve_engine_config(EngineConfig(
        model=model, revision=revision, device=device, dtype=dtype, max_model_len=max_model_len,
        max_batch_tokens=max_batch_tokens, max_running=max_running, kv_memory_fraction=kv_memory_fraction,
        kv_cache_tokens=kv_cache_tokens, load_format=load_format, enable_prefix_cache=not no_prefix_cache,
        attention_backend=attention_backend, cuda_graphs=not no_cuda_graphs, weight_version=weight_version,
        linear_state_memory_ratio=linear_state_memory_ratio, overlap_schedule=not no_overlap_schedule,
        deterministic=deterministic, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
        speculative=speculative, num_draft_tokens=num_draft_tokens, speculative_max_batch=speculative_max_batch,
        speculative_gate=not speculative_always, admission_pacing=not no_admission_pacing,
        shared_prefix_attention=shared_prefix_attention,
    ), quiet=quiet)


CLIENT = "Engine daemon"

EngineAddress = Annotated[Optional[str], typer.Option(
    "--engine", help="Daemon address: a Unix socket path or http://HOST:PORT; default $ROLLOUT_ENGINE, "
    "else the default socket of rollout serve.", rich_help_panel=CLIENT)]
TokenFile = Annotated[Optional[str], typer.Option(
    help="File holding the bearer token of an http:// engine.", rich_help_panel=CLIENT)]


def token_id_list(flag: str, text: str) -> tuple[int, ...]:
    """A comma-separated flag of token ids ("151645,151643"; "" = none) -> its ids, or one line."""
    parts = [part.strip() for part in text.split(",")] if text.strip() else []
    if not all(part.isdigit() for part in parts):
        raise RolloutError(f"{flag} takes comma-separated token ids such as 151645,151643; got {text!r}")
    return tuple(int(part) for part in parts)
