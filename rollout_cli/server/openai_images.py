"""Images in the OpenAI API's chat requests, for vision-language checkpoints (server/openai_api.py).

A message's content parts may place images among its text, as vLLM's and SGLang's servers take them:
    {"type": "image_url", "image_url": {"url": URL}}        OpenAI's part (`image_url` may be the URL itself)
    {"type": "image", "image" | "url" | "path": URL}          HF's chat format
where URL is a base64 data URL (data:image/png;base64,...), a file URL (file:///abs/cat.png) or an
absolute path on the daemon's machine. The daemon fetches nothing from the network: an http(s) URL is
refused with the fix (inline the image as a data URL).

The parts keep their order: chat_messages (openai_requests.py) turns each image part into {"type":
"image"}, where the checkpoint's own chat template places the image's vision tokens, and
VisionPromptEncoder (io/image_prompts.py) expands each image's placeholder as HF's processor does and
makes its patch rows, so the prompt ids equal HF's and `rollout run`'s for the same picture and text.
Decoding and the image processor run on a worker thread, off the event loop; the chat template runs on
the event loop, whose tokenizer no other thread uses.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from rollout_cli.engine.multimodal import ImageInput
from rollout_cli.errors import RolloutError, one_line
from rollout_cli.io.image_cells import load_image
from rollout_cli.io.prompt_encoding import InvalidPrompt

# content part types that hold an image
IMAGE_PART_TYPES = frozenset({"image_url", "image"})
_FORMS = "a data URL (data:image/png;base64,...), a file:// URL or an absolute path on the daemon's machine"


@dataclass(frozen=True)
class ImagePart:
    """One image part of a request, as sent: where it is (message, part: 0-based) and its body."""

    message: int
    part: int
    body: Mapping[str, Any]

    def label(self, number: int) -> str:
        """How errors name it: "image 2 (message 0, content part 3)"; `number`: 1-based over the request."""
        return f"image {number} (message {self.message}, content part {self.part})"


def part_url(part: ImagePart, label: str) -> str:
    """The URL an image part names."""
    body = part.body
    if body.get("type") == "image_url":
        value = body.get("image_url")
        url = value.get("url") if isinstance(value, Mapping) else value
    else:
        url = next((body[key] for key in ("image", "url", "path") if body.get(key) is not None), None)
    if not isinstance(url, str) or not url:
        shape = ('{"type": "image_url", "image_url": {"url": ...}}' if body.get("type") == "image_url"
                 else '{"type": "image", "image": ...}')
        raise RolloutError(f"{label} names no image; give {shape} with {_FORMS}")
    return url


def image_source(url: str, label: str) -> bytes | str:
    """A data URL's bytes, or the path of a file URL or a plain path; refused: network and relative."""
    if url.startswith("data:"):
        return _data_url(url, label)
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        raise RolloutError(f"{label} is an {scheme} URL ({_clip(url)}); the daemon does not fetch from the network: "
                           "inline the image as a data URL (data:image/png;base64,...)")
    if scheme == "file":
        parsed = urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise RolloutError(f"{label} is a file URL on host {parsed.netloc!r}; give a file on the daemon's "
                               "machine (file:///abs/path.png) or a data URL")
        path = unquote(parsed.path)
    elif scheme:
        raise RolloutError(f"{label} has a {scheme}: URL ({_clip(url)}), which the daemon does not read; give {_FORMS}")
    else:
        path = url
    if not Path(path).is_absolute():
        raise RolloutError(f"{label} is a relative path ({_clip(path)}); the daemon reads image files by absolute "
                           "path (its working directory is not the client's), or send a data URL")
    return path


def _data_url(url: str, label: str) -> bytes:
    head, comma, payload = url.partition(",")
    media, *options = head[len("data:"):].split(";")
    if not comma or "base64" not in options:
        raise RolloutError(f"{label} is a data URL without a base64 payload ({_clip(head)}); give "
                           "data:image/<format>;base64,<the image file's bytes in base64>")
    if media and not media.lower().startswith("image/"):
        raise RolloutError(f"{label} is a data URL of type {media}, not an image; give data:image/<format>;base64,...")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise RolloutError(f"{label}: the data URL's base64 payload is invalid ({one_line(err)}); encode the image "
                           "file's bytes with standard base64") from err


def _clip(text: str, most: int = 120) -> str:
    return text if len(text) <= most else text[:most] + "..."


def decode_images(encoder, parts: list[ImagePart]) -> tuple[ImageInput, ...]:
    """The parts' images through the checkpoint's image processor (encoder: VisionPromptEncoder), in order;
    a RolloutError names the image that cannot be read. Runs on a worker thread."""
    pictures = []
    for number, part in enumerate(parts, 1):
        label = part.label(number)
        try:
            pictures.append(load_image(image_source(part_url(part, label), label), number, label=label))
        except InvalidPrompt as err:
            raise RolloutError(str(err)) from err
    try:
        return encoder.images(pictures)
    except InvalidPrompt as err:
        raise RolloutError(f"invalid image: {err}") from err


async def encode_chat(routes, messages: list[dict[str, Any]], parts: list[ImagePart],
                      template_kwargs: dict[str, Any]) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A chat request's prompt ids and images. `routes`: OpenAIRoutes (its tokenizer, vision encoder and
    text encoding). A vision-language checkpoint encodes text-only chats too, so that a literal image token
    without an image is refused as `rollout run` refuses it."""
    vision = routes.vision
    if not parts:
        if vision is None:
            return routes.encode(messages, template_kwargs), ()
        return _prompt_ids(vision, messages, [], template_kwargs), ()
    if vision is None:
        raise RolloutError(f"message {parts[0].message} has image parts but the served model "
                           f"{routes.served_model_name!r} is text-only; send text, or serve a vision-language "
                           "checkpoint (Qwen3-VL, Qwen3.5) for images")
    images = await asyncio.to_thread(decode_images, vision, parts)
    return _prompt_ids(vision, messages, [image.num_tokens(vision.merge_size) for image in images],
                       template_kwargs), images


def _prompt_ids(vision, messages, counts: list[int], template_kwargs) -> list[int]:
    try:
        return vision.prompt_ids(messages, counts, template_kwargs)
    except InvalidPrompt as err:
        raise RolloutError(f"invalid prompt: {err}") from err
