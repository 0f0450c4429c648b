"""Draft tokens from the text of a prompt's group (`--speculative siblings`, issue 22): no extra weights.

The n samples of a prompt (a GRPO group) often say the same thing in places, and often repeat what the
prompt or they themselves wrote before (names in code, quoted passages, a pattern that recurs): a sample
about to continue an n-gram (its last `ngram` tokens) the way the group's text already continued it can be
handed that continuation as a draft, and one forward verifies it (engine/scheduling/speculation.py). Here
is only the proposing: per prompt (its samples share a group leader), an index from every n-gram of the
group's text to where it ended: in the shared prompt, and in each sample's response, its own included. A
request's draft is what followed its last n-gram the most recent time the group wrote it (a sibling that
runs ahead first, then older text, the prompt last). Finished siblings stay sources until the whole group
is done.

Plain Python over ints, like the scheduler, and run for every request of every drafting step on the host
between a step's results and the next launch: a sample's record keeps the index's entry for its last
n-gram, so proposing is one walk over a short list. The index catches up only when a step is about to
draft (catch_up), not after every step: on an H100 at 256 running, T 1, a siblings run's decode steps took
2.65 ms against 1.98 ms in the plain run (the host the limit in both) while the speculation gate kept 90% of
them plain, and indexing each sample's new token was the per-request work such a plain step added
(docs/benchmarks.md session 40). Unit-tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMPT = -1  # the source id of the group's prompt in _Group.texts (request ids are never negative)


@dataclass
class _Group:
    """One prompt's text: the prompt and its samples' responses, and the n-gram index over them."""

    texts: dict[int, list[int]] = field(default_factory=dict)  # PROMPT or a request id -> its tokens
    # n-gram -> (source, index in its text of the token after the n-gram), most recent last
    ends: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=dict)
    expected: int = 0  # samples the engine made of the prompt (SiblingDrafter.expect)
    finished: int = 0
    unindexed: list = field(default_factory=list)  # samples that ended before their last tokens were indexed


@dataclass
class _Sample:
    """A live sample's place in its group's index."""

    group: _Group
    indexed: int = -1  # the n-grams ending before response[0 .. indexed] are in the index (-1: none yet)
    tail: list[tuple[int, int]] | None = None  # group.ends' entry for the n-gram ending at `indexed`


def group_key(request) -> int:
    """The samples of one prompt share their group leader (the sample that computes the prompt first,
    engine/scheduling/request_maker.py): its request id names the group. Prompt indices would not do:
    the daemon's online requests number their prompts from 0 each."""
    leader = getattr(request, "group_leader", None) or request
    return leader.request_id


class SiblingDrafter:
    """Proposes drafts for a request from the text of its prompt's group: the prompt, the siblings'
    responses and its own."""

    reads_every_step = False  # a step without drafts may be scheduled ahead (it indexes results when they come)

    def __init__(self, ngram: int = 3, max_sources: int = 4):
        if ngram < 1:
            raise ValueError("ngram must be at least 1")
        self.ngram = ngram
        self.max_sources = max_sources  # occurrences kept per n-gram: the most recent ones
        self._groups: dict[int, _Group] = {}
        self._samples: dict[int, _Sample] = {}  # request id -> its record, while it lives

    def catch_up(self, requests) -> None:
        """Before a drafting step: index what the running `requests` and their groups' ended samples wrote
        since they were last indexed."""
        for request in requests:
            group = self.observe(request).group
            if group.unindexed:
                for ended in group.unindexed:
                    self.observe(ended)
                    del self._samples[ended.request_id]
                group.unindexed.clear()

    def observe(self, request) -> _Sample:
        """Index the response tokens `request` appended since the last call (at its first call, the
        group's prompt too if it is the group's first sample, and the prompt's last n-gram, after which
        every sample's response starts) -> its record. Runs for every request of every drafting step: the
        loop is tight."""
        rid, response, n = request.request_id, request.output_token_ids, self.ngram
        sample = self._samples.get(rid)
        if sample is None:
            sample = self._samples[rid] = self._join(request)
        group = sample.group
        ends, keep, end = group.ends, self.max_sources, sample.indexed
        seen = sample.tail
        for end in range(end + 1, len(response) + 1):  # the n-gram ending before response[end]
            # past the first n tokens the window lies inside the response (the common case, inline)
            window = tuple(response[end - n:end]) if end >= n else self._last_ngram(request.prompt_token_ids,
                                                                                 response, end)
            if window is None:
                seen = None
                continue
            seen = ends.get(window)
            if seen is None:
                seen = ends[window] = [(rid, end)]
            else:
                seen.append((rid, end))
                if len(seen) > keep:
                    del seen[0]
        sample.indexed, sample.tail = end, seen
        return sample

    def _join(self, request) -> _Sample:
        """A sample's first observe: its group (made here if `expect` did not), the prompt's n-grams
        indexed by the group's first sample, its response registered as a source (the live list)."""
        group = self._groups.setdefault(group_key(request), _Group())
        if PROMPT not in group.texts:
            prompt = group.texts[PROMPT] = request.prompt_token_ids
            for end in range(self.ngram, len(prompt)):  # the prompt's tail n-gram ends in the response
                group.ends.setdefault(tuple(prompt[end - self.ngram:end]), []).append((PROMPT, end))
            for seen in group.ends.values():
                del seen[:-self.max_sources]
        group.texts[request.request_id] = request.output_token_ids
        return _Sample(group)

    def propose(self, request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens the group's text holds after `request`'s last n-gram ([] if none)."""
        if max_tokens <= 0:
            return []
        response = request.output_token_ids
        sample = self._samples.get(request.request_id)
        if sample is not None and sample.indexed == len(response):
            group, seen = sample.group, sample.tail or ()  # observed up to now: its entry is at hand
        else:
            group = self._groups.get(group_key(request))
            if group is None:
                return []
            seen = group.ends.get(self._last_ngram(request.prompt_token_ids, response, len(response)), ())
        texts = group.texts
        for source, end in reversed(seen):
            draft = texts[source][end:end + max_tokens]  # a slice: a new list; empty at a text's own end
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
        samples stay sources till then, their last tokens indexed at the group's next catch_up)."""
        key = group_key(request)
        group = self._groups.get(key)
        if group is None:
            self._samples.pop(request.request_id, None)
            return
        group.finished += 1
        if group.finished < group.expected:
            group.unindexed.append(request)
            return
        for ended in group.unindexed + [request]:
            self._samples.pop(ended.request_id, None)
        del self._groups[key]

    def verified(self, entry) -> None:  # a verify entry's drafts (observe indexes what it kept)
        pass

    def __len__(self) -> int:
        return len(self._groups)
