"""Room for the tokens running requests will still generate, kept free once the KV pool has run short.

Admission is optimistic: a waiting request joins once its prompt fits (one free slot kept per running
request), which holds nothing back while the pool is large enough for the work. Once a step had to
preempt (the running requests outgrew the pool), optimistic admission thrashes: the preempted request is
re-admitted as soon as slots free, recomputes its prompt and response, grows, and pushes the next one out.
On the CPU (`rollout bench --model recipes/example_model --device cpu --num-prompts 32 --input-len 64
--output-len-range 64 512 --kv-cache-tokens 3000 --max-model-len 1024`) that was 247 preemptions and
17,822 tokens recomputed for 9,400 generated.

So after a preemption a waiting request is admitted only while the pool also holds `ratio` x the tokens
each running request (and the newcomer) may still generate, SGLang's new_token_ratio: at a preemption the
ratio becomes the share of their token budgets the running requests had used so far plus MARGIN_STEPS
tokens each (how much of its budget a request is likely to use), and it decays back to 0 (optimistic
again) over DECAY_STEPS decode steps, so a pool that stopped running short holds nothing back for long.
Counts tokens and steps, never time: a rerun schedules the same steps.
"""

from __future__ import annotations

CLIP_NEW_TOKENS = 4096  # a request's remaining budget counted at most this many (a 32k cap must not block admission)
MARGIN_STEPS = 20  # tokens per running request added to the used share when the ratio is set
DECAY_STEPS = 600  # decode steps for the ratio to decay from where a preemption set it back to 0


def remaining_tokens(request) -> int:
    """Tokens the request may still generate (0 for scoring requests), clipped at CLIP_NEW_TOKENS."""
    if request.is_scoring:
        return 0
    left = min(request.params.max_new_tokens - len(request.output_token_ids), request.max_model_len - request.num_tokens)
    return max(0, min(left, CLIP_NEW_TOKENS))


class DecodeReserve:
    def __init__(self):
        self.ratio = 0.0  # share of the running requests' remaining budgets kept free; 0: optimistic admission
        self._decay = 0.0  # subtracted from the ratio per decode step

    def preempted(self, running) -> None:
        """A step preempted: from now on keep room for the share of their budgets requests turn out to use."""
        used = sum(len(r.output_token_ids) for r in running)
        budget = sum(min(r.params.max_new_tokens, CLIP_NEW_TOKENS) for r in running if not r.is_scoring)
        if budget:
            self.ratio = max(self.ratio, min(1.0, (used + MARGIN_STEPS * len(running)) / budget))
            self._decay = self.ratio / DECAY_STEPS

    def decode_step_done(self) -> None:
        self.ratio = max(0.0, self.ratio - self._decay)

    def reserved(self, requests) -> int:
        """KV slots kept for the tokens these requests may still generate."""
        if self.ratio == 0.0:
            return 0
        return int(sum(remaining_tokens(r) for r in requests) * self.ratio)

    def admits(self, request, uncomputed: int, reserved: int, available: int) -> bool:
        """Whether `request`, with `uncomputed` tokens to compute, fits beside the running requests' reserve
        (`reserved` slots of `available`)."""
        if self.ratio == 0.0:
            return True
        return uncomputed + int(remaining_tokens(request) * self.ratio) + reserved <= available
