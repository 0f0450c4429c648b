"""Continuous-batching scheduler: which requests run this step, with how many tokens.

Plain Python over ints and lists. One step has a token budget
(`max_batch_tokens`): running requests go first (a decode costs one token,
an unfinished prefill takes a chunk), then waiting requests are admitted
while budget, request rows and KV slots last. When the KV pool runs out the
newest running request is preempted: its computed tokens go into the radix
cache (so recomputing them is cheap if they survive eviction), it gives up
its slots, and it waits again at the front of the queue. Nothing is dropped.

Hybrid models (linear-attention layers) also give each running request a
state slot; their prefix sharing and its limits are in engine/scheduling/state_slots.py.
A preempted hybrid request drops its state and recomputes (from its prompt's
snapshot when one is still cached).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import repeat

from rollout_cli.engine.scheduling.admission_pacing import AdmissionPacing, PacedAdmission
from rollout_cli.engine.scheduling.decode_reserve import DecodeReserve
from rollout_cli.engine.scheduling.kv_slots import SlotAllocator
from rollout_cli.engine.scheduling.overlap_schedule import OverlapScheduling
from rollout_cli.engine.scheduling.prefix_reuse import PrefixReuse
from rollout_cli.engine.scheduling.radix_cache import RadixCache
from rollout_cli.engine.scheduling.request import Request, RequestStatus
from rollout_cli.engine.scheduling.schedule_output import BatchEntry, ScheduleOutput
from rollout_cli.engine.scheduling.speculation import Speculation
from rollout_cli.engine.scheduling.state_slots import LinearStateSlots
from rollout_cli.engine.scheduling.verify_ahead_plan import VerifyAhead
from rollout_cli.errors import RolloutError


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    cached_prompt_tokens: int = 0  # of those, served by the prefix cache
    computed_tokens: int = 0  # tokens run through the model, recomputes included
    preemptions: int = 0
    # tokens preempted requests computed again after re-admission (what they had computed, less what the
    # prefix cache gave back): the price of preemption
    recomputed_tokens: int = 0
    peak_running: int = 0  # the most requests running at once
    # speculative decoding (speculation.py): request-steps that verified drafts, their drafts, those accepted
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # with the speculation gate on (engine/scheduling/draft_gate.py): decode-only steps it let draft, and not
    gate_drafting_steps: int = 0
    gate_plain_steps: int = 0
    verify_ahead_steps: int = 0  # verify steps planned ahead of the one in flight (verify_ahead_plan.py)
    admission_held_steps: int = 0  # decode steps that left waiting requests out though seats were free (pacing)

    @property
    def acceptance_length(self) -> float | None:
        """Tokens a verifying request gained per step (1 + accepted drafts), None without speculation."""
        return 1 + self.accepted_draft_tokens / self.verify_steps if self.verify_steps else None

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler(PrefixReuse, OverlapScheduling, VerifyAhead, Speculation, PacedAdmission):
    """The steps of the engine loop; schedule_ahead (planning the next decode step while one runs) is in
    engine/scheduling/overlap_schedule.py (verify steps: verify_ahead_plan.py), the prefix cache's side (matching,
    publishing, flushing, pinning) in prefix_reuse.py, when waiting requests join decode steps (holds_admission,
    report_step) in admission_pacing.py."""

    def __init__(
        self,
        num_kv_slots: int,
        max_running: int,
        max_batch_tokens: int,
        enable_prefix_cache: bool = True,
        linear_state_slots: int | None = None,
        admission_pacing: bool = True,
    ):
        """linear_state_slots: size of a hybrid model's state pool (slot 0 included); None otherwise."""
        self.allocator = SlotAllocator(num_kv_slots)
        self.linear = LinearStateSlots(linear_state_slots) if linear_state_slots else None
        self.cache = RadixCache(self.allocator) if enable_prefix_cache else None
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # False under the daemon's pause finish: no request starts; those that ran before (preempted
        # or retracted, num_preemptions > 0) still come back, so the running ones can finish
        self.admit_new = True
        self._free_rows = list(range(max_running - 1, -1, -1))
        self.stats = SchedulerStats()
        self.cache_epoch = 0  # bumped by every flush: pins taken before it hold nothing
        self.pacing = AdmissionPacing(admission_pacing)  # when waiting requests join graph-replayed decodes
        self.reserve = DecodeReserve()  # room kept for running requests' tokens once the pool ran short

    # ---- queue -------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.arrival_time = time.monotonic()
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- KV slots ----------------------------------------------------------

    def _available_slots(self) -> int:
        return self.allocator.num_free + (self.cache.evictable_size if self.cache else 0)

    def _allocate(self, count: int) -> list[int] | None:
        if self.allocator.num_free < count and self.cache is not None:
            self.cache.evict(count - self.allocator.num_free)
        if self.allocator.num_free < count:
            return None
        return self.allocator.allocate(count)

    # ---- one step ----------------------------------------------------------

    def schedule(self) -> ScheduleOutput:
        out = self._schedule()
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))  # admission happens here
        if self.linear is not None:
            out.state_copies = self.linear.take_copies()
        return out

    def _schedule(self) -> ScheduleOutput:
        out = ScheduleOutput()
        budget = self.max_batch_tokens
        if self._schedule_all_decodes(out):
            budget -= out.num_tokens  # drafts included
            if self.holds_admission(len(self.running)):
                return out  # graph-replayed decodes go on; the waiting join a few steps later, together
            self._admit(out, budget)
            return out
        scheduled: set[int] = set()
        preemptions_before = self.stats.preemptions
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            count = self._stop_at_snapshot(request, min(request.num_uncomputed_tokens, budget))
            slots = self._allocate_or_preempt(request, count, scheduled)
            if slots is None:  # `request` itself was preempted
                continue
            out.entries.append(self._entry(request, count, slots))
            scheduled.add(request.request_id)
            budget -= count
        if self.stats.preemptions == preemptions_before:  # else the victim, now first in line, is re-admitted at once
            self._admit(out, budget)
        return out

    def _schedule_all_decodes(self, out: ScheduleOutput) -> bool:
        """Fast path of the steady state (every running request decodes one token, a free slot for each): the
        general loop's result, fewer calls."""
        running = self.running
        if not running or len(running) > self.max_batch_tokens or self.allocator.num_free < len(running):
            return False
        for request in running:
            if request.num_computed_tokens + 1 != len(request.prompt_token_ids) + len(request.output_token_ids):
                return False
            if request.score_from is not None:  # scoring requests never sample: the general path scores them
                return False
        if self.drafting_now():
            return self._schedule_decodes_with_drafts(out)
        slots = self.allocator.allocate(len(running))
        entries = out.entries
        for request, slot in zip(running, slots):
            start = request.num_computed_tokens
            request.slots.append(slot)
            table_start = request.num_slots_in_table
            last = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
            entries.append(BatchEntry(request, request.table_row, start, [last], table_start,
                                      request.slots[table_start:], True))
        self.stats.computed_tokens += len(running)
        return True

    def _allocate_or_preempt(self, request: Request, count: int, scheduled: set[int]) -> list[int] | None:
        while True:
            slots = self._allocate(count)
            if slots is not None:
                return slots
            victims = [r for r in self.running if r.request_id not in scheduled and r is not request]
            victim = victims[-1] if victims else request
            if victim is request and len(self.running) == 1 and not scheduled:
                raise RolloutError(
                    f"the KV cache ({self.allocator.num_slots - 1} tokens) cannot hold one request of "
                    f"{request.num_tokens} tokens; raise --kv-memory-fraction / --kv-cache-tokens or lower --max-model-len"
                )
            self.preempt(victim)
            if victim is request:
                return None

    def _admit(self, out: ScheduleOutput, budget: int) -> None:
        # Keep one free slot per running request so the next decode step need not preempt (and, once a
        # step had to preempt, room for the tokens they may still generate: decode_reserve.py).
        reserved = self.reserve.reserved(self.running)
        for request in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_running:
                return
            if not self.admit_new and request.num_preemptions == 0:
                continue
            leader = request.group_leader
            if leader is not None and leader.status is RequestStatus.RUNNING and not leader.prompt_computed:
                continue  # wait for the sibling computing our prompt; we then hit the cache
            if self.linear is not None and self.linear.num_available == 0:
                return  # every state slot is held by a running request
            snapshot = self._match_cached_prefix(request)
            available = self._available_slots() - len(self.running)
            if self.running and not self.reserve.admits(request, request.num_uncomputed_tokens, reserved, available):
                self._release_cached_prefix(request)
                return
            # A prompt larger than the free pool starts with a smaller chunk; it grows
            # (preempting newer requests if needed) on later steps.
            count = min(request.num_uncomputed_tokens, budget, self._available_slots() - len(self.running))
            count = self._stop_at_snapshot(request, count)
            if count <= 0:
                self._release_cached_prefix(request)
                return
            slots = self._allocate(count)
            assert slots is not None
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.table_row = self._free_rows.pop()
            request.num_slots_in_table = 0
            if self.linear is not None:
                request.state_slot = self.linear.allocate()
                if snapshot is not None:
                    self.linear.fork(snapshot, request.state_slot)
            self.running.append(request)
            out.entries.append(self._entry(request, count, slots))
            self.pacing.admitted()
            reserved += self.reserve.reserved([request])
            budget -= count

    def _entry(self, request: Request, count: int, new_slots: list[int]) -> BatchEntry:
        start = request.num_computed_tokens
        request.slots.extend(new_slots)
        table_start = request.num_slots_in_table
        self.stats.computed_tokens += count
        entry = BatchEntry(
            request=request,
            table_row=request.table_row,
            start=start,
            token_ids=request.tokens_between(start, start + count),
            table_start=table_start,
            table_slots=request.slots[table_start : start + count],
            sample=start + count == request.num_tokens and not request.is_scoring,
        )
        if request.is_scoring:  # rows from position score_from - 1 on, but the last token (no next one)
            first, end = max(start, request.score_from - 1), min(start + count, request.num_tokens - 1)
            if first < end:
                entry.score_first_row = first - start
                entry.score_targets = request.tokens_between(first + 1, end + 1)
        return entry

    # ---- after the forward -------------------------------------------------

    def postprocess(self, out: ScheduleOutput, tokens: list[int], logprobs: list[float],
                    scores: list[float] = (), score_tops: list | None = None,
                    weight_version: str = "", sample_extras: list | None = None) -> list[Request]:
        """Advance each request by its step; `tokens`/`logprobs`: one entry per sampling request, `scores` the scored
        rows' logprobs in entry order (scoring requests), `score_tops` their top-k; `weight_version`: the weights the
        step ran on; `sample_extras`: per sampling request (top list, sampling mask) (sampler.sample_extras) or None."""
        finished = []
        sampled = iter(zip(tokens, logprobs, sample_extras if sample_extras is not None else repeat(None)))
        scored = iter(zip(scores, score_tops if score_tops is not None else [None] * len(scores)))
        now = time.monotonic()
        self.settle_planned_ahead(out)  # a verify step planned ahead of the one before: its place, settled
        for entry in out.entries:
            request = entry.request
            if request.status is not RequestStatus.RUNNING:  # finished or aborted meanwhile
                if entry.ahead:  # scheduled before its request ended: a ghost, computed for nothing
                    self._drop_ghost(entry)
                for _ in range(1 + entry.num_draft if entry.sample else 0):
                    next(sampled)
                for _ in entry.score_targets or ():
                    next(scored)
                continue
            if entry.num_draft or entry.shifted:  # a decode that verified drafts (engine/scheduling/speculation.py)
                self._accept_drafts(entry, sampled, weight_version)
                if request.finish_reason is not None:
                    self._finish(request)
                    finished.append(request)
                continue
            num_prompt = len(request.prompt_token_ids)
            prompt_was_computed = request.num_computed_tokens >= num_prompt
            request.num_computed_tokens += entry.num_new_tokens
            request.num_slots_in_table = request.num_computed_tokens
            if request.num_computed_tokens == num_prompt - 1 and self._snapshots_prompt(request):
                # publish the KV of the prefix, then snapshot the state that goes with it
                self._cache_computed(request, num_prompt - 1)
                self.linear.snapshot(request.prompt_key_ids[:num_prompt - 1], request.state_slot,
                                     request.cache_node)
            if entry.sample:
                token, logprob, extras = next(sampled)
                if request.first_token_time is None:
                    request.first_token_time = now
                request.append_token(token, logprob, weight_version, extras)
            if entry.score_targets:
                first = entry.first_scored
                for i in range(len(entry.score_targets)):
                    request.scored_logprobs[first + i], top = next(scored)
                    if request.scored_top is not None:
                        request.scored_top[first + i] = top
            if request.is_scoring and request.num_computed_tokens == request.num_tokens:
                request.finish_reason = "scored"
            if request.finish_reason is not None:
                self._finish(request)
                finished.append(request)
            elif not prompt_was_computed and request.num_computed_tokens >= num_prompt:
                # Publish the prompt now so the other samples of this prompt hit the cache.
                self._cache_computed(request, request.num_prompt_tokens)
        return finished

    def _release(self, request: Request, publish: bool = True) -> None:
        """Give back the request's slots and its table row; with `publish` (and the cache on) its
        computed KV goes into the cache first, else only the slots the cache already owns stay there."""
        if self.cache is not None:
            if publish:
                self._cache_computed(request, request.num_computed_tokens)
            self.cache.unlock(request.cache_node)
            self.allocator.free(request.slots[request.num_cached_tokens:])
        else:
            self.allocator.free(request.slots)
        if self.linear is not None:
            self.linear.free(request.state_slot)
            request.state_slot = -1
        request.cache_node = None
        request.slots = []
        request.num_cached_tokens = 0
        self._free_rows.append(request.table_row)
        request.table_row = -1
        request.num_slots_in_table = 0
        self.running.remove(request)

    def _finish(self, request: Request) -> None:
        # KV slots of positions 0 .. num_tokens - 2, read by routing capture right after postprocess
        # (slots freed here are reused only by a later schedule()).
        request.final_slots = request.slots[: request.num_computed_tokens]
        self._release(request)
        request.status = RequestStatus.FINISHED
        self._sample_gone(request)

    def preempt(self, request: Request) -> None:
        self.reserve.preempted(self.running)
        request.computed_before_preemption = request.num_computed_tokens
        self._requeue(request, publish=True)
        self.stats.preemptions += 1

    def _requeue(self, request: Request, publish: bool) -> None:
        """Back to the front of the queue with its tokens and no KV (published to the cache first, or not)."""
        self._release(request, publish)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def retract_running(self) -> int:
        """Send every running request back to the front of the queue with its response so far and no
        KV: the weights are about to change under it (pause keep + update). Unlike preempt, its KV is
        freed, not cached, since it came from the old weights; on admission it recomputes prompt and
        response on the new ones and samples on from there. -> how many were retracted."""
        retracted = list(self.running)
        for request in reversed(retracted):  # appendleft: the oldest ends first in line, as it was
            self._requeue(request, publish=False)
        return len(retracted)

    def abort(self, requests) -> None:
        """Finish these unfinished requests now ("abort" unless a reason was set): running ones give
        back their slots and table row (their computed KV goes to the prefix cache), waiting ones leave
        the queue. A step in flight skips them when post-processed (they are no longer RUNNING)."""
        leaving = set()
        for request in requests:
            if request.status is RequestStatus.RUNNING:
                self._release(request)
            elif request.status is RequestStatus.WAITING:
                leaving.add(request)
            else:
                continue
            request.status = RequestStatus.FINISHED
            request.finish_reason = request.finish_reason or "abort"
            self._sample_gone(request)
        if leaving:  # one pass over the queue, not one per request
            self.waiting = deque(r for r in self.waiting if r not in leaving)

    def abort_all(self) -> None:
        """Drop every unfinished request, giving back its slots and table row (waiting ones hold none)."""
        self.abort(list(self.running) + list(self.waiting))
        self.verify_ahead_in_flight = 0  # a step planned ahead in an abandoned stream is never post-processed
