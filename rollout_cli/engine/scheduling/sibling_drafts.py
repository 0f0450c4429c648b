"""Draft tokens from sibling samples (`--speculative siblings`, issue 22): no extra weights.

The n samples of a prompt (a GRPO group) often say the same thing in places: a sample about to write what
a sibling already wrote after the same few tokens can be handed that continuation as a draft, and one
forward verifies it (engine/scheduling/speculation.py). Here is only the proposing: per prompt (its
samples share a group leader), an index
from every n-gram (the last `ngram` tokens) the group's samples produced to where it ended, in each
sample's response; a request's draft is what followed its own last n-gram the most recent time a sibling
wrote it. Finished siblings stay sources until the whole group is done.

Plain Python over ints, like the scheduler: unit-tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Group:
    """One prompt's samples: their responses (by request id) and the n-gram index over them."""

    responses: dict[int, list[int]] = field(default_factory=dict)
    indexed: dict[int, int] = field(default_factory=dict)  # request id -> response tokens indexed so far
    # n-gram -> (request id, index in its response of the token after the n-gram), most recent last
    ends: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=dict)
    expected: int = 0  # samples the engine made of the prompt (SiblingDrafter.expect)
    finished: int = 0


def group_key(request) -> int:
    """The samples of one prompt share their group leader (the sample that computes the prompt first,
    engine/scheduling/request_maker.py): its request id names the group. Prompt indices would not do:
    the daemon's online requests number their prompts from 0 each."""
    leader = getattr(request, "group_leader", None) or request
    return leader.request_id


class SiblingDrafter:
    """Proposes drafts for a request from the responses of the other samples of its prompt."""

    reads_every_step = False  # a step without drafts may be scheduled ahead (it indexes results when they come)

    def __init__(self, ngram: int = 3, max_sources: int = 4):
        if ngram < 1:
            raise ValueError("ngram must be at least 1")
        self.ngram = ngram
        self.max_sources = max_sources  # occurrences kept per n-gram: the most recent ones
        self._groups: dict[int, _Group] = {}

    def observe(self, request) -> None:
        """Index the response tokens `request` appended since the last call (and, at its first call, the
        prompt's last n-gram, after which every sample's response starts). Runs for every request of every
        verify step, on the host between the step's results and the next launch: the loop is kept tight."""
        rid, response, n = request.request_id, request.output_token_ids, self.ngram
        key = group_key(request)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group()
        group.responses[rid] = response  # the live list: later tokens show up as they come
        first = group.indexed.get(rid, -1) + 1
        ends, keep = group.ends, self.max_sources
        for end in range(first, len(response) + 1):  # the n-gram ending just before response[end]
            # past the first n tokens the window lies inside the response (the common case, inline)
            window = tuple(response[end - n:end]) if end >= n else self._last_ngram(request.prompt_token_ids,
                                                                                 response, end)
            if window is None:
                continue
            seen = ends.get(window)
            if seen is None:
                ends[window] = [(rid, end)]
            else:
                seen.append((rid, end))
                if len(seen) > keep:
                    del seen[0]
        group.indexed[rid] = len(response)

    def propose(self, request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens a sibling wrote after `request`'s last n-gram ([] if none did)."""
        group = self._groups.get(group_key(request))
        if group is None or max_tokens <= 0:
            return []
        response = request.output_token_ids
        tail = self._last_ngram(request.prompt_token_ids, response, len(response))
        for source, end in reversed(group.ends.get(tail, ())):
            if source == request.request_id:
                continue
            draft = group.responses[source][end:end + max_tokens]  # a slice: a new list
            if draft:
                return draft
        return []

    def _last_ngram(self, prompt: list[int], response: list[int], end: int) -> tuple[int, ...] | None:
        """The `ngram` tokens of prompt + response[:end] that end it (None if there are fewer)."""
        if end >= self.ngram:
            return tuple(response[end - self.ngram:end])
        need = self.ngram - end
        if need > len(prompt):
            return None
        return tuple(prompt[len(prompt) - need:]) + tuple(response[:end])

    def expect(self, leader, count: int) -> None:
        """`count` samples of a prompt were queued, `leader` the first of them: their group lives until they
        have all ended."""
        self._groups.setdefault(group_key(leader), _Group()).expected += count

    def finished(self, request) -> None:
        """A sample ended (or was aborted); the group is dropped once every expected one has (finished
        samples stay sources till then)."""
        key = group_key(request)
        group = self._groups.get(key)
        if group is None:
            return
        group.finished += 1
        if group.finished >= group.expected:
            del self._groups[key]

    def __len__(self) -> int:
        return len(self._groups)
