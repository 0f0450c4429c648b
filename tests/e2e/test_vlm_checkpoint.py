"""The language model of a Qwen3.5 vision-language checkpoint (`Qwen3_5ForConditionalGeneration`, the
hub's layout: model.language_model.*, a vision tower under model.visual.*) against HF transformers'
own class on the same files, text only, float32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from rollout_cli import Engine, SamplingParams

TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_hidden_layers=3, vocab_size=352, max_position_embeddings=512,
            layer_types=["linear_attention", "full_attention", "linear_attention"])
MOE_TEXT = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
ARCHS = {
    "dense": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", TEXT, False),
    "moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", MOE_TEXT, True),
}
PROMPTS = [[5, 17, 99, 3, 250, 31], [7, 7, 8, 100, 42, 11, 12, 200, 13], [300, 2]]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    import transformers

    config_cls, model_cls, text, tied = ARCHS[request.param]
    config = getattr(transformers, config_cls)(text_config=text, vision_config=VISION, tie_word_embeddings=tied)
    torch.manual_seed(7)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms off 1 and a slow state decay, so every loaded tensor matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.05, 0.5).log())
    directory = tmp_path_factory.mktemp(f"vlm_{request.param}")
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory), model


def test_language_model_of_a_vlm_checkpoint_matches_hf(checkpoint):
    model_dir, hf = checkpoint
    engine = Engine(model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=2048)
    assert type(engine.model).__name__.endswith("ForConditionalGeneration")
    results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    for result in results:
        prompt = PROMPTS[result.prompt_index]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              eos_token_id=hf.config.text_config.vocab_size, pad_token_id=0)
            want = out[0, len(prompt):].tolist()
            assert result.response_token_ids == want
            logits = hf(torch.tensor([prompt + want])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(want)]
        assert result.response_logprobs == pytest.approx(ref, abs=1e-4)
