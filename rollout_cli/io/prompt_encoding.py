"""Token ids of prompt cells: plain text, chat messages through the tokenizer's chat template, or ids.

Kept apart from the Parquet reader (`prompts.py`) because it knows nothing about files: it turns
one cell's value into token ids or says why it cannot (`InvalidPrompt`), and the Python API's
`Engine.encode` encodes its prompts with the same rules.

A prompt cell may be
  - a string                     -> `tokenizer.encode(s)` (special tokens on),
  - a list of chat messages      -> the tokenizer's chat template with the
    (dicts with role, content;      generation prompt appended (verl's and HF
    pyarrow gives list<struct>)     datasets' RL layout),
  - a list of token ids          -> used as is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import numpy as np

from rollout_cli.engine.scheduling.request_maker import token_id_problem
from rollout_cli.errors import RolloutError, one_line


class InvalidPrompt(ValueError):
    """A prompt cell that cannot be tokenized; the message is the reason."""


def encode_prompt(tokenizer: Any, value: Any, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of one prompt cell (string, chat messages or token ids); `template_kwargs` go to the
    chat template (e.g. enable_thinking for Qwen3's).

    Raises InvalidPrompt for a cell no model can take (null, number, mixed
    list, malformed messages, empty), and RolloutError when the cell is chat
    messages but the tokenizer has no chat template, since that is wrong for
    every row alike and skipping rows would not fix it.
    """
    value = _to_python(value)
    if isinstance(value, str):
        if not value:
            raise InvalidPrompt("empty prompt")
        _require_tokenizer(tokenizer)
        _silence_length_warning(tokenizer)
        return [int(t) for t in tokenizer.encode(value)]
    return _encode_non_string(tokenizer, value, template_kwargs)


def _silence_length_warning(tokenizer: Any) -> None:
    """Keep transformers' "Token indices sequence length is longer than ..." warning off stderr.

    Long prompts are judged against --max-model-len by PromptSource (one clear line, or a
    skipped row); the tokenizer's model_max_length says nothing about this engine. transformers
    prints that warning once per tokenizer, tracked in `deprecation_warnings` (4.x and 5.x):
    marking it shown silences every path, chat templates included.
    """
    shown = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(shown, dict):
        shown["sequence-length-is-longer-than-the-specified-maximum"] = True


def _a(noun: str) -> str:
    """'an int', 'a float'."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _to_python(value: Any) -> Any:
    """numpy arrays (pandas-written cells, array columns) become lists; the rest is left as is."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise InvalidPrompt(f"prompt is {_a(f'{value.ndim}-d')} array; expected a 1-d list of token ids")
        return value.tolist()
    return value


def _encode_non_string(tokenizer: Any, value: Any, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    if value is None:
        raise InvalidPrompt("prompt is null")
    if not isinstance(value, (list, tuple)):
        raise InvalidPrompt(
            f"prompt is {_a(type(value).__name__)}; expected a string, a list of chat messages "
            "or a list of token ids"
        )
    if all(_is_int(v) for v in value):  # an empty list too
        ids = [int(v) for v in value]
        problem = token_id_problem(ids)  # no model here: only the rules that hold for every model
        if problem is not None:
            rule, low = problem
            raise InvalidPrompt("empty prompt" if rule == "empty" else f"prompt holds the negative token id {low}")
        return ids
    if all(isinstance(v, Mapping) for v in value):
        _require_tokenizer(tokenizer)
        return _encode_chat(tokenizer, value, template_kwargs)
    raise InvalidPrompt(
        "prompt list mixes types; expected only token ids (ints) or only chat messages "
        "(dicts with 'role' and 'content')"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                 template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    require_chat_template(tokenizer)
    clean = []
    for k, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidPrompt(f"chat message {k} has no 'role' string")
        if not isinstance(m.get("content"), str):
            raise InvalidPrompt(f"chat message {k} has no 'content' string")
        # A list<struct> column holds the union of all messages' keys, so a message
        # gets e.g. name=None it never had; templates test `is defined`, so drop those.
        clean.append({key: val for key, val in m.items() if val is not None})
    return chat_template_ids(tokenizer, clean, template_kwargs)


def chat_template_ids(tokenizer: Any, messages: list[dict[str, Any]],
                      template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The token ids of checked chat messages through the tokenizer's chat template, generation prompt
    appended (image_prompts.py renders messages with image parts through it too)."""
    _silence_length_warning(tokenizer)
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **dict(template_kwargs or {}))
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as err:
        # Templates reject rows with raise_exception (TemplateError) or trip on odd values.
        raise InvalidPrompt(f"chat template failed: {one_line(err)}") from err
    # transformers 5 returns a BatchEncoding ({'input_ids': [...], ...}); 4.x a plain list.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    if not out:
        raise InvalidPrompt("empty prompt")
    return [int(t) for t in out]


def require_chat_template(tokenizer: Any) -> None:
    """A RolloutError when chat prompts cannot be rendered: wrong for every row alike, so no row is skipped."""
    _require_tokenizer(tokenizer)
    if getattr(tokenizer, "chat_template", None) is None:
        raise RolloutError(
            "the prompts are chat messages but the tokenizer has no chat template; add "
            "chat_template to the checkpoint's tokenizer_config.json or pass plain-string prompts"
        )


def _require_tokenizer(tokenizer: Any) -> None:
    if tokenizer is None:
        raise RolloutError(
            "the model directory has no tokenizer files, so text and chat prompts cannot be encoded; "
            "add the tokenizer files or give prompts as token ids"
        )


def encode_batch(tokenizer: Any, values: list[Any]) -> list[list[int] | InvalidPrompt]:
    """encode_prompt over a batch: ids, or the InvalidPrompt, per value in order.

    Non-empty strings go to the tokenizer in one call, which the fast (Rust)
    tokenizers run in parallel; the rest go one by one.
    """
    results: list[list[int] | InvalidPrompt | None] = [None] * len(values)
    string_pos: list[int] = []
    for pos, raw in enumerate(values):
        if isinstance(raw, InvalidPrompt):  # a cell prompts._cells could not read
            results[pos] = raw
            continue
        if isinstance(raw, str) and raw:
            string_pos.append(pos)
            continue
        try:
            results[pos] = encode_prompt(tokenizer, raw)
        except InvalidPrompt as err:
            results[pos] = err
    if string_pos:
        _require_tokenizer(tokenizer)
        strings = [values[p] for p in string_pos]
        _silence_length_warning(tokenizer)
        if callable(tokenizer):
            # verbose=False: long prompts are judged against max_prompt_len below,
            # not against the tokenizer's model_max_length warning.
            encoded = tokenizer(strings, add_special_tokens=True, verbose=False)["input_ids"]
        else:
            encoded = [tokenizer.encode(s) for s in strings]
        for p, ids in zip(string_pos, encoded):
            results[p] = [int(t) for t in ids]
    return results  # type: ignore[return-value]
