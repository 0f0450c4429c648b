"""The scheduler's side of the prefix cache: a request takes its cached prefix at admission (and a
hybrid model's state snapshot with it), publishes what it computed, and gives it back; the cache is
flushed when the weights change; a multi-turn conversation pins its prefix between turns
(engine/scheduling/sessions.py).

A part of Scheduler (engine/scheduling/scheduler.py), kept in its own file: it works on the scheduler's cache,
allocator, state slots and stats.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_cli.engine.scheduling.request import Request
from rollout_cli.errors import RolloutError


@dataclass(frozen=True)
class PrefixPin:
    """A cached prefix kept from eviction (Scheduler.pin_prefix): its radix node and token count."""

    node: object
    num_tokens: int
    epoch: int  # the scheduler's cache_epoch when taken


class PrefixReuse:
    """Scheduler's prefix-cache operations (a mixin: see the module docstring)."""

    def _match_cached_prefix(self, request: Request) -> int | None:
        """Take the cached prefix of a request being admitted; for hybrid models, return the
        state snapshot slot it continues from (None: nothing cached, start at position 0)."""
        first_admission = request.num_preemptions == 0
        snapshot = None
        if self.cache is not None:
            if self.linear is None:
                # At least one token must run through the model to produce logits.
                slots, node = self.cache.match_prefix(request.key_token_ids[: request.cacheable_prefix(request.num_tokens - 1)])
            else:
                slots, node, snapshot = self._match_snapshot(request)
            self.cache.lock(node)
            request.cache_node = node
            request.slots = list(slots)
            request.num_cached_tokens = request.num_computed_tokens = len(slots)
        if request.computed_before_preemption:  # back after a preemption: what the cache did not keep is redone
            self.stats.recomputed_tokens += max(0, request.computed_before_preemption - request.num_computed_tokens)
            request.computed_before_preemption = 0
        if first_admission:
            request.cached_prompt_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
            self.stats.prompt_tokens += request.num_prompt_tokens
            self.stats.cached_prompt_tokens += request.cached_prompt_tokens
        return snapshot

    def _match_snapshot(self, request: Request):
        """Hybrid models: the prompt's first len - 1 tokens, if both their KV and their state snapshot
        are cached -> (slots, radix node, snapshot slot); else, for a conversation turn, the previous
        turn's prompt but its last token (its snapshot point); else nothing -> ([], root, None)."""
        ends = [request.cacheable_prefix(request.num_prompt_tokens - 1)]
        if request.conversation:
            ends.append(min(request.conversation - 1, ends[0]))
        for end in ends:
            if end <= 0:
                continue
            prefix = request.prompt_key_ids[:end]
            slots, node = self.cache.match_prefix(prefix)
            if len(slots) == end:
                snapshot = self.linear.lookup(prefix, node)
                if snapshot is not None:
                    return slots, node, snapshot
        return [], self.cache.root, None

    def _snapshots_prompt(self, request: Request) -> bool:
        """Whether this request's prompt state is worth a snapshot: hybrid, prefix cache on, and other
        samples of the prompt (n > 1) or the conversation's next turn will fork it."""
        return (self.linear is not None and self.cache is not None
                and (request.params.n > 1 or request.conversation is not None)
                and request.num_prompt_tokens > 1 and not request.is_scoring)

    def _stop_at_snapshot(self, request: Request, count: int) -> int:
        """Cut a prefill chunk at the snapshot point (len(prompt) - 1) so the state there can be copied."""
        end = request.num_prompt_tokens - 1
        if request.num_computed_tokens < end and self._snapshots_prompt(request):
            return min(count, end - request.num_computed_tokens)
        return count

    def _release_cached_prefix(self, request: Request) -> None:
        if request.num_preemptions == 0:
            self.stats.prompt_tokens -= request.num_prompt_tokens
            self.stats.cached_prompt_tokens -= request.cached_prompt_tokens
            request.cached_prompt_tokens = 0
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
        request.cache_node = None
        request.slots = []
        request.num_cached_tokens = request.num_computed_tokens = 0

    def _cache_computed(self, request: Request, upto: int) -> None:
        """Move the request's first `upto` computed tokens into the radix cache."""
        if self.cache is None:
            return
        tokens = request.key_token_ids[:upto]
        already = self.cache.insert(tokens, request.slots[:upto])
        tree_slots, node = self.cache.match_prefix(tokens)
        duplicates = [
            mine for mine, theirs in zip(request.slots[request.num_cached_tokens:already],
                                          tree_slots[request.num_cached_tokens:already]) if mine != theirs
        ]
        if duplicates:
            self.allocator.free(duplicates)
            first_changed = next(
                i for i in range(request.num_cached_tokens, already) if request.slots[i] != tree_slots[i]
            )
            request.num_slots_in_table = min(request.num_slots_in_table, first_changed)
        request.slots[:upto] = tree_slots
        self.cache.lock(node)
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
        request.cache_node = node
        request.num_cached_tokens = upto

    def flush_cache(self) -> None:
        """Drop every cached prefix (their KV was computed by weights that are changing, or its memory
        is being released). Refused while requests run: they hold cached prefixes (waiting ones hold
        nothing, retracted ones included)."""
        if self.running:
            raise RolloutError("cannot flush the prefix cache while requests are in flight; abort or let them finish")
        if self.cache is not None:
            self.cache.reset()  # pins go with it (PrefixPin.epoch)
            self.cache_epoch += 1
        if self.linear is not None:  # hybrid models: the prompt-state snapshots go with their KV
            self.linear.clear()

    def pin_prefix(self, tokens: list[int]) -> PrefixPin | None:
        """Keep the cached prefix of `tokens` from eviction (a conversation's KV between its turns)
        until unpin; -> the pin (how many tokens it holds), or None without a prefix cache."""
        if self.cache is None:
            return None
        slots, node = self.cache.match_prefix(tokens)
        self.cache.lock(node)
        return PrefixPin(node, len(slots), self.cache_epoch)

    def unpin(self, pin: PrefixPin | None) -> None:
        """Let a pinned prefix be evicted again (a pin from before a flush is gone already)."""
        if pin is not None and pin.epoch == self.cache_epoch:
            self.cache.unlock(pin.node)
