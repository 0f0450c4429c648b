"""Speculative decoding that changes no token (`--speculative siblings`, issue 22): the scheduler's side.

A decode step may carry, after a request's last token, `d` draft tokens (engine/scheduling/
sibling_drafts.py proposes them). The forward computes all 1 + d positions; the sampler draws a token
at each of them exactly as it would without the draft (its random stream is keyed by position, so the
token at a position is a function of that position's logits and its key); the drafts are accepted while
they equal what was drawn. The response is therefore the one decoding token by token gives, and the
logprobs are the target model's: sample-level equality, not rejection sampling's equality in
distribution. Accepted tokens keep their KV; the KV slots of rejected drafts go back. Hybrid models
keep the linear layers' state after every draft position in fork slots (BatchEntry.state_forks); the fork
after the last accepted position becomes the request's slot (no copy: the old slot goes back).

A mixin of Scheduler (its allocator, linear state slots, stats and drafter).
"""

from __future__ import annotations

from rollout_cli.engine.scheduling.draft_gate import DraftGate
from rollout_cli.engine.scheduling.request import Request
from rollout_cli.engine.scheduling.schedule_output import BatchEntry, ScheduleOutput


class Speculation:
    drafter = None  # a SiblingDrafter or MTPDrafter while speculation is on (enable_speculation)
    num_draft_tokens = 0
    max_draft_batch = None  # more running requests than this: decode steps carry no drafts
    draft_gate = None  # a DraftGate: drafts only at batch sizes where they measured faster (None: always)

    def enable_speculation(self, drafter, num_draft_tokens: int, max_batch: int | None = None,
                           gate: bool = False) -> None:
        """Propose up to `num_draft_tokens` drafts per decode with `drafter` (None: off), in steps of at
        most `max_batch` running requests (None: any); with `gate`, only at the batch sizes where
        drafting steps measured more tokens per second than plain ones (engine/scheduling/draft_gate.py)."""
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 0
        self.max_draft_batch = max_batch
        self.draft_gate = DraftGate() if gate and drafter is not None else None

    def drafting_now(self) -> bool:
        """Whether a decode step of the running requests would carry drafts: speculation is on, the
        batch is within --speculative-max-batch, and the gate (if on) found drafting faster at this batch
        size (a compute-bound step verifies drafts at a cost above the tokens they save)."""
        if self.drafter is None or (self.max_draft_batch is not None and len(self.running) > self.max_draft_batch):
            return False
        return self.draft_gate is None or self.draft_gate.should_draft(len(self.running))

    def report_decode_step(self, out: ScheduleOutput, accepted: int, seconds: float) -> None:
        """The step loop's report of a post-processed step: a decode-only step (every entry one request's
        next token, with its drafts if any) teaches the gate; `accepted` is the drafts it accepted."""
        if self.draft_gate is None or not out.entries:
            return
        if any(not e.sample or e.num_new_tokens != 1 + e.num_draft or e.score_targets is not None
               for e in out.entries):
            return  # a prefill or scoring share: not a decode step's time
        live = sum(not e.ghost for e in out.entries)
        self.draft_gate.record(len(out.entries), out.drafting, live + accepted, seconds)
        if out.drafting:
            self.stats.gate_drafting_steps += 1
        else:
            self.stats.gate_plain_steps += 1

    def _schedule_decodes_with_drafts(self, out: ScheduleOutput) -> bool:
        """The steady state with speculation: every running request decodes its last token and the drafts
        proposed for it, within the token budget and the free slots (short of slots: no drafts). A loop
        of its own, not a branch in Scheduler._schedule_all_decodes's: that one runs for every request
        of every plain decode step and stays free of per-request draft bookkeeping."""
        running = self.running
        out.drafting = True  # even where no request gets a draft: such a step is not overlapped
        budget = self.max_batch_tokens - len(running)
        self.drafter.catch_up(running)  # the drafter reads the text written since its last drafting step
        drafts = []
        for request in running:
            draft = self._draft(request, budget)
            budget -= len(draft)
            drafts.append(draft)
        if self.allocator.num_free < len(running) + sum(map(len, drafts)):
            drafts = [[] for _ in running]
        for request, draft in zip(running, drafts):
            forks = None
            if draft and self.linear is not None:  # hybrid: a state slot per draft position, or no draft
                forks = self.linear.allocate_forks(len(draft))
                draft = draft if forks is not None else []
            start = request.num_computed_tokens
            request.slots.extend(self.allocator.allocate(1 + len(draft)))
            table_start = request.num_slots_in_table
            last = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
            out.entries.append(BatchEntry(request, request.table_row, start, [last] + draft, table_start,
                                          request.slots[table_start:], True, num_draft=len(draft),
                                          state_forks=forks))
            self.stats.computed_tokens += 1 + len(draft)
        return True

    def _draft(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decode-ready request: at most num_draft_tokens, `budget`, and what its
        max_new_tokens and --max-model-len leave after the token this step samples anyway."""
        if request.params.per_token_extras or request.is_scoring:  # one row per sample there
            return []
        room = min(self.num_draft_tokens, budget, request.params.max_new_tokens - len(request.output_token_ids) - 1,
                   request.max_model_len - request.num_tokens - 1)
        return self.drafter.propose(request, room) if room > 0 else []

    def _accept_drafts(self, entry, sampled, weight_version: str) -> None:
        """Post-process a verify entry: append the drawn tokens while the drafts equal them (the first
        different one is the position's token, appended too), keep the KV of the accepted positions."""
        request = entry.request
        if entry.num_draft:
            self.drafter.verified(entry)
        rows = [next(sampled) for _ in range(1 + entry.num_draft)]
        appended = 0
        for j, (token, logprob, extras) in enumerate(rows):
            request.append_token(token, logprob, weight_version, extras)
            appended += 1
            if request.finish_reason is not None or j == entry.num_draft or token != entry.token_ids[1 + j]:
                break
        if entry.state_forks is not None:  # hybrid: the linear state after the last accepted position
            kept = appended - 1  # its fork, or (every draft accepted) the request's own slot
            if kept < entry.num_draft and request.finish_reason is None:
                # no copy: the fork holding that state becomes the request's slot, its old slot a free one
                request.state_slot, entry.state_forks[kept] = entry.state_forks[kept], request.state_slot
            for slot in entry.state_forks:
                self.linear.free(slot)
        # KV holds positions start .. start + appended - 1: the last token and the accepted drafts
        request.num_computed_tokens = entry.start + appended
        request.num_slots_in_table = request.num_computed_tokens
        if entry.shifted:
            self._ahead_step_done(request)
        kept = self._kept_slots_end(request)  # a verify step planned ahead may hold the rejected positions' slots
        rejected = request.slots[kept:]
        if rejected:
            self.allocator.free(rejected)
            del request.slots[kept:]
        if entry.num_draft:
            self.stats.verify_steps += 1
            self.stats.draft_tokens += entry.num_draft
            self.stats.accepted_draft_tokens += appended - 1
        self.stats.computed_tokens -= entry.num_new_tokens - appended  # the rejected rows

    def _sample_gone(self, request: Request) -> None:
        """A sample finished or was aborted: its group may be done with its drafts."""
        if self.drafter is not None:
            self.drafter.finished(request)
