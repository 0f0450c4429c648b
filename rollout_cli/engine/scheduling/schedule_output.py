"""What the scheduler hands the model runner for one step: the batch entries, one per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_cli.engine.scheduling.request import Request


@dataclass(slots=True)
class BatchEntry:
    """One request's share of a forward step (slots=True: hundreds are built per step)."""

    request: Request
    table_row: int
    start: int  # first position computed this step (== num_computed_tokens before the step)
    token_ids: list[int]  # tokens at positions [start, start + len(token_ids))
    table_start: int  # first position whose slot is (re)written into the req_to_token table
    table_slots: list[int]  # slots for positions [table_start, start + len(token_ids))
    sample: bool  # this step reaches the end of the request's tokens: sample the next one
    num_new_tokens: int = -1  # len(token_ids), filled in by __post_init__
    # Scheduled ahead of the previous step's results (schedule_ahead): token_ids is [PENDING], the input the
    # runner reads from its token table (engine/execution/token_table.py). A ghost: scheduled ahead for a
    # request that finished (eos) or was aborted before this step was post-processed: computed, discarded.
    ahead: bool = False
    ghost: bool = False
    # A verify step planned ahead of the verify step before it (engine/scheduling/verify_ahead_plan.py): start
    # is the lowest it can be (that step kept one token), and the device moves the entry by what it kept
    # (engine/execution/verify_ahead.py); the host settles start once that step is post-processed. token_ids:
    # [PENDING, DRAFT_AHEAD, DRAFT_LATER, ...], drawn on the device.
    shifted: bool = False
    # Scoring requests: rows score_first_row, score_first_row + 1, ... of this entry's new tokens give
    # the logprob of score_targets[0], [1], ... (the token at the next position of each row).
    score_first_row: int = 0
    score_targets: list[int] | None = None
    # Speculative decoding: the last `num_draft` of token_ids are draft tokens to verify; the entry samples
    # at its last 1 + num_draft rows (engine/scheduling/speculation.py)
    num_draft: int = 0
    # Hybrid models verifying drafts: state slots that receive the linear layers' state after each of the
    # first num_draft tokens (the state after the last one stays in the request's own slot), so the state
    # after the accepted tokens is at hand whatever is accepted (engine/execution/linear_state.py)
    state_forks: list[int] | None = None

    def __post_init__(self) -> None:
        self.num_new_tokens = len(self.token_ids)

    @property
    def first_scored(self) -> int:
        """Scoring entries: the response index of score_targets[0] (request.scored_logprobs' index)."""
        return self.start + self.score_first_row + 1 - self.request.score_from

    @property
    def new_slots(self) -> list[int]:
        """KV slots the new tokens are stored into."""
        return self.table_slots[len(self.table_slots) - self.num_new_tokens:]


PENDING = -1  # token id of an entry scheduled ahead: its row's last sampled token, read on the device
# placeholder token id of a draft position after the first under --speculative mtp: the head drafts it in
# the step itself, once the step's slots exist (engine/execution/mtp_step.MTPStep.extend_drafts)
DRAFT_LATER = -2
# input id of the first draft of a verify step planned ahead of the one in flight: the MTP head's draft after the
# token that step keeps last, read on the device (engine/execution/verify_ahead.py)
DRAFT_AHEAD = -3


@dataclass
class ScheduleOutput:
    entries: list[BatchEntry] = field(default_factory=list)
    # hybrid models: (src, dst) linear-state slot copies to apply, in order, before the forward
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # --speculative: the decode path that proposes drafts built this step (the speculation gate times it)
    drafting: bool = False
    # --speculative mtp (engine/execution/mtp_step.py): the step's final hidden states [T, H] for the head's
    # pass after post-processing, or, for a plain decode step whose pass ran right behind it on the device,
    # the head's outputs [B, H] that the next drafts are read from
    mtp_hidden: object = None
    mtp_head_out: object = None
    # a hybrid's verify graph ran the step and settled what it kept on the device (engine/execution/
    # verify_ahead.py): the next verify step may be planned before its results are read
    settled_on_device: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)
