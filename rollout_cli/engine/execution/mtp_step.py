"""The MTP head's pass after each step (`--speculative mtp`, models/mtp.py): its KV and the next draft.

A plain decode step (one new token per request, no drafts) runs the pass right behind it on the device
(store_kv_on_device, or the head's CUDA graph after a replayed step: the token each row sampled is already
there), so the host needs none of its results and the next step may be planned and launched ahead of them,
as without speculation: with the speculation gate saying "plain" at large batches, most steps are these.
Its drafts are read after post-processing (drafts_from). Other steps (prefill chunks, verify steps) run it
after post-processing (run).

After a step is post-processed the scheduler knows which of its positions hold accepted tokens (all of
a prefill chunk's, the last token and the accepted drafts of a verify step) and the token that follows
each of them (the next prompt token, or the token just sampled). For every such position q of an entry
the head runs on (target hidden state at q, token at q + 1) at position q: that stores the head's KV at
q's slot, which later positions attend to, and the prediction of the entry's newest pair is the next
draft (the token after the one just sampled: Request.mtp_draft, read by engine/scheduling/mtp_drafts.py).

Longer drafts (--num-draft-tokens K > 1) chain the head as vLLM's and LightLLM's MTP do: the head's own
output at q stands in for the target's hidden state at q + 1, so (its output, draft token j) at the
next position drafts token j + 1. Those positions have no KV slots until the next step allocates its
verify rows, so the chain runs in that step, before the target's forward (extend_drafts): the scheduler
leaves DRAFT_LATER at draft positions 2..K and the head fills them in, storing its KV at those
positions' slots. Whatever verification keeps, the pass after the step rewrites the head's KV at the
accepted positions from the target's hidden states, and the rejected positions' slots go back.

A draft only proposes: verification keeps the tokens those of decoding
without it (engine/scheduling/speculation.py), so a stale head state (a prefix served from the cache
whose last position was followed by another token when it was computed) can only cost acceptance.
"""

from __future__ import annotations

import torch

from rollout_cli.engine.execution.mtp_chain import chains
from rollout_cli.engine.execution.vision_step import step_positions_and_images
from rollout_cli.engine.scheduling.schedule_output import BatchEntry
from rollout_kernels.host_to_device import to_device


class MTPStep:
    """Runs the head of `runner.model` over a post-processed step's accepted positions."""

    def __init__(self, runner):
        self.runner = runner
        self.model = runner.model
        self.drafting = True  # the scheduler has an MTP drafter (after_step says; `rollout bench` times without)

    def at_launch(self, out, hidden: torch.Tensor, tokens, head_graph=None) -> None:
        """A step just launched with its final hidden states [T, H]: a plain decode step (each entry one
        sampled token past its prompt, no drafts) runs the pass behind it now, on the tokens it sampled
        (`tokens()` [B] on the device), by `head_graph()` where the step replayed a graph
        (DecodeGraphs.run_head); so does a verify step that replayed one (every row, on the tokens sampled
        there: DecodeGraphs._head_forward); any other step keeps its hidden states for after_step."""
        decoded = all(e.num_new_tokens == 1 + e.num_draft and e.sample and e.score_targets is None
                      and e.start >= e.request.num_prompt_tokens for e in out.entries)
        plain = decoded and not any(e.num_draft for e in out.entries)
        if self.drafting and (plain or decoded and head_graph is not None):
            out.mtp_head_out = (head_graph() if head_graph is not None
                                else self.store_kv_on_device(out.entries, hidden, tokens()))
        else:
            out.mtp_hidden = hidden

    def after_step(self, out, drafting: bool, propose: bool) -> None:
        """After `out` was post-processed: the pass over its accepted positions, unless it ran at launch,
        and, if `propose`, the next drafts; nothing while `drafting` is off."""
        self.drafting = drafting
        hidden, head_out, out.mtp_hidden, out.mtp_head_out = out.mtp_hidden, out.mtp_head_out, None, None
        if not drafting:
            return
        if head_out is not None:
            if propose:
                self.drafts_from(out.entries, head_out)
        elif hidden is not None:
            self.run(out.entries, hidden, propose)

    def run(self, entries, hidden: torch.Tensor, propose: bool = True) -> None:
        """entries: the step's (in its row order); hidden [T, H]: the target's final hidden states of its
        rows; propose: draft too (else the head's KV only: the next step carries no drafts). Sets
        Request.mtp_draft = (position, token) and Request.mtp_hidden (the head's output [H]) for every
        request whose newest token it read."""
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
        rows, slots, head_entries, newest = [], [], [], []
        for e, first, pairs in items:
            request = e.request
            rows.extend(range(first, first + pairs))
            slots.extend(e.new_slots[:pairs])
            # positions start .. start + pairs - 1, each with the token at q + 1; their slots are in the
            # request's table already: nothing to write there
            next_tokens = request.tokens_between(e.start + 1, e.start + 1 + pairs)
            head_entries.append(BatchEntry(request, e.table_row, e.start, next_tokens, e.start + pairs, [], False))
            if e.start + pairs == request.num_tokens - 1:  # its last pair reads the token just sampled
                newest.append((request, len(rows) - 1))
        device = self.runner.device
        out = self._head(head_entries, hidden[torch.tensor(rows, device=device)], slots)  # [M, H]
        if not newest or not propose:
            return
        self._propose([request for request, _ in newest], out, [row for _, row in newest])

    def store_kv_on_device(self, entries, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """A plain decode step's pass: each entry's one position with (its final hidden state, hidden [B, H]
        in entry order; the token the step sampled there, tokens [B] on the device). Stores the head's KV at
        the entries' slots -> the head's outputs [B, H] (drafts_from reads the drafts once post-processed).
        Rows that turn out to be ghosts or finished write KV nobody reads."""
        head_entries = [BatchEntry(e.request, e.table_row, e.start, [0], e.start + 1, [], False) for e in entries]
        return self._head(head_entries, hidden, [e.new_slots[0] for e in entries], tokens)

    def drafts_from(self, entries, head_out: torch.Tensor) -> None:
        """After post-processing the decode step of `entries` whose pass ran at launch: the next draft of each
        request still running, from the row of its newest accepted position in the head's outputs [rows, H]
        (a plain step: row i for entry i; a verify step: the entry's last accepted row). Asked only when the
        next step drafts, which is then seldom launched ahead (schedule_ahead asks the gate too), so reading
        the drafts mostly waits for this step's pass alone."""
        requests, rows, offset = [], [], 0
        for e in entries:
            if not e.ghost and e.request.finish_reason is None:
                requests.append(e.request)
                rows.append(offset + e.request.num_computed_tokens - e.start - 1)
            offset += e.num_new_tokens
        if requests:
            self._propose(requests, head_out, rows)

    def _propose(self, requests: list, head_out: torch.Tensor, rows: list[int]) -> None:
        """Each request's draft for the position after its newest token, from its row of the head's outputs
        head_out [M, H]: Request.mtp_draft = (that position, the greedy token), mtp_hidden = the row [H]."""
        picked = head_out[to_device(rows, torch.long, head_out.device)]  # [N, H]
        for request, token, hidden in zip(requests, self._greedy(picked), picked):
            request.mtp_draft, request.mtp_hidden = (request.num_tokens, token), hidden

    def extend_drafts(self, entries) -> None:
        """Fill in the DRAFT_LATER positions of a step's verify entries, before its forward (the step's
        slots are in the req_to_token table). Pass j runs the head at position start + j - 1 on (its
        output there, draft token j) and drafts token j + 1, for every entry drafting that far."""
        chained = [e for e in entries if chains(e)]
        if not chained:
            return
        hidden = torch.stack([e.request.mtp_hidden for e in chained])  # [N, H]: the head's output before d1
        for j in range(1, max(e.num_draft for e in chained)):
            live = [i for i, e in enumerate(chained) if e.num_draft > j]
            step = [chained[i] for i in live]
            head_entries = [BatchEntry(e.request, e.table_row, e.start + j - 1, [e.token_ids[j]], e.start + j, [], False)
                            for e in step]
            rows = torch.tensor(live, device=hidden.device)
            out = self._head(head_entries, hidden[rows], [e.new_slots[j - 1] for e in step])  # [len(live), H]
            hidden = hidden.index_copy(0, rows, out)
            for e, token in zip(step, self._greedy(out)):
                e.token_ids[j + 1] = token
        for e in chained:
            e.request.mtp_hidden = None

    def _head(self, head_entries, target_hidden: torch.Tensor, slots: list[int],
              tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The head over the M rows of `head_entries` (entry e: positions e.start.., its token_ids the
        tokens after them, or `tokens` [M] on the device): (target_hidden [M, H], those tokens), its KV
        stored at `slots` [M] -> its normed output [M, H]."""
        runner, device = self.runner, self.runner.device
        # index lists go up without a host wait (rollout_kernels.host_to_device): a plain step's pass runs behind it
        attn = runner._prepare(head_entries, runner.req_to_token, runner.kv, runner.scale,
                               to_device(slots, torch.long, device))
        if tokens is None:
            tokens = to_device([t for e in head_entries for t in e.token_ids], torch.long, device)
        embeds = self.model.model.embed_tokens(tokens)  # [M, H]
        if runner.encoder_cache is None:
            positions = [p for e in head_entries for p in range(e.start, e.start + e.num_new_tokens)]
            return self.model.mtp(embeds, target_hidden, to_device(positions, torch.long, device), attn)
        # multimodal (Qwen3.5 as the hub ships it): the rotary positions of q (three per row where the step
        # holds image tokens), and where the token at q + 1 is an image token its image embedding
        rope, _ = step_positions_and_images(head_entries, runner.encoder_cache, device)
        next_tokens = [BatchEntry(e.request, e.table_row, e.start + 1, e.token_ids, e.start + 1 + e.num_new_tokens, [],
                                  False) for e in head_entries]
        _, images = step_positions_and_images(next_tokens, runner.encoder_cache, device)
        if images is not None:
            embeds[images.rows] = images.embeds.to(embeds.dtype)
        return self.model.mtp(embeds, target_hidden, rope, attn)

    def _greedy(self, out: torch.Tensor) -> list[int]:
        """The head's greedy tokens of its outputs [N, H] through the target's LM head."""
        return self.model.compute_logits(out).argmax(dim=-1).tolist()
