"""The MTP head's pass after each step (`--speculative mtp`, models/mtp.py): its KV and the next draft.

After a step is post-processed the scheduler knows which of its positions hold accepted tokens (all of
a prefill chunk's, the last token and the accepted drafts of a verify step) and the token that follows
each of them (the next prompt token, or the token just sampled). For every such position q of an entry
the head runs on (target hidden state at q, token at q + 1) at position q: that stores the head's KV at
q's slot, which later positions attend to, and the prediction of the entry's newest pair is the next
draft (the token after the one just sampled: Request.mtp_draft, read by engine/scheduling/mtp_drafts.py).

One draft per request per step: drafting further would run the head at positions whose slots the next
step has not allocated yet. A draft only proposes: verification keeps the tokens those of decoding
without it (engine/scheduling/speculation.py), so a stale head state (a prefix served from the cache
whose last position was followed by another token when it was computed) can only cost acceptance.
"""

from __future__ import annotations

import torch

from rollout_cli.engine.scheduling.schedule_output import BatchEntry


class MTPStep:
    """Runs the head of `runner.model` over a post-processed step's accepted positions."""

    def __init__(self, runner):
        self.runner = runner
        self.model = runner.model

    def run(self, entries, hidden: torch.Tensor) -> None:
        """entries: the step's (in its row order); hidden [T, H]: the target's final hidden states of its
        rows. Sets Request.mtp_draft = (position, token) for every request whose newest token it read."""
        items, offset = [], 0  # (entry, first row, pairs)
        for e in entries:
            request = e.request
            if not e.ghost and request.finish_reason is None and request.score_from is None:
                # positions with accepted tokens whose next token is known
                end = min(request.num_computed_tokens, e.start + e.num_new_tokens, request.num_tokens - 1)
                if end > e.start:
                    items.append((e, offset, end - e.start))
            offset += e.num_new_tokens
        if not items:
            return
        items.sort(key=lambda item: item[2] > 1)  # one-token entries first, as the attention kernels want
        rows, positions, tokens, slots, head_entries, newest = [], [], [], [], [], []
        for e, first, pairs in items:
            request = e.request
            rows.extend(range(first, first + pairs))
            positions.extend(range(e.start, e.start + pairs))
            tokens.extend(request.tokens_between(e.start + 1, e.start + 1 + pairs))  # the token at q + 1
            slots.extend(e.new_slots[:pairs])
            # the positions' slots are in the request's table already: nothing to write there
            head_entries.append(BatchEntry(request, e.table_row, e.start, tokens[-pairs:], e.start + pairs, [], False))
            if e.start + pairs == request.num_tokens - 1:  # its last pair reads the token just sampled
                newest.append((request, len(rows) - 1))
        runner, device = self.runner, self.runner.device
        attn = runner._prepare(head_entries, runner.req_to_token, runner.kv, runner.scale,
                               torch.tensor(slots, dtype=torch.long, device=device))
        embeds = self.model.model.embed_tokens(torch.tensor(tokens, device=device))  # [M, H]
        out = self.model.mtp(embeds, hidden[torch.tensor(rows, device=device)], torch.tensor(positions, device=device),
                             attn)  # [M, H]
        if not newest:
            return
        logits = self.model.compute_logits(out[torch.tensor([row for _, row in newest], device=device)])
        for (request, _), token in zip(newest, logits.argmax(dim=-1).tolist()):
            request.mtp_draft = (request.num_tokens, token)
