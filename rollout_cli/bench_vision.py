"""`rollout bench --images N --image-size W H`: vision-language workloads.

Each prompt gets N images of its own (random patch rows in the HF image processor's layout, as the
processor would hand them over for a W x H picture: no decoding or resizing is timed), placed as
Qwen's chat template places them (<|vision_start|>, one placeholder per merged patch,
<|vision_end|>) before the prompt's random text. The report adds the vision tower's share of the run
and the FLOP/s its encoder steps reached (matmul FLOPs, models/vision.VisionTower.matmul_flops).
"""

from __future__ import annotations

import dataclasses

import torch

from rollout_cli.engine.multimodal import ImageInput
from rollout_cli.errors import RolloutError


def add_images(workload, cfg, hf_config, pin: bool = False):
    """The workload with cfg.images images before each prompt (Workload.images set); pin: their rows in
    page-locked memory, as `rollout run` keeps them for a CUDA engine (ImageInput.of)."""
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        raise RolloutError("--images needs a vision-language checkpoint (Qwen3-VL, Qwen3.5); this one has no "
                           "vision_config")
    patch, merge = vision.patch_size, vision.spatial_merge_size
    width, height = cfg.image_size
    if width % (patch * merge) or height % (patch * merge) or min(width, height) < patch * merge:
        raise RolloutError(f"--image-size {width} {height}: each side must be a multiple of {patch * merge} (patch "
                           f"{patch} x merge {merge}), as the image processor resizes to")
    grid = (1, height // patch, width // patch)
    rows = grid[1] * grid[2]
    row_width = vision.in_channels * vision.temporal_patch_size * patch * patch
    tokens = rows // (merge * merge)
    placeholder = [hf_config.vision_start_token_id] + [hf_config.image_token_id] * tokens + [hf_config.vision_end_token_id]
    generator = torch.Generator().manual_seed(cfg.seed)
    prompts, images = [], []
    for prompt in without_vision_tokens(workload.prompts, hf_config):
        images.append(tuple(ImageInput.of(torch.randn(rows, row_width, generator=generator), grid, pin=pin)
                            for _ in range(cfg.images)))
        prompts.append(placeholder * cfg.images + prompt)
    return dataclasses.replace(workload, prompts=prompts, images=images)


def without_vision_tokens(prompts: list[list[int]], hf_config) -> list[list[int]]:
    """Random ids with every vision token id (image, video, start, end) replaced by 0: the engine refuses
    image placeholders that come without images."""
    special = {getattr(hf_config, key, None) for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                         "vision_end_token_id")} - {None}
    return [[0 if t in special else t for t in prompt] for prompt in prompts]


def hf_image_kwargs(batch_images: list[tuple], ids: torch.Tensor, image_token_id: int) -> dict:
    """What HF's VL generate takes for a batch's images: their patch rows in batch order, their grids and
    the token type ids (1 at image tokens) its multimodal positions need."""
    flat = [im for images in batch_images for im in images]
    if not flat:
        return {}
    return dict(pixel_values=torch.cat([im.pixel_values for im in flat]).to(ids.device),
                image_grid_thw=torch.tensor([list(im.grid_thw) for im in flat], device=ids.device),
                mm_token_type_ids=(ids == image_token_id).int())


def hf_model_class(config):
    """The transformers auto class of the checkpoint: image-text-to-text for VL checkpoints."""
    if getattr(config, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def vision_report(engine, seconds: float, flops_per_s: float | None) -> dict:
    """The encoder steps' share of a timed run and the FLOP/s they reached (None off the GPU)."""
    cache = engine.runner.encoder_cache
    flops = engine.model.visual.matmul_flops(cache.grids)
    return {
        "images_encoded": len(cache.grids),
        "vision_seconds": cache.seconds,
        "vision_share": cache.seconds / seconds if seconds else None,
        "vision_tflops_per_s": flops / cache.seconds / 1e12 if cache.seconds else None,
        "vision_peak_fraction": flops / cache.seconds / flops_per_s if cache.seconds and flops_per_s else None,
    }
