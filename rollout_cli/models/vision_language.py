"""Vision-language checkpoints: a language model of ours plus the vision tower (models/vision.py).

`VisionLanguageModel` is a mixin put before a language model class (Qwen3-VL: the Qwen3 decoder;
Qwen3.5: the hybrid one). It loads HF's names (model.language_model.* and model.visual.*), and its
forward takes, besides ids and positions, the step's image rows (`VisionRows`): their embeddings
replace the placeholder tokens' and, for Qwen3-VL, deepstack features are added to those rows after
the first layers. A step without image tokens runs the language model unchanged.

Positions are multimodal (interleaved t/h/w rotary): `vision_layout` computes a prompt's [3, L]
positions once, when its requests are made: a text token's three are equal and continue from the
largest position before it; an image token's are (start + t, start + row, start + col) of its merged
patch; after an image, text continues at start + max(rows, cols). Tokens past the prompt sit at
their index + `delta` (three equal positions: the plain rotary tables serve them, graphs included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_cli.engine.multimodal import ImageInput, cache_key_tokens
from rollout_cli.errors import RolloutError
from rollout_cli.models.vision import VisionTower


@dataclass(frozen=True, eq=False)
class VisionLayout:
    """Where a prompt's images sit and its multimodal positions; shared by the prompt's n samples."""

    images: tuple[ImageInput, ...]
    spans: tuple[tuple[int, int], ...]  # [start, end) of each image's placeholder run in the prompt
    positions: torch.Tensor  # [3, len(prompt)] int64 on the CPU
    delta: int  # a token at index p >= len(prompt) has position p + delta (delta <= 0)
    key_ids: list[int]  # the prompt's prefix-cache key (engine.multimodal.cache_key_tokens)


@dataclass
class VisionRows:
    """A step's image tokens: their rows in the step's flattened tokens [M], embeddings [M, hidden], and
    one deepstack feature tensor [M, hidden] per tapped language layer (Qwen3-VL; [] for Qwen3.5)."""

    rows: torch.Tensor
    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


class VisionLanguageModel:
    """Mixin over a language model class; the config is the checkpoint's text_config with the vision
    config and image token id attached (build.load_model_config)."""

    checkpoint_renames = (("model.language_model.", "model."), ("model.visual.", "visual."))
    checkpoint_ignored_prefixes = ("mtp.",)

    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        self.image_token_id = int(config.image_token_id)
        self.visual = VisionTower(config.vision_config)
        self.spatial_merge_size = int(config.vision_config.spatial_merge_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, vision: VisionRows | None = None):
        """input_ids [T], positions [T] or [3, T] -> hidden [T, hidden_size]."""
        if vision is None:
            return super().forward(input_ids, positions, attn)
        model = self.model
        hidden = model.embed_tokens(input_ids)  # [T, hidden]
        hidden[vision.rows] = vision.embeds.to(hidden.dtype)
        residual = None
        for i, layer in enumerate(model.layers):
            hidden, residual = layer(positions, hidden, residual, attn)
            if i < len(vision.deepstack):
                # HF adds the features to the layer's output (residual + mlp out), then the next layer
                # starts a new residual from it
                hidden = hidden + residual
                residual = None
                hidden[vision.rows] += vision.deepstack[i].to(hidden.dtype)
        return model.norm(hidden) if residual is None else model.norm(hidden, residual)[0]

    @torch.inference_mode()
    def encode_images(self, images: list[ImageInput], device: torch.device) -> list[tuple[torch.Tensor, list]]:
        """The vision tower over several images in one forward -> per image (embeddings [n, hidden],
        deepstack features [[n, hidden] per tapped layer]), n its placeholder tokens."""
        # each image's rows copied on their own, joined on the device: no host-side copy of them all first
        pixels = torch.cat([im.pixel_values.to(device, non_blocking=True) for im in images])
        embeds, deepstack = self.visual(pixels, [im.grid_thw for im in images])
        sizes = [im.num_tokens(self.spatial_merge_size) for im in images]
        per_image = embeds.split(sizes)
        per_layer = [d.split(sizes) for d in deepstack]
        return [(per_image[i], [d[i] for d in per_layer]) for i in range(len(images))]

    def vision_layout(self, prompt_ids: list[int], images: tuple[ImageInput, ...]) -> VisionLayout:
        """A prompt's image spans and multimodal positions; RolloutError when its placeholder tokens do
        not match its images (each image takes t * h * w / merge^2 consecutive placeholder tokens)."""
        merge, spans, cursor = self.spatial_merge_size, [], 0
        placeholders = sum(1 for t in prompt_ids if t == self.image_token_id)
        wanted = sum(im.num_tokens(merge) for im in images)
        if placeholders != wanted:
            raise RolloutError(f"the prompt holds {placeholders} image placeholder tokens but its {len(images)} "
                               f"image(s) take {wanted}; encode images and text together (io/image_prompts.py)")
        for im in images:
            start = prompt_ids.index(self.image_token_id, cursor)
            end = start + im.num_tokens(merge)
            if any(t != self.image_token_id for t in prompt_ids[start:end]):
                raise RolloutError(f"an image of grid {im.grid_thw} needs {end - start} consecutive placeholder "
                                   "tokens; the prompt's run is shorter")
            spans.append((start, end))
            cursor = end
        positions, delta = _multimodal_positions(len(prompt_ids), images, spans, merge)
        key_ids = cache_key_tokens(list(prompt_ids), self.image_token_id, images, merge)
        return VisionLayout(tuple(images), tuple(spans), positions, delta, key_ids)


def _multimodal_positions(length: int, images, spans, merge: int) -> tuple[torch.Tensor, int]:
    """[3, length] positions and the delta of the tokens after the prompt (HF's get_rope_index)."""
    parts, current, previous_end = [], 0, 0
    for im, (start, end) in zip(images, spans):
        text = start - previous_end
        parts.append(torch.arange(current, current + text).expand(3, -1))
        current += text
        t, h, w = im.grid_thw[0], im.grid_thw[1] // merge, im.grid_thw[2] // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        parts.append(grid.reshape(3, -1) + current)  # [3, t * h * w]
        current += max(h, w)
        previous_end = end
    parts.append(torch.arange(current, current + length - previous_end).expand(3, -1))
    positions = torch.cat(parts, dim=1).long()
    return positions, int(positions.max()) + 1 - length
