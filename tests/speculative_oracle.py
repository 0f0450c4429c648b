"""A drafter for tests of speculative decoding (tests/e2e/test_speculative.py, the Triton backend's test):
it knows the true responses, so each case chooses exactly which drafts are right."""

from __future__ import annotations


class OracleDrafter:
    """Proposes the response a run without speculation gave for the same sample, from the request's
    position on, with the tokens `corrupt(k)` picks (k: index in the draft) replaced by a wrong one."""

    reads_every_step = False  # as SiblingDrafter

    def __init__(self, truth: dict, corrupt):
        self.truth = truth
        self.corrupt = corrupt
        self.proposed = 0

    def propose(self, request, max_tokens: int) -> list[int]:
        response = self.truth[(request.prompt_index, request.sample_index)]
        done = len(request.output_token_ids)
        draft = list(response[done:done + max_tokens])
        for k in range(len(draft)):
            if self.corrupt(k):
                draft[k] = (draft[k] + 1) % 300
        self.proposed += len(draft)
        return draft

    def catch_up(self, requests) -> None:
        pass

    def finished(self, request) -> None:
        pass

    def expect(self, prompt_index: int, count: int) -> None:
        pass

    def verified(self, entry) -> None:
        pass
