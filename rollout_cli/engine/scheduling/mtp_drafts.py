"""Drafts from the checkpoint's MTP head (`--speculative mtp`): the head's greedy guess of the token
after a request's newest one, left on the request by the runner's MTP pass (engine/execution/
mtp_step.py) after each step, then DRAFT_LATER for every further draft position: the runner's head
drafts those in the verify step itself, once the step's KV slots exist (MTPStep.extend_drafts).
Plain Python, like the rest of the scheduler."""

from __future__ import annotations

from rollout_cli.engine.scheduling.schedule_output import DRAFT_LATER


class MTPDrafter:
    # a plain decode step's head pass runs on the device right behind it (engine/execution/mtp_step.py), so
    # such a step may be followed by one scheduled ahead; steps with drafts never are (overlap_schedule.py)
    reads_every_step = False

    def propose(self, request, max_tokens: int) -> list[int]:
        """The head's draft for the request's next position, if it was made for that position, and
        max_tokens - 1 positions for the head to draft in the step."""
        draft, request.mtp_draft = request.mtp_draft, None
        if draft is None or max_tokens < 1 or draft[0] != request.num_tokens:
            return []
        return [draft[1]] + [DRAFT_LATER] * (max_tokens - 1)

    def catch_up(self, requests) -> None:  # the interface of sibling_drafts.SiblingDrafter
        pass

    def finished(self, request) -> None:
        pass

    def expect(self, request, count: int) -> None:
        pass

    def verified(self, entry) -> None:  # a verify entry's drafts, as post-processing compares them
        pass


class RecordingMTPDrafter(MTPDrafter):
    """An MTPDrafter that also records the first draft of every verify entry, as post-processing compares it:
    (prompt, sample, position) -> token in `log`, for diagnostics (scripts/diagnose_mtp.py compares the GPU's
    drafts with the CPU's) and tests. Recorded there, not in propose: a verify step planned ahead of the one
    before (engine/scheduling/verify_ahead_plan.py) gets its drafts from the head's graph on the device."""

    def __init__(self, log: dict):
        self.log = log

    def verified(self, entry) -> None:
        request = entry.request
        self.log[(request.prompt_index, request.sample_index, entry.start + 1)] = entry.token_ids[1]
