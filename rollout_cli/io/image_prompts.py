"""A prompt cell and an image cell -> the prompt's token ids and its images, as a vision-language model takes them.

What the engine needs of a row with images is what HF's own processor (Qwen3VLProcessor) would give the
model: the chat template rendered with one image token per image (Qwen's `<|vision_start|><|image_pad|>
<|vision_end|>`), that token then repeated once per merged patch of its image (grid t * h * w /
merge^2), and the image processor's patch rows of every image (`engine.multimodal.ImageInput`). The
processor and the template are the checkpoint's own (preprocessor_config.json, the tokenizer's
chat template), so the ids equal HF's for the same row.

Prompt cells: text or chat messages with `<image>` placeholders (verl's layout: each placeholder becomes
an image part of its message), or chat messages whose content is a list of {type: text|image} parts
(HF's layout). A row without images encodes exactly as the text path does (prompt_encoding.py). What an
image cell may hold is image_cells.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout_cli.engine.multimodal import ImageInput
from rollout_cli.engine.tokenizer import load_tokenizer
from rollout_cli.errors import RolloutError, one_line
from rollout_cli.io.image_cells import load_images
from rollout_cli.io.prompt_encoding import (
    InvalidPrompt,
    chat_template_ids,
    encode_batch,
    encode_prompt,
    require_chat_template,
)
from rollout_cli.models.architectures import MULTIMODAL_ARCHITECTURES

# verl's placeholder in message text: one per image of the row, in order
PLACEHOLDER = "<image>"
_SPLIT = re.compile(f"({re.escape(PLACEHOLDER)})")


class ImageCountMismatch(InvalidPrompt):
    """A row whose prompt places another number of images than its image cell holds."""


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


class VisionPromptEncoder:
    """Encodes prompt rows with images for one vision-language checkpoint (from_checkpoint)."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token_id: int, spatial_merge_size: int) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size = spatial_merge_size
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id) if tokenizer is not None else None
        # the engine's device is CUDA: patch rows go to page-locked memory as they are made (ImageInput.of)
        self.pin_rows = False

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, tokenizer: Any = None) -> VisionPromptEncoder | None:
        """The encoder of a vision-language checkpoint; None for a text-only one (its config.json's architectures).
        `tokenizer`: the checkpoint's, when the caller loaded it already."""
        model_dir = Path(model_dir)
        try:
            config = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError):  # the engine reports a missing or broken config.json in its own words
            return None
        arch = next((a for a in config.get("architectures") or () if a in MULTIMODAL_ARCHITECTURES), None)
        if arch is None:
            return None
        if not (model_dir / "preprocessor_config.json").is_file():
            raise RolloutError(f"{model_dir} is a vision-language checkpoint ({arch}) without "
                               "preprocessor_config.json, which says how images are resized; copy it from the base "
                               "model's repository")
        image_token_id = config.get("image_token_id")
        merge = (config.get("vision_config") or {}).get("spatial_merge_size")
        if not isinstance(image_token_id, int) or not isinstance(merge, int) or merge < 1:
            raise RolloutError(f"{model_dir}/config.json ({arch}) lacks image_token_id or "
                               "vision_config.spatial_merge_size; copy them from the base model's config.json")
        from transformers import AutoImageProcessor  # heavy: only a vision-language checkpoint needs it

        try:
            processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as err:  # noqa: BLE001 - any failure is the file's: one line, not a traceback
            raise RolloutError(f"cannot load the image processor of {model_dir} ({one_line(err)}); "
                               "check its preprocessor_config.json") from err
        if getattr(processor, "merge_size", merge) != merge:
            raise RolloutError(f"{model_dir}: preprocessor_config.json has merge_size {processor.merge_size} but "
                               f"config.json's vision_config.spatial_merge_size is {merge}; make them equal")
        if tokenizer is None:
            tokenizer = load_tokenizer(str(model_dir))
        if tokenizer is not None:
            token = tokenizer.convert_ids_to_tokens(image_token_id)
            if token is None or tokenizer.convert_tokens_to_ids(token) != image_token_id:
                raise RolloutError(f"the tokenizer of {model_dir} has no token for image_token_id {image_token_id} "
                                   "(config.json); use the checkpoint's own tokenizer files")
        return cls(tokenizer, processor, image_token_id, merge)

    # ---- one row ------------------------------------------------------------------------------------

    def encode(self, prompt_cell: Any, image_cell: Any,
               base_dir: Path | None = None) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The row's token ids (image tokens expanded) and its images; InvalidPrompt says why a row cannot be used.
        Relative image paths are read from `base_dir` (the Parquet file's folder)."""
        images = self.images(image_cell, base_dir)
        return self.prompt_ids(prompt_cell, [image.num_tokens(self.merge_size) for image in images]), images

    def images(self, image_cell: Any, base_dir: Path | None = None) -> tuple[ImageInput, ...]:
        """The cell's images through the image processor, in one call for the row."""
        pictures = load_images(image_cell, base_dir)
        if not pictures:
            return ()
        out = self._process(pictures)
        pixel_values, grids = out["pixel_values"], out["image_grid_thw"]  # [sum of t*h*w, patch dim], [images, 3]
        sizes = [int(g.prod()) for g in grids]
        return tuple(ImageInput.of(rows, grid, pin=self.pin_rows) for rows, grid in zip(pixel_values.split(sizes), grids))

    def token_counts(self, image_cell: Any, base_dir: Path | None = None) -> list[int]:
        """The image tokens each image of the cell takes, without its patch rows: what validation needs.

        Every image is decoded (a corrupt one fails here); its size gives the count through the processor's
        own resize rule (get_number_of_image_patches, which vLLM relies on too), so the patch rows are made
        only once, when the row runs. A processor without that rule runs whole.
        """
        pictures = load_images(image_cell, base_dir)
        processor = self.image_processor
        if not pictures:
            return []
        if not (hasattr(processor, "get_number_of_image_patches") and getattr(processor, "do_resize", False)):
            return [int(g.prod()) // self.merge_size ** 2 for g in self._process(pictures)["image_grid_thw"]]
        counts = []
        for number, picture in enumerate(pictures, 1):
            width, height = picture.size
            try:
                patches = processor.get_number_of_image_patches(height, width, {})
            except ValueError as err:  # e.g. an aspect ratio past the processor's limit
                raise InvalidPrompt(f"image {number} of the row ({width}x{height}) is refused by the image "
                                    f"processor: {one_line(err)}") from err
            counts.append(int(patches) // self.merge_size ** 2)
        return counts

    def _process(self, pictures: list) -> Mapping[str, Any]:
        """The image processor over a row's images; a refusal names the image."""
        try:
            return self.image_processor(images=pictures, return_tensors="pt")
        except (ValueError, TypeError, OSError) as err:
            number = 1
            if len(pictures) > 1:  # which image: run them one by one (only on this error path)
                for number, picture in enumerate(pictures, 1):
                    try:
                        self.image_processor(images=[picture], return_tensors="pt")
                    except (ValueError, TypeError, OSError):
                        break
            width, height = pictures[number - 1].size
            raise InvalidPrompt(f"image {number} of the row ({width}x{height}) is refused by the image processor: "
                                f"{one_line(err)}") from err

    def prompt_ids(self, prompt_cell: Any, token_counts: Sequence[int],
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The prompt's ids with its k-th image token repeated token_counts[k] times; `template_kwargs` go
        to the chat template (the daemon's chat_template_kwargs and tools).

        A prompt without images or image parts is the text path's (encode_prompt), so a text row of a
        vision-language run gets the ids a text-only run would give it.
        """
        if not token_counts and not needs_parts(prompt_cell):
            return self._without_images(encode_prompt(self.tokenizer, prompt_cell, template_kwargs))
        if isinstance(prompt_cell, str):
            if not prompt_cell:
                raise InvalidPrompt("empty prompt")
            messages: Any = [{"role": "user", "content": prompt_cell}]
        elif _is_messages(prompt_cell):
            messages = prompt_cell
        else:
            encode_prompt(self.tokenizer, prompt_cell)  # null, a number, ...: the text path's reason
            raise InvalidPrompt("a prompt of token ids cannot place images; give it as text or chat messages "
                                f"with {PLACEHOLDER} placeholders")
        require_chat_template(self.tokenizer)
        clean, placeholders = _with_image_parts(messages)
        if placeholders != len(token_counts):
            raise ImageCountMismatch(
                f"prompt has {_plural(placeholders, 'image placeholder')} ({PLACEHOLDER} or image parts) but the "
                f"row has {_plural(len(token_counts), 'image')}; give one placeholder per image")
        ids = chat_template_ids(self.tokenizer, clean, template_kwargs)
        rendered = ids.count(self.image_token_id)
        if rendered != placeholders:
            raise InvalidPrompt(f"the chat template rendered {_plural(rendered, f'{self.image_token} token')} for "
                                f"{_plural(placeholders, 'image placeholder')}; use the checkpoint's own chat template "
                                f"and no literal {self.image_token} in the text")
        counts, out = iter(token_counts), []
        for token in ids:
            if token == self.image_token_id:
                out.extend([token] * next(counts))
            else:
                out.append(token)
        return out

    def ids_batch(self, prompts: list[Any],
                  token_counts: list[list[int] | InvalidPrompt]) -> list[list[int] | InvalidPrompt]:
        """prompt_ids over a batch (a prompt or counts that are an InvalidPrompt pass through): ids, or the
        InvalidPrompt, per row. Rows without images go to the text path in one call (encode_batch)."""
        results: list[list[int] | InvalidPrompt | None] = [None] * len(prompts)
        text_rows = []
        for row, (prompt, counts) in enumerate(zip(prompts, token_counts)):
            if isinstance(prompt, InvalidPrompt) or isinstance(counts, InvalidPrompt):
                results[row] = prompt if isinstance(prompt, InvalidPrompt) else counts
            elif not counts and not needs_parts(prompt):
                text_rows.append(row)
            else:
                try:
                    results[row] = self.prompt_ids(prompt, counts)
                except InvalidPrompt as err:
                    results[row] = err
        if text_rows:
            for row, result in zip(text_rows, encode_batch(self.tokenizer, [prompts[r] for r in text_rows])):
                try:
                    results[row] = self._without_images(result)
                except InvalidPrompt as err:
                    results[row] = err
        return results  # type: ignore[return-value]

    def _without_images(self, ids: list[int] | InvalidPrompt) -> list[int] | InvalidPrompt:
        """Text-path ids, refused when they hold the image token: the model would look for an image there."""
        if isinstance(ids, list) and self.image_token_id in ids:
            raise InvalidPrompt(f"prompt holds the image token {self.image_token} (id {self.image_token_id}) but the "
                                f"row has no image; place images with {PLACEHOLDER} and an image column")
        return ids


def needs_parts(prompt_cell: Any) -> bool:
    """Whether a prompt places images or has content parts: `<image>` in its text, or a message whose
    content is a list. Anything else is the text path's to encode (or refuse)."""
    if isinstance(prompt_cell, str):
        return PLACEHOLDER in prompt_cell
    if not _is_messages(prompt_cell):
        return False
    for message in prompt_cell:
        content = message.get("content")
        if isinstance(content, (list, tuple)) or (isinstance(content, str) and PLACEHOLDER in content):
            return True
    return False


def _is_messages(prompt_cell: Any) -> bool:
    """A non-empty list of chat messages (dicts)."""
    return (isinstance(prompt_cell, (list, tuple)) and len(prompt_cell) > 0
            and all(isinstance(m, Mapping) for m in prompt_cell))


def _with_image_parts(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """(messages for the chat template, image placeholders): `<image>` in text becomes an image part,
    parts are checked, and keys a list<struct> column filled with None are dropped (templates test
    `is defined`); an image part keeps only its type (the image itself comes from the image cell)."""
    clean, placeholders = [], 0
    for k, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise InvalidPrompt(f"chat message {k} has no 'role' string")
        content = message.get("content")
        if isinstance(content, str):
            if PLACEHOLDER in content:
                content = [{"type": "image"} if piece == PLACEHOLDER else {"type": "text", "text": piece}
                           for piece in _SPLIT.split(content) if piece]
        elif isinstance(content, (list, tuple)):
            content = [_part(part, j, k) for j, part in enumerate(content)]
        else:
            raise InvalidPrompt(f"chat message {k} has no 'content' string or list of content parts")
        if not isinstance(content, str):
            placeholders += sum(part["type"] == "image" for part in content)
        clean.append({**{key: val for key, val in message.items() if val is not None}, "content": content})
    return clean, placeholders


def _part(part: Any, j: int, k: int) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        raise InvalidPrompt(f"content part {j} of chat message {k} is {type(part).__name__}; expected "
                            "{type: text, text: ...} or {type: image}")
    kind = part.get("type")
    if kind == "image":
        return {"type": "image"}
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidPrompt(f"content part {j} of chat message {k} is a text part without a 'text' string")
        return {"type": "text", "text": part["text"]}
    raise InvalidPrompt(f"content part {j} of chat message {k} has type {kind!r}; expected 'text' or 'image'")
