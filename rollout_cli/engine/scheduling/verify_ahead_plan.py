"""Verify steps planned ahead of the verify step in flight (`--speculative mtp` on a hybrid's verify graphs).

Without this, a drafting step waits for the host: the step before must be read and post-processed before the
next one's drafts and positions are known, so the GPU idles while the host plans, and speculation loses on
a small model whose steps are short. The verify graphs settle what each step kept on the device
(engine/execution/verify_ahead.py), which lets the next step be planned as plain decode steps are
(overlap_schedule.py): each request's entry starts at the lowest position it can (the step in flight keeps
at least one token: start + 1), with token_ids [PENDING, DRAFT_AHEAD, DRAFT_LATER, ...] drawn on the device,
and is moved there by what the step in flight kept (BatchEntry.shifted).

KV slots: the step in flight holds positions start .. start + d; the step ahead may use any position up to
start + d + 1 + K' (K': its drafts). The slots of the first range stay the request's (a rejected position is
the next step's position: its slot is rewritten there), the rest are allocated here and written into
req_to_token before the launch, and the device reads the slot of each moved position from there. A request
keeps every slot up to `Request.reserved_end` while a step planned this way is in flight (ahead_steps), and
post-processing gives the rest back (Speculation._accept_drafts).

A mixin of Scheduler (its queues, allocator, linear slots, drafter and gate).
"""

from __future__ import annotations

from rollout_cli.engine.scheduling.request import RequestStatus
from rollout_cli.engine.scheduling.schedule_output import DRAFT_AHEAD, DRAFT_LATER, PENDING, BatchEntry, ScheduleOutput


class VerifyAhead:
    # the most rows a verify graph replays, when the runner settles verify steps on the device (None: it
    # does not, and no verify step is planned ahead); the engine sets it after capturing the graphs
    verify_ahead_rows: int | None = None
    verify_ahead_in_flight = 0  # steps planned here and not yet post-processed (the MTP head proposes for none)

    def settle_ahead(self, out: ScheduleOutput) -> None:
        """Once the step before `out` is post-processed: the entries of `out` planned ahead of it get the start
        the device moved them to, and their KV slots (same calls, same answer, until `out` is post-processed)."""
        for e in out.entries:
            request = e.request
            if e.shifted and request.status is RequestStatus.RUNNING:
                e.start = e.table_start = request.num_computed_tokens
                e.table_slots = request.slots[e.start:e.start + e.num_new_tokens]

    def settle_planned_ahead(self, out: ScheduleOutput) -> None:
        """At the start of post-processing `out`: if it was planned here, settle it, and it is no longer in flight."""
        if out.entries and out.entries[0].shifted:  # a step planned here is shifted throughout
            self.settle_ahead(out)
            self.verify_ahead_in_flight -= 1

    def _plan_verify_ahead(self, prev: ScheduleOutput) -> ScheduleOutput | None:
        """The verify step after `prev` (a verify step its graph settled on the device, in flight), or None
        where the next step needs prev's results: admission to do, the gate saying plain, too few free slots,
        or more rows than a verify graph replays."""
        entries = prev.entries
        if self.verify_ahead_rows is None or not self.drafting_now():
            return None
        live = [e for e in entries if e.request.status is RequestStatus.RUNNING]
        if not live or len(live) != len(self.running):
            return None
        # decodes past the prompt only: a prompt's last token publishes it into the radix cache in post-processing,
        # which may swap its KV slots for the tree's (the next step must then rewrite its table)
        if any(e.num_new_tokens != 1 + e.num_draft or e.start < e.request.num_prompt_tokens for e in live):
            return None
        if self.waiting and len(self.running) < self.max_running and not self.holds_admission(len(live), ahead=True):
            return None  # a seat is free: admit through schedule()
        plans = []  # (entry before, drafts of the step ahead)
        for e in live:
            request = e.request
            if request.params.per_token_extras or request.is_scoring:
                return None
            end = e.start + e.num_draft + 1  # the step ahead's first position is at most this
            kept_most = e.num_draft + 1  # tokens the step in flight may add: drafts fit what is left after those
            room = min(self.num_draft_tokens,
                       request.params.max_new_tokens - len(request.output_token_ids) - kept_most - 1,
                       request.max_model_len - end - 2)
            plans.append((e, max(room, 0)))
        rows = sum(1 + drafts for _, drafts in plans)
        forks = sum(drafts for _, drafts in plans)
        if rows > self.verify_ahead_rows or self.allocator.num_free < rows:  # (at most rows new KV slots)
            return None
        if self.linear is not None and self.linear.allocator.num_free < forks:
            return None
        out = ScheduleOutput(drafting=True, state_copies=self.linear.take_copies() if self.linear is not None else [])
        for e, drafts in plans:
            out.entries.append(self._entry_ahead(e, drafts))
        self.stats.computed_tokens += rows
        self.verify_ahead_in_flight += 1
        self.stats.verify_ahead_steps += 1
        return out

    def _entry_ahead(self, before: BatchEntry, drafts: int) -> BatchEntry:
        """The request's entry in the step after `before` (in flight): `drafts` drafts, KV slots for every
        position it may reach, fork slots for its drafts."""
        request = before.request
        end = before.start + before.num_draft + 1
        # positions up to end + drafts; those before len(slots) have slots in the table already (the step
        # before's, or reserved by the step planned ahead of it), the rest get theirs here
        have = len(request.slots)
        assert have >= end, "a verify step ahead lost its place"
        slots = self.allocator.allocate(max(0, end + 1 + drafts - have))
        request.slots.extend(slots)
        request.ahead_steps += 1
        request.reserved_end = max(request.reserved_end, end + 1 + drafts)
        forks = self.linear.allocate_forks(drafts) if self.linear is not None and drafts else None
        token_ids = [PENDING] + ([DRAFT_AHEAD] + [DRAFT_LATER] * (drafts - 1) if drafts else [])
        return BatchEntry(request, request.table_row, before.start + 1, token_ids, have, slots, True, ahead=True,
                          num_draft=drafts, state_forks=forks, shifted=True)

    def _drop_ghost(self, entry: BatchEntry) -> None:
        """An entry scheduled ahead for a request that ended (or was preempted) before its step was post-processed:
        a ghost, computed for nothing. Its tokens leave the count, its fork slots go back (its step ran; nothing reads
        them), and a preempted request planned ahead holds no reservation when it comes back."""
        entry.ghost = True
        self.stats.computed_tokens -= entry.num_new_tokens
        for slot in entry.state_forks or ():
            self.linear.free(slot)
        if entry.shifted:
            self._ahead_step_done(entry.request)

    @staticmethod
    def _ahead_step_done(request) -> None:
        """A step planned here for `request` was post-processed: once none is in flight, it reserves no slots."""
        request.ahead_steps -= 1
        if not request.ahead_steps:
            request.reserved_end = 0

    @staticmethod
    def _kept_slots_end(request) -> int:
        """Where the slots a request no longer needs begin: past its computed tokens, or past every position a
        verify step planned ahead and still in flight may use (reserved_end is 0 while none is)."""
        return max(request.num_computed_tokens, request.reserved_end)
