"""Per-job sampling settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollout_cli.errors import RolloutError

LOGPROBS_MODES = ("processed", "raw")
# A sample's random stream is keyed by the seed's 64 bits (kernels/sampling_ref.as_int64_key): a seed
# outside [0, 2^64) would be taken modulo 2^64, silently the same stream as another seed (-1 as 2^64 - 1).
SEED_LIMIT = 1 << 64


def check_seed(seed: int, name: str = "--seed") -> None:
    """Refuse (RolloutError) a seed outside [0, 2^64)."""
    if not 0 <= seed < SEED_LIMIT:
        shown = str(seed) if len(str(seed)) <= 40 else f"{str(seed)[:20]}... ({len(str(seed))} digits)"
        raise RolloutError(f"{name} {shown} is out of range: a seed keys each sample's random stream as 64 bits; "
                           "give an integer in [0, 2^64 - 1]")


MAX_STOP_TOKEN_IDS = 1024  # a request body or manifest never carries a megabyte of them


def check_stop_token_ids(ids) -> tuple[int, ...]:
    """--stop-token-ids as a tuple of non-negative ints (a JSON list or a manifest's becomes one), or one line."""
    if isinstance(ids, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise RolloutError(f"--stop-token-ids must be token ids (integers >= 0), got {ids!r}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RolloutError(f"--stop-token-ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    return tuple(ids)


MAX_STOP_STRINGS = 64  # vLLM takes any number; a manifest, a request body, a per-token check stay small
MAX_STOP_CHARS = 256


def check_stop(stop) -> tuple[str, ...]:
    """--stop as a tuple of strings (one string, a JSON list or a manifest's becomes one), or one line."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RolloutError(f"--stop takes strings, got {_clip(repr(stop))}")
    if len(stop) > MAX_STOP_STRINGS:
        raise RolloutError(f"--stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}; keep the ones the "
                           "model writes")
    for s in stop:
        if not s:
            raise RolloutError("--stop takes non-empty strings: an empty one would match before any token; drop it")
        if len(s) > MAX_STOP_CHARS:
            raise RolloutError(f"--stop {_clip(repr(s))} has {len(s)} characters; a stop string has at most "
                               f"{MAX_STOP_CHARS}")
        try:
            s.encode("utf-8")  # matched as UTF-8 bytes (engine/scheduling/stop_strings.py)
        except UnicodeEncodeError:
            raise RolloutError(f"--stop {_clip(repr(s))} is not valid Unicode text (a lone surrogate); "
                               "pass text the model can write") from None
    return tuple(stop)


def _clip(text: str, most: int = 60) -> str:
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled; one set per job, shared by all its prompts."""

    n: int = 1
    """Samples per prompt."""
    max_new_tokens: int = 256
    """Longest response in tokens (finish_reason `length` when reached)."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; 0 disables."""
    seed: int = 0
    """Each sample's random stream is keyed by (seed, prompt_index, sample_index, position); in [0, 2^64)."""
    ignore_eos: bool = False
    """Keep generating past eos tokens until max_new_tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Also end a sample (finish_reason stop) at any of these token ids, kept as its last token, with or
    without ignore_eos (vLLM's stop_token_ids)."""
    stop: tuple[str, ...] = ()
    """Also end a sample (finish_reason stop) with the token that completes any of these strings in the
    response's text, kept as its last token (vLLM's stop; matched on bytes: engine/scheduling/stop_strings.py);
    at most 64, each non-empty and at most 256 characters."""
    include_stop_str_in_output: bool = False
    """Keep the stop string (through its end) in the response's text, and the text of a stop token id or
    eos, as vLLM's flag of that name; by default the text ends before them (scheduling/stop_text.py).
    The token ids keep the token either way."""
    logprobs_mode: str = "processed"
    """processed: log_softmax(logits / temperature) renormalised over the tokens top_k / top_p / min_p keep
    (the distribution the token was drawn from); raw: log_softmax(logits)."""
    top_logprobs: int = 0
    """Also the K most likely tokens and their logprobs (in logprobs_mode) at every sampled position
    (OpenAI's top_logprobs); 0 = off. Steps holding such a sample run without CUDA graphs."""
    return_sampling_mask: bool = False
    """Also the ids of the tokens top_k / top_p / min_p kept at every sampled position: the set the token
    was drawn from and its processed logprob is renormalised over, which a trainer replays (DeepSeek-V3.2's
    "keep sampling mask"). Needs temperature > 0 and a filter. Steps holding such a sample run without
    CUDA graphs."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise RolloutError("--n must be at least 1")
        if self.max_new_tokens < 1:
            raise RolloutError("--max-new-tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RolloutError(f"--temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RolloutError("--top-p must be in (0, 1]")
        if self.top_k < 0:
            raise RolloutError("--top-k must be >= 0 (0 disables it)")
        if not 0.0 <= self.min_p < 1.0:
            raise RolloutError("--min-p must be in [0, 1)")
        if self.top_logprobs < 0:
            raise RolloutError("top_logprobs must be >= 0 (0 disables it)")
        if self.return_sampling_mask and self.temperature == 0.0:
            raise RolloutError("--sampling-mask needs --temperature > 0: greedy decoding draws from no kept set")
        if self.return_sampling_mask and not self.filters:
            raise RolloutError("--sampling-mask records the tokens --top-k / --top-p / --min-p keep; set one of "
                               "them (without a filter every token is kept)")
        check_seed(self.seed)
        object.__setattr__(self, "stop_token_ids", check_stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "stop", check_stop(self.stop))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise RolloutError(f"unknown --logprobs-mode {self.logprobs_mode!r}; choose processed or raw")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters(self) -> bool:
        """Whether top_k, top_p or min_p cuts the distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def per_token_extras(self) -> bool:
        """Whether each sampled position also reports a top list or a sampling mask: eager steps, one
        sampled row per sample (no CUDA graphs, no drafts)."""
        return self.top_logprobs > 0 or self.return_sampling_mask
