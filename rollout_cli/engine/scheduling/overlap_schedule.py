"""Overlap scheduling: the next decode step planned while the current one runs on the GPU.

A mixin of engine.scheduler.Scheduler (it uses the scheduler's queues, allocator and stats). The
engine loop (engine/engine.py `_stream`) calls schedule_ahead(prev) with the step in flight,
launches the result behind it, post-processes `prev`, then commit_ahead; if the launch or the job
fails in between, cancel_ahead gives the slots back.
"""

from __future__ import annotations

from rollout_cli.engine.scheduling.request import RequestStatus
from rollout_cli.engine.scheduling.schedule_output import PENDING, BatchEntry, ScheduleOutput


class OverlapScheduling:
    def schedule_ahead(self, prev: ScheduleOutput) -> ScheduleOutput | None:
        """The decode step after `prev`, planned before `prev`'s tokens are known; None when the next
        step needs `prev`'s results to be planned (then: postprocess, then schedule()).

        Only the steady state qualifies: `prev` decoded (past its prompt) every running request, each one continues
        with one token at the next position (input: `prev`'s sampled token, PENDING until then), and
        no waiting request could be admitted instead. Requests that `prev` ends by length are left
        out; one that `prev` ends by eos cannot be foreseen: its entry becomes a ghost in
        commit_ahead. Nothing here preempts or evicts: short of free slots, None. Call
        commit_ahead(result) after postprocess(prev)."""
        # speculation: how many tokens a verify step keeps is known only after it; the next step drafts; or
        # the drafter must see every step's results before the next one runs (the MTP head)
        if self.drafter is not None and (self.drafter.reads_every_step or self.drafting_now()
                                         or any(e.num_draft for e in prev.entries)):
            return None
        entries = prev.entries
        # True decodes only: a prompt's last token publishes the prompt into the radix cache in
        # postprocess, which may swap its slots for the tree's (the next step then rewrites its table)
        if not entries or any(e.num_new_tokens != 1 or e.start < e.request.num_prompt_tokens for e in entries):
            return None
        live = [(row, e.request) for row, e in enumerate(entries)
                if not e.ghost and e.request.status is RequestStatus.RUNNING]
        if len(live) != len(self.running):
            return None
        continuing = [(row, r) for row, r in live if not r.finishes_by_length_after_next_token()]
        if not continuing or self.allocator.num_free < len(continuing):
            return None
        if self.waiting and (len(continuing) < len(live) or len(self.running) < self.max_running) \
                and not self.holds_admission(len(continuing), ahead=True):
            return None  # a finishing request frees room (or there is room): admit through schedule()
        slots = self.allocator.allocate(len(continuing))
        out = ScheduleOutput()
        for (row, request), slot, e in zip(continuing, slots, (entries[row] for row, _ in continuing)):
            start = e.start + 1
            out.entries.append(BatchEntry(request, request.table_row, start, [PENDING], start, [slot], True,
                                          source_row=row))
        if self.linear is not None:
            out.state_copies = self.linear.take_copies()
        return out

    def commit_ahead(self, out: ScheduleOutput) -> None:
        """After postprocess(prev): entries of requests that finished in `prev` turn into ghosts (their
        new slot goes back now; the in-flight step writes it before any later step can reuse it), the
        others take their slot and their now known input token."""
        for entry in out.entries:
            request = entry.request
            if request.status is not RequestStatus.RUNNING:
                entry.ghost = True
                self.allocator.free(entry.table_slots)
                continue
            assert request.num_computed_tokens == entry.start, "a step scheduled ahead lost its place"
            request.slots.append(entry.table_slots[0])
            entry.token_ids = [request.output_token_ids[-1]]
            self.stats.computed_tokens += 1

    def cancel_ahead(self, out: ScheduleOutput) -> None:
        """A step from schedule_ahead that will not be committed (its launch or the job failed): its slots go back."""
        for entry in out.entries:
            self.allocator.free(entry.table_slots)
