"""Stop strings matched inside the engine, on bytes, as each token is committed.

What counts as a match: a stop string matches when its UTF-8 bytes appear in the response's bytes,
the concatenation of each response token's bytes, and the sample ends with the token that
completed them (the first such token; the token stays the sample's last). A token's bytes are what
tokenizer.decode gives for it inside a text, before any clean-up:
  - byte-level BPE (GPT-2, Qwen, Llama 3): the token's characters mapped back through GPT-2's
    bytes_to_unicode (a token with a character outside that map is its own UTF-8, as the
    `tokenizers` ByteLevel decoder does), so a token that ends inside a UTF-8 character holds
    those bytes and the character completes with the next token;
  - SentencePiece (Llama 2, Mistral, Gemma): '▁' is a space, <0xNN> is the byte NN; a word's
    leading space counts also on the response's first token, which decode of the response alone
    drops (and where decode shows a byte group that is no UTF-8 as U+FFFD for each byte, its valid
    bytes count);
  - anything else: tokenizer.decode([id]) as UTF-8;
  - special tokens (eos, <|im_start|>, ...) and ids past the tokenizer are no bytes, as
    decode(skip_special_tokens=True) skips them; non-special added tokens (Qwen's </tool_call>)
    are their text.
For byte-level tokenizers, the response's bytes decoded as UTF-8 are decode(ids,
skip_special_tokens=True) (tests/unit/test_stop_strings.py checks every id of the example model's
tokenizer), so a match is the decoded text first containing the string. Only the response is
searched: a stop string in the prompt, or straddling prompt and response, ends nothing (vLLM's rule).

Cost per committed token of a request with stop strings: one list lookup, one bytes concatenation
of at most (longest stop - 1) + token bytes, one bytes.find per stop string over the windows that
end inside the new token; never a decode.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache

SENTENCEPIECE_SPACE = "\u2581"  # '▁'


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character that stands for each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:  # unprintable bytes take the characters from 256 on, in byte order
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def decoder_kinds(tokenizer) -> set[str]:
    """The `type`s in a fast tokenizer's decoder (a Sequence's parts too); empty for a slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    found, todo = set(), [json.loads(decoder.__getstate__())]
    while todo:
        node = todo.pop()
        found.add(node.get("type"))
        if node.get("type") == "Replace" and node.get("pattern", {}).get("String") == SENTENCEPIECE_SPACE:
            found.add("SentencePieceSpace")
        todo.extend(node.get("decoders") or [])
    return found


def token_bytes_table(tokenizer, size: int) -> list[bytes]:
    """Each token id's bytes (the rule in the module docstring), for ids [0, size)."""
    special = set(tokenizer.all_special_ids)
    special.update(i for i, added in tokenizer.added_tokens_decoder.items() if getattr(added, "special", False))
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(size, len(tokenizer)))))
    kinds = decoder_kinds(tokenizer)
    if "ByteLevel" in kinds:
        kind = "byte_level"
    elif kinds & {"ByteFallback", "Metaspace", "SentencePieceSpace"} or hasattr(tokenizer, "sp_model"):
        kind = "sentencepiece"
    else:
        kind = "decode"
    table = [b""] * size
    for i, piece in enumerate(pieces):
        if i not in special and piece is not None:
            table[i] = _spell(kind, piece, i, tokenizer)
    return table


def _spell(kind: str, piece: str, token_id: int, tokenizer) -> bytes:
    """One token's bytes from its piece (convert_ids_to_tokens) under its tokenizer's `kind` of decoder."""
    if kind == "byte_level":
        to_byte = byte_decoder()
        if all(c in to_byte for c in piece):
            return bytes(to_byte[c] for c in piece)
        return piece.encode("utf-8")  # an added token written as text (`tokenizers`' ByteLevel decoder's rule)
    if kind == "sentencepiece":
        return _sentencepiece_bytes(piece)
    return tokenizer.decode([token_id], skip_special_tokens=True).encode("utf-8")


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # a byte-fallback token
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")


class TokenBytes:
    """One tokenizer's token bytes, the table built on the first request with stop strings (a job
    without them never builds it; ~2 us a token on the CPU, ~0.3 s for a 150k vocabulary)."""

    def __init__(self, tokenizer, size: int):
        self.tokenizer = tokenizer
        self.size = size  # the model's vocabulary (config.json's vocab_size, may pad past the tokenizer's)
        self._table: list[bytes] | None = None

    @property
    def table(self) -> list[bytes]:
        if self._table is None:
            self._table = token_bytes_table(self.tokenizer, self.size)
        return self._table

    def matcher(self, stop: tuple[str, ...], response: Sequence[int] = ()) -> "StopMatcher":
        """A new sample's matcher for `stop`, having read `response` (a continued sample's tokens so far:
        their bytes are the context a stop string may start in; they end nothing themselves)."""
        matcher = StopMatcher(tuple((s.encode("utf-8"), s) for s in stop), self.table)
        for token_id in response:
            matcher.tail = matcher.context(matcher.tail + matcher.bytes_of(token_id))
        return matcher


class StopMatcher:
    """One sample's stop-string state: the last (longest stop - 1) bytes of its response."""

    __slots__ = ("stops", "table", "keep", "tail")

    def __init__(self, stops: tuple[tuple[bytes, str], ...], table: list[bytes]):
        self.stops = stops  # (UTF-8 bytes, the string as given), in the order given
        self.table = table
        self.keep = max(len(b) for b, _ in stops) - 1  # bytes of context a later match may start in
        self.tail = b""

    def bytes_of(self, token_id: int) -> bytes:
        return self.table[token_id] if 0 <= token_id < len(self.table) else b""

    def context(self, data: bytes) -> bytes:
        """The last `keep` bytes of `data` (b"" when keep is 0: every stop string is one byte)."""
        return data[len(data) - self.keep:] if len(data) > self.keep else data

    def push(self, token_id: int) -> str | None:
        """Read the sample's next token; -> the stop string it completed (the one that ends first, the
        first given on a tie), or None."""
        piece = self.bytes_of(token_id)
        if not piece:
            return None
        start = len(self.tail)  # where the new token's bytes begin in `data`
        data = self.tail + piece
        found, found_end = None, 0
        for stop, text in self.stops:
            # only windows that end inside the new token: earlier ones were searched with earlier tokens
            at = data.find(stop, max(0, start - len(stop) + 1))
            if at >= 0 and (found is None or at + len(stop) < found_end):
                found, found_end = text, at + len(stop)
        self.tail = self.context(data)
        return found
