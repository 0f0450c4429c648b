"""Engine configuration: one frozen dataclass, one CLI flag per field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_cli.errors import RolloutError

if TYPE_CHECKING:
    from rollout_cli.models.hub import HubSource

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8_e4m3: vLLM's spelling of the same
SPECULATIVE = (None, "siblings", "mtp")  # --speculative: drafts from sibling samples, or the checkpoint's MTP head
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine loads the model and sizes its batches and KV cache."""

    model: str
    """Directory of a HuggingFace checkpoint (config.json, *.safetensors, tokenizer files), or a hub id
    (ORG/NAME) that models/hub.py resolves to its snapshot directory in the Hugging Face cache."""
    revision: str | None = None
    """Hub ids: the branch, tag or commit to load; default main."""
    model_source: HubSource | None = None
    """Set by models.hub.resolve_engine_config when `model` was a hub id: the id, revision and commit."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, or cuda / cuda:N."""
    dtype: str = "auto"
    """Weight and activation dtype: auto is bfloat16 on CUDA and float32 on the CPU."""
    max_model_len: int | None = None
    """Longest prompt + response in tokens; default: the config's max_position_embeddings."""
    max_batch_tokens: int = 8192
    """Token budget of one forward step; longer prompts are prefilled in chunks of this size."""
    max_running: int = 256
    """Requests in flight at once (decoding or prefilling)."""
    kv_memory_fraction: float = 0.85
    """On CUDA, the share of GPU memory (after weights and activations) the KV cache may take."""
    kv_cache_tokens: int | None = None
    """Exact KV pool size in tokens; overrides kv_memory_fraction (tests use it to force preemption)."""
    linear_state_memory_ratio: float = 0.5
    """Hybrid (linear-attention) models: the largest share of the cache memory the per-sequence state pool
    may take (it takes no more than it can use); the KV pool gets the rest."""
    load_format: str = "auto"
    """auto reads safetensors; dummy makes random weights from config.json alone (benchmarks)."""
    enable_prefix_cache: bool = True
    """Share computed prompt prefixes between requests through the radix cache."""
    weight_version: str = "0"
    """Version recorded on every trajectory produced by the weights loaded at start."""
    weights_cpu_backup: bool = False
    """Keep a host copy of the weights while their GPU memory is released, so resume restores them."""
    attention_backend: str = "auto"
    """auto (triton on CUDA, torch on the CPU), torch (SDPA over gathered KV), or triton."""
    cuda_graphs: bool = True
    """On CUDA with the triton backend, replay captured graphs for decode steps."""
    overlap_schedule: bool = True
    """Schedule and launch the next decode step while the current one runs on the GPU (the host's
    per-step work hides behind the device's); off: schedule, run, post-process one step at a time."""
    admission_pacing: bool = True
    """While decode steps replay CUDA graphs: waiting requests join once the seats left empty have forgone
    as much work as the eager step that admits them costs (engine/scheduling/admission_pacing.py), not one
    eager step per freed seat. Off: admit at every step that has room. Which step a request starts at
    changes, not its tokens in exact arithmetic (nor in bf16 in the on-policy mode)."""
    shared_prefix_attention: bool = False
    """Decode steps read a prompt's KV once for all of its samples running at the time (--n), not once per
    sample (kernels/shared_prefix_decode_attention.py; Triton backend, default mode): the same attention
    up to float32 summation order."""
    deterministic: bool = False
    """On-policy mode: a sample's tokens, logprobs and routing are bit for bit the same whatever runs
    beside it (batch, chunking, prefix-cache hits). Today on the torch path, one token per forward."""
    quantization: str | None = None
    """fp8: linear layers in blockwise FP8 e4m3 (weights quantized at load and at every update,
    activations per token group inside the GEMM; models/fp8.py); None: the model's dtype."""
    kv_cache_dtype: str = "auto"
    """auto: the KV cache in the model's dtype; fp8 (or fp8_e4m3): e4m3 with a per-tensor scale of 1.0 per
    layer for k and for v, twice the tokens in the same memory (kernels/kv_store.py)."""
    tensor_parallel_size: int = 1
    """Tensor parallel ranks (`rollout run --tp N`): processes started by torch.distributed.run, one per GPU."""
    speculative: str | None = None
    """siblings: speculative decoding with drafts from the prompt's other samples (engine/scheduling/
    sibling_drafts.py); mtp: drafts from the checkpoint's multi-token-prediction head (Qwen3-Next,
    Qwen3.5; engine/execution/mtp_step.py); verified so that the tokens are those decoding without it
    gives; None: off."""
    num_draft_tokens: int | None = None
    """With speculative: the most draft tokens a request verifies in one step (None: 4 for siblings, 1
    for mtp: a head trained to predict one token ahead, chained further, guesses worse at each step)."""
    speculative_max_batch: int | None = None
    """With speculative: decode steps with more running requests than this carry no drafts (vLLM's
    speculative_disable_by_batch_size): where a step is compute-bound, verifying drafts costs more than
    the tokens it saves. None: draft at every batch size."""
    speculative_gate: bool = True
    """With speculative: draft only at the batch sizes where drafting steps measured more tokens per
    second than plain decode steps (engine/scheduling/draft_gate.py; `--speculative-always` turns it off:
    every decode step within speculative_max_batch drafts). Speed only: the tokens are the same."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise RolloutError(f"unknown --dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if not (self.device in DEVICES or self.device.startswith("cuda:")):
            raise RolloutError(f"unknown --device {self.device!r}; choose one of {', '.join(DEVICES)} (or cuda:N)")
        if self.load_format not in LOAD_FORMATS:
            raise RolloutError(f"unknown --load-format {self.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise RolloutError(
                f"unknown --attention-backend {self.attention_backend!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.max_batch_tokens < 1:
            raise RolloutError("--max-batch-tokens must be at least 1")
        if self.max_running < 1:
            raise RolloutError("--max-running must be at least 1")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise RolloutError("--kv-memory-fraction must be in (0, 1]")
        if not 0.0 < self.linear_state_memory_ratio < 1.0:
            raise RolloutError("--linear-state-memory-ratio must be in (0, 1)")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2:
            raise RolloutError("--kv-cache-tokens must be at least 2")
        if self.tensor_parallel_size < 1:
            raise RolloutError("--tp must be at least 1")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise RolloutError(f"unknown --quantization {self.quantization!r}; choose {', '.join(QUANTIZATIONS)}")
            if self.deterministic:
                raise RolloutError("--quantization fp8 with --deterministic: the batch-invariant kernels run in the "
                                   "model's dtype only (no batch-invariant FP8 GEMM yet); drop one of the two")
            if self.tensor_parallel_size > 1:
                raise RolloutError("--quantization fp8 runs on one GPU for now (--tp 1); drop --tp or the quantization")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise RolloutError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype == "fp8_e4m3":  # one spelling in manifests, so --resume compares like with like
            object.__setattr__(self, "kv_cache_dtype", "fp8")
        if self.kv_cache_dtype != "auto" and self.deterministic:
            raise RolloutError("--kv-cache-dtype fp8 with --deterministic: the trainer's forward keeps k/v in the "
                               "model's dtype, so the two could not agree bit for bit; drop one of the two")
        if self.speculative not in SPECULATIVE:
            raise RolloutError(f"unknown --speculative {self.speculative!r}; choose siblings or mtp (or leave it off)")
        if self.speculative is None and (self.num_draft_tokens is not None or self.speculative_max_batch is not None
                                         or not self.speculative_gate):
            raise RolloutError("--num-draft-tokens, --speculative-max-batch and --speculative-always tune speculative "
                               "decoding: give --speculative siblings or mtp too, or drop them")
        if self.num_draft_tokens is None and self.speculative is not None:
            object.__setattr__(self, "num_draft_tokens", 1 if self.speculative == "mtp" else 4)
        if self.speculative is not None and self.num_draft_tokens < 1:
            raise RolloutError("--num-draft-tokens must be at least 1")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise RolloutError("--speculative-max-batch must be at least 1 (or left out: draft at every batch size)")
        if self.speculative is not None and self.tensor_parallel_size > 1:
            raise RolloutError("--speculative runs on one GPU for now (--tp 1); drop --tp or --speculative")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise RolloutError("--max-model-len must be at least 2")
