"""Tiny vision-language checkpoints and HF transformers' answers on them (tests of issue 23).

`build_tiny_vlm(directory, arch)` writes what a hub VLM checkpoint holds: config.json and random weights
saved by HF's own class, the example model's tokenizer with Qwen's vision tokens added and a chat
template that renders image parts as Qwen's does, and a preprocessor_config.json for the HF image
processor (patch 4, merge 2: a 16 x 16 image is 16 patches, 4 placeholder tokens).
`HFVisionReference` runs HF's class on the same files: greedy tokens and teacher-forced logprobs.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_weights, from any importer
from tiny_weights import perturb_for_loading  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_MODEL = REPO_ROOT / "recipes" / "example_model"

# added after the example tokenizer's 768 ids: 768 .. 771
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 768, 769, 770, 771
VOCAB = 772

# Qwen's layout: an image part becomes <|vision_start|><|image_pad|><|vision_end|>; the processor then
# repeats <|image_pad|> once per merged patch
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             num_hidden_layers=3, vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-6)
# rotary dim 32: 16 frequencies, interleaved t/h/w as mrope_section [6, 5, 5]
_ROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5], mrope_interleaved=True)
_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
_IDS = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END)
_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)  # 2 * 24 != hidden 64: layouts tell apart

# name -> (config class, model class, text config, vision config extras)
TINY_VLM_ARCHS = {
    # deepstack features from vision blocks 0 and 2 added after language layers 0 and 1
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", dict(_TEXT, rope_parameters=_ROPE),
                 dict(deepstack_visual_indexes=[0, 2])),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                     dict(_TEXT, **_MOE, rope_parameters=_ROPE, decoder_sparse_step=1),
                     dict(deepstack_visual_indexes=[1])),
    # Qwen3.5: the hybrid language model, partial rotary 0.25 (8 dims: mrope_section [2, 1, 1]), no deepstack
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                dict(_TEXT, **_HYBRID, rope_parameters=dict(_ROPE, partial_rotary_factor=0.25, mrope_section=[2, 1, 1])),
                {}),
    # Qwen3.5-MoE: the same hybrid stack with every MLP sparse (4 experts top-2 + the shared expert)
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                    dict(_TEXT, **_HYBRID, **_MOE, shared_expert_intermediate_size=48,
                         rope_parameters=dict(_ROPE, partial_rotary_factor=0.25, mrope_section=[2, 1, 1])),
                    {}),
}


def build_tiny_vlm(directory: Path, arch: str = "qwen3_vl", seed: int = 11) -> Path:
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls, text, vision = TINY_VLM_ARCHS[arch]
    config = getattr(transformers, config_cls)(text_config=text, vision_config=dict(_VISION, **vision),
                                               tie_word_embeddings=True, **_IDS)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    perturb_for_loading(model, matrix_std=0.3)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(EXAMPLE_MODEL)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    assert tokenizer.convert_tokens_to_ids(VISION_TOKENS) == [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    image_processor().save_pretrained(directory)
    return directory


def image_processor():
    """The HF image processor of the tiny checkpoints: 4-pixel patches, 2 x 2 merge, 8 .. 48 pixels a side."""
    try:  # transformers >= 5.2x: the PIL processor has a class of its own (no torchvision needed)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:
        from transformers import Qwen2VLImageProcessor as cls

    return cls(patch_size=4, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48})


def random_image(width: int, height: int, seed: int):
    """A PIL RGB image of random pixels."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class HFVisionReference:
    """HF transformers' class on a tiny VLM checkpoint, float32 on the CPU."""

    def __init__(self, model_dir: str):
        import transformers

        config = transformers.AutoConfig.from_pretrained(model_dir)
        cls = getattr(transformers, config.architectures[0])
        self.model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()

    def _inputs(self, ids: list[int], images) -> dict:
        input_ids = torch.tensor([ids])
        inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                      mm_token_type_ids=(input_ids == IMAGE_PAD).int())
        if images:
            inputs["pixel_values"] = torch.cat([im.pixel_values for im in images])
            inputs["image_grid_thw"] = torch.tensor([list(im.grid_thw) for im in images])
        device = next(self.model.parameters()).device  # the GPU tests move the model there
        return {name: value.to(device) for name, value in inputs.items()}

    @torch.no_grad()
    def greedy(self, ids: list[int], images, max_new_tokens: int) -> list[int]:
        out = self.model.generate(**self._inputs(ids, images), do_sample=False, max_new_tokens=max_new_tokens,
                                  eos_token_id=VOCAB + 1, pad_token_id=0)
        return out[0, len(ids):].tolist()

    @torch.no_grad()
    def logprobs(self, ids: list[int], images, response: list[int]) -> list[float]:
        logits = self.model(**self._inputs(ids + response, images)).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        return [logp[len(ids) - 1 + i, t].item() for i, t in enumerate(response)]


class ReferencePrompts:
    """Prompts with images built the way HF's Qwen3VLProcessor builds them (its chat template, then each
    <|image_pad|> repeated prod(grid_thw) / merge^2 times), independently of rollout's own encoder."""

    def __init__(self, model_dir: str):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def image(self, picture):
        from rollout_cli.engine.multimodal import ImageInput

        out = self.processor(images=[picture], return_tensors="pt")
        return ImageInput.of(out["pixel_values"], out["image_grid_thw"][0])

    def build(self, pictures, text: str = "what is it") -> tuple[list[int], tuple]:
        images = tuple(self.image(p) for p in pictures)
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        expanded, pending = [], iter(images)
        for token in ids:
            expanded += [token] * (next(pending).num_tokens(2) if token == IMAGE_PAD else 1)
        return expanded, images
