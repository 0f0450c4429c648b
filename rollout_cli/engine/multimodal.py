"""Images in a prompt: what the engine keeps of each one, ready for the vision tower.

The input side (io/image_prompts.py) decodes an image, runs the checkpoint's own HF image processor
on it and puts the vision placeholder tokens into the prompt's ids; the engine sees only this: the
processor's patch rows, the image's grid, and a digest of its pixels. The digest keys the prefix
cache (two prompts that show the same image share its cached tokens, two different images never do)
and the encoder cache (the vision tower runs once per distinct image in flight).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from rollout_cli.errors import RolloutError

# Pseudo token ids that stand for an image's placeholder tokens in prefix-cache keys: a digest's low
# 30 bits, offset past any vocabulary (the radix cache compares ints; the model never sees these).
_DIGEST_TOKEN_BASE = 1 << 40


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt after the HF image processor."""

    pixel_values: torch.Tensor
    """[grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch] float32: the processor's patch
    rows, in its order (merge blocks of spatial_merge_size^2 consecutive rows)."""
    grid_thw: tuple[int, int, int]
    """(temporal, height, width) in patches, as the processor's image_grid_thw."""
    digest: int
    """A 64-bit digest of the patch rows and the grid: equal for equal pixels after processing."""

    @classmethod
    def of(cls, pixel_values: torch.Tensor, grid_thw, pin: bool = False) -> "ImageInput":
        """pin: keep the rows in page-locked memory (a CUDA engine's): the encoder step's copy to the GPU is
        then a DMA queued behind the step, not a synchronous copy through a staging buffer (a 448 x 448
        image is 6.3 MB of float32 rows; ~17 of them an encoder step on the Qwen3-VL-8B workload)."""
        pixel_values = pixel_values.detach().to("cpu", torch.float32).contiguous()
        grid = tuple(int(g) for g in grid_thw)
        h = hashlib.blake2b(digest_size=8)
        h.update(repr(grid).encode())
        h.update(pixel_values.numpy().tobytes())
        if pin:
            pixel_values = pixel_values.pin_memory()
        return cls(pixel_values, grid, int.from_bytes(h.digest(), "little"))  # type: ignore[arg-type]

    def num_tokens(self, spatial_merge_size: int) -> int:
        """Placeholder tokens the image takes in the prompt (the processor's count)."""
        t, h, w = self.grid_thw
        return t * h * w // (spatial_merge_size * spatial_merge_size)


def cache_key_tokens(token_ids: list[int], image_token_id: int, images: tuple[ImageInput, ...],
                     spatial_merge_size: int) -> list[int]:
    """The ids the prefix cache keys a prompt by: its ids with each image's placeholder tokens replaced
    by a pseudo id from that image's digest, so that a cached prefix is shared only by prompts that
    show the same images in the same places."""
    if not images:
        return token_ids
    key, image, left = list(token_ids), iter(images), 0
    current = None
    for i, token in enumerate(key):
        if token != image_token_id:
            continue
        if left == 0:
            current = next(image)
            left = current.num_tokens(spatial_merge_size)
        key[i] = _DIGEST_TOKEN_BASE + (current.digest & ((1 << 30) - 1))
        left -= 1
    return key


def prompt_layout(model, prompt, what: str, model_name: str):
    """The model's layout (models.vision_language.VisionLayout) of a prompt with images (a PromptInput,
    PartialSample or ScoreInput: index, ids, images), None without; RolloutError for images on a text-only
    model, or image placeholder tokens without their images (a vision-language model would read them as
    text and give wrong logprobs without a word). `what` says what the prompt was going to be: generated,
    continued or scored."""
    if not prompt.images:
        token = getattr(model, "image_token_id", None)
        if token is not None and token in prompt.prompt_token_ids:
            raise RolloutError(f"prompt {prompt.prompt_index} holds image placeholder tokens but no images, and "
                               f"{what} without them its tokens would be conditioned on placeholders, not "
                               "pictures; pass the images with the prompt (rollout run --image-key, rollout "
                               "score of an image run)")
        return None
    if not hasattr(model, "vision_layout"):
        raise RolloutError(f"prompt {prompt.prompt_index} has images but {model_name} is a text-only model; drop "
                           "the images or use a vision-language checkpoint")
    return model.vision_layout(list(prompt.prompt_token_ids), tuple(prompt.images))


def model_cache_key(model, ids: list[int], images=()) -> list[int]:
    """The ids the prefix cache keys a prompt by: the ids, but each image's placeholder tokens keyed by its
    pixels (cache_key_tokens)."""
    if not images:
        return list(ids)
    return cache_key_tokens(list(ids), model.image_token_id, tuple(images), model.spatial_merge_size)
