"""One sample's response turned into text token by token, for an OpenAI request.

The daemon's online requests (the OpenAI API) stream text as it is generated. The engine ends a
sample at its stop rules itself (SamplingParams.stop, matched on the tokens' bytes:
engine/scheduling/stop_strings.py; stop_token_ids) and says which ended it (its stop_reason); the text
is cut there by engine/scheduling/stop_text.py, the rule `rollout run`'s rows are cut by, so a row and
an API answer over the same tokens hold the same text. `SampleText` is fed the sample's tokens as the engine
commits them (every step while streaming, else once at the end) and keeps
  - the text so far: each token's text appears once its bytes make whole characters (a byte-level
    BPE token may end inside a UTF-8 character; "\\ufffd" at the end means "wait for more");
  - while the sample runs, the last characters that could begin a stop string are held back from
    the stream (the token that completes a stop string arrives only with the sample's end, when the
    text is cut before it, so no streamed character is ever taken back).
"""

from __future__ import annotations

from typing import Any

from rollout_cli.engine.scheduling.stop_text import drops_last_token, text_end

REPLACEMENT = "\ufffd"  # what decode gives for bytes that do not finish a character


class SampleText:
    """The text of one sample. Fed by the engine thread (`feed`, `finish`); read by the HTTP side
    through `visible_text` once the engine thread hands the values over."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), include_stop_str: bool = False):
        self.tokenizer = tokenizer
        self.include_stop_str = include_stop_str  # SamplingParams.include_stop_str_in_output
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list = []  # per token: its position's top_logprobs pairs, or None (not asked)
        self.text = ""
        # incremental decoding (vLLM's offsets): tokens [prefix, read) were decoded into text already;
        # decoding [prefix, end) and dropping [prefix, read)'s text gives the new characters, with the
        # tokens before `read` as context (a token's text can depend on its left neighbour)
        self._prefix = 0
        self._read = 0
        self._tail_start = 0  # len(text) before the last token fed: where its characters begin at the earliest
        # characters held back while running (vLLM's stop_buffer_length): a stop string kept in the text
        # (include_stop_str) needs none, the text is only ever cut after it
        stop = tuple(s for s in stop if s)
        self._hold = 0 if include_stop_str or not stop else max(len(s) for s in stop) - 1

    def feed(self, token_ids: list[int], logprobs: list[float], tops: list | None = None) -> None:
        """Take the sample's next tokens in order (with their logprobs and, if given, top_logprobs pairs)."""
        for i, (token, logprob) in enumerate(zip(token_ids, logprobs)):
            self._append(token, logprob, tops[i] if tops else None)
            self._tail_start = len(self.text)
            self._decode_new()

    def finish(self, token_ids: list[int], logprobs: list[float], tops: list | None, finish_reason: str,
               stop_reason: str | int | None) -> None:
        """The sample ended (in the engine, by a stop rule, or aborted) with these tokens (its whole response:
        those not fed yet are taken now; `stop_reason`: the stop string or stop token id that ended it).
        Bytes left waiting for a character become text (as a full decode gives them), and the text is cut
        by the stop rule (engine/scheduling/stop_text.py)."""
        start, end = len(self.token_ids), len(token_ids)
        if drops_last_token(finish_reason, stop_reason, self.include_stop_str) and start < end:
            end -= 1  # the stop token's (or eos's) text is left out, as vLLM's detokenizer skips it
        self.feed(token_ids[start:end], logprobs[start:end], tops[start:end] if tops else None)
        if self.tokenizer is not None and self._read < len(self.token_ids):
            done = self._decode(self.token_ids[self._prefix:self._read])
            self.text += self._decode(self.token_ids[self._prefix:])[len(done):]
            self._prefix = self._read = len(self.token_ids)
        for i in range(max(start, end), len(token_ids)):
            self._append(token_ids[i], logprobs[i], tops[i] if tops else None)
        if finish_reason == "stop" and isinstance(stop_reason, str):
            self.text = self.text[:text_end(self.text, stop_reason, self._tail_start, self.include_stop_str)]

    def visible_text(self, final: bool) -> str:
        """The text a client may see now: while the sample runs, the last characters that could still
        begin a stop string are held back (they are cut if the string completes)."""
        if final or self._hold == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]

    def _append(self, token: int, logprob: float, top) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.tops.append(top)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self) -> None:
        """Decode what the last token completed."""
        if self.tokenizer is None:
            return
        done = self._decode(self.token_ids[self._prefix:self._read])
        full = self._decode(self.token_ids[self._prefix:])
        if len(full) <= len(done) or full.endswith(REPLACEMENT):
            return
        self.text += full[len(done):]
        self._prefix, self._read = self._read, len(self.token_ids)
