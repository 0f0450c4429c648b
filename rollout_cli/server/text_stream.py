"""One sample's response turned into text token by token, with an OpenAI request's stop rules.

The daemon's online requests (the OpenAI API) stream text as it is generated and may end a sample
at a stop string or a stop token id. The engine ends the sample there itself (SamplingParams.stop,
matched on the tokens' bytes: engine/scheduling/stop_strings.py); the text is this module's.
`SampleText` is fed the sample's tokens as the engine commits them (every step while streaming, else
once at the end) and keeps
  - the text so far: each token's text appears once its bytes make whole characters (a byte-level
    BPE token may end inside a UTF-8 character; "\\ufffd" at the end means "wait for more");
  - where a stop rule matched: the sample ends with the token that completed the stop string (its
    token ids keep that token, its text ends before the string, as vLLM and OpenAI return it) or
    with the stop token itself.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"  # what decode gives for bytes that do not finish a character


class SampleText:
    """The text and stop state of one sample. Fed by the engine thread (`feed`); read by the HTTP
    side through `visible_text` once the engine thread hands the values over."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), stop_token_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.stop_token_ids = stop_token_ids
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list = []  # per token: its position's top_logprobs pairs, or None (not asked)
        self.text = ""
        self.stop_reason: str | int | None = None  # the stop string or token id that ended the sample
        # incremental decoding (vLLM's offsets): tokens [prefix, read) were decoded into text already;
        # decoding [prefix, end) and dropping [prefix, read)'s text gives the new characters, with the
        # tokens before `read` as context (a token's text can depend on its left neighbour)
        self._prefix = 0
        self._read = 0
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self._checked = 0  # characters of text already searched for stop strings

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def feed(self, token_ids: list[int], logprobs: list[float], tops: list | None = None) -> int:
        """Take the sample's next tokens in order (with their logprobs and, if given, top_logprobs
        pairs), up to the one that meets a stop rule; -> how many were taken (fewer than given once
        stopped: the rest are dropped)."""
        taken = 0
        for i, (token, logprob) in enumerate(zip(token_ids, logprobs)):
            if self.stopped:
                break
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.tops.append(tops[i] if tops else None)
            taken += 1
            if token in self.stop_token_ids:
                self._decode_new()
                self.stop_reason = token
            elif self._decode_new() and self.stop:
                self._match_stop_strings()
        return taken

    def finish(self) -> None:
        """The sample ended: bytes left waiting for a character become text (as a full decode gives them)."""
        if self.tokenizer is None or self._read == len(self.token_ids) or self.stopped:
            return
        done = self._decode(self.token_ids[self._prefix:self._read])
        self.text += self._decode(self.token_ids[self._prefix:])[len(done):]
        self._prefix = self._read = len(self.token_ids)

    def visible_text(self, final: bool) -> str:
        """The text a client may see now: while the sample runs, the last characters that could still
        begin a stop string are held back (they are cut if the string completes)."""
        if final or self.stopped or self._longest_stop <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - (self._longest_stop - 1))]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self) -> bool:
        """Decode what the last token completed; -> whether text grew."""
        if self.tokenizer is None:
            return False
        done = self._decode(self.token_ids[self._prefix:self._read])
        full = self._decode(self.token_ids[self._prefix:])
        if len(full) <= len(done) or full.endswith(REPLACEMENT):
            return False
        before = len(self.text)
        self.text += full[len(done):]
        self._prefix, self._read = self._read, len(self.token_ids)
        return len(self.text) > before

    def _match_stop_strings(self) -> None:
        # only the new characters, with a stop string's length of context before them, can complete one
        window_start = max(0, self._checked - self._longest_stop + 1)
        found = None
        for stop in self.stop:
            at = self.text.find(stop, window_start)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        self._checked = len(self.text)
        if found is not None:
            self.text = self.text[: found[0]]
            self.stop_reason = found[1]
