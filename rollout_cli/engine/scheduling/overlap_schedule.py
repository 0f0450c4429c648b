"""Overlap scheduling: the next decode step planned while the current one runs on the GPU.

A mixin of engine.scheduler.Scheduler (it uses the scheduler's queues, allocator and stats). The
step loop (engine/step_loop.py) calls schedule_ahead(prev) with the step in flight, launches the
result behind it, then post-processes `prev`. The step ahead is an ordinary step from then on: its
slots belong to its requests at once (so a request that ends in `prev` gives its new slot back with
the others), and its input tokens (PENDING) are read on the device from the runner's token table
(engine/execution/token_table.py), where `prev` stored what it sampled. A request that `prev` ends by
eos, or that is aborted in between, leaves a ghost entry, which postprocess drops.
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
        out; one that `prev` ends by eos cannot be foreseen: its entry becomes a ghost in postprocess.
        Nothing here preempts or evicts: short of free slots, None."""
        if prev.settled_on_device:  # a verify step whose graph settled what it keeps: the next may shift
            self.settle_ahead(prev)
            return self._plan_verify_ahead(prev)
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
        live = [(row, e.request) for row, e in enumerate(entries) if e.request.status is RequestStatus.RUNNING]
        if len(live) != len(self.running):
            return None
        continuing = [(row, r) for row, r in live if not r.finishes_by_length_after_next_token()]
        if not continuing or self.allocator.num_free < len(continuing):
            return None
        if self.waiting and (len(continuing) < len(live) or len(self.running) < self.max_running) \
                and not self.holds_admission(len(continuing), ahead=True) and self._head_fits_reserve():
            return None  # a finishing request frees room (or there is room): admit through schedule()
        slots = self.allocator.allocate(len(continuing))
        out = ScheduleOutput()
        for (row, request), slot in zip(continuing, slots):
            start = entries[row].start + 1
            assert request.num_computed_tokens + 1 == start == len(request.slots), "a step ahead lost its place"
            request.slots.append(slot)
            out.entries.append(BatchEntry(request, request.table_row, start, [PENDING], start, [slot], True,
                                          ahead=True))
        self.stats.computed_tokens += len(continuing)  # a ghost gives its token back (postprocess)
        if self.linear is not None:
            out.state_copies = self.linear.take_copies()
        return out

    def _head_fits_reserve(self) -> bool:
        """Whether the first waiting request passes the decode reserve now (engine/scheduling/decode_reserve.py;
        its cached prefix looked up, not taken): if not, schedule() would admit nothing and the step ahead
        loses nothing."""
        if self.reserve.ratio == 0.0 or not self.running:
            return True
        head = self.waiting[0]
        cached = self.cache.cached_length(head.key_token_ids[: head.cacheable_prefix(head.num_tokens - 1)]) \
            if self.cache is not None else 0
        available = self._available_slots() - len(self.running)
        return self.reserve.admits(head, head.num_tokens - cached, self.reserve.reserved(self.running), available)
