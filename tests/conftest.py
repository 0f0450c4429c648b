"""Shared fixtures: tiny random HF checkpoints, the HF reference, the example model; the gpu marker.

Without a GPU the Triton kernels run under Triton's interpreter (how CI tests them). TRITON_INTERPRET
must be set before any @triton.jit function is defined, and any test module may import a module that
defines kernels (rollout_cli.training does), so it is set here, before the first test module loads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tiny_weights import perturb_for_loading

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]

# Tiny checkpoints, one per supported architecture (and the variants that take other code paths).
_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    intermediate_size=128,
    max_position_embeddings=512,
    initializer_range=0.4,  # large weights: greedy outputs vary instead of repeating one token
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,  # no eos: every greedy run goes to max_new_tokens unless a test sets one
    pad_token_id=None,
)

TINY_ARCHS = {
    # head_dim 32 != hidden / heads (16): q/o projections are wider than hidden.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_hidden_layers=2, vocab_size=384, head_dim=32, tie_word_embeddings=True)),
    # qkv biases, tied embeddings, 3 layers
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_hidden_layers=3, vocab_size=448, tie_word_embeddings=True)),
    # untied lm_head, llama3 rope scaling (original context 64, so positions past it are scaled)
    "llama3_scaled": ("LlamaConfig", "LlamaForCausalLM",
                      dict(num_hidden_layers=2, vocab_size=320, tie_word_embeddings=False,
                           rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=64))),
    # attention and mlp biases, tied embeddings, default rope
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM",
                   dict(num_hidden_layers=2, vocab_size=352, tie_word_embeddings=True,
                        attention_bias=True, mlp_bias=True)),
}

# Tiny MoE checkpoints (tests/e2e/test_moe_parity.py); kept out of TINY_ARCHS so the dense parity
# matrix does not grow. initializer 0.3: routing and greedy text vary.
_MOE_COMMON = dict(initializer_range=0.3, moe_intermediate_size=32, intermediate_size=96)
TINY_MOE_ARCHS = {
    # 8 experts, top-2 renormalised; layer 1 dense (mlp_only_layers); q/k norm, tied embeddings
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_MOE_COMMON, num_hidden_layers=3, vocab_size=384, head_dim=32, tie_word_embeddings=True,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
    # top-3 not renormalised; decoder_sparse_step 2: layers 1 and 3 sparse; untied lm_head
    "qwen3_moe_step2": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(_MOE_COMMON, num_hidden_layers=4, vocab_size=320, tie_word_embeddings=False,
                             num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2)),
    # 4 experts top-2 plus the sigmoid-gated shared expert; qkv bias
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_MOE_COMMON, num_hidden_layers=2, vocab_size=352, tie_word_embeddings=True,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                       shared_expert_intermediate_size=48)),
    # every layer sparse, 4 experts top-2 always renormalised; checkpoint names block_sparse_moe.experts.E.w1/w2/w3
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_MOE_COMMON, num_hidden_layers=2, vocab_size=320, tie_word_embeddings=False,
                     num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
}

# Tiny hybrid linear-attention checkpoints (tests/e2e/test_hybrid_parity.py). Linear layers: 2 key heads
# serving 4 value heads (the GQA-style repeat), head dims 16, conv width 4; full attention: head_dim 32
# with partial rotary 0.25 (8 rotary dims) and the output gate.
_HYBRID_COMMON = dict(_MOE_COMMON, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                      shared_expert_intermediate_size=48)
TINY_HYBRID_ARCHS = {
    # linear, full, linear; layer 1 dense (mlp_only_layers), layers 0 and 2 sparse: 4 experts top-2 + shared
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(_HYBRID_COMMON, num_hidden_layers=3, vocab_size=384, tie_word_embeddings=False,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
    # dense Qwen3.5 text model: split in_proj_qkv/z/b/a; full_attention_interval 2 -> linear, full
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(_HYBRID_COMMON, num_hidden_layers=2, vocab_size=352, tie_word_embeddings=True,
                     full_attention_interval=2)),
    # Qwen3.5-MoE text model: every layer sparse, top-k renormalised
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(_HYBRID_COMMON, num_hidden_layers=2, vocab_size=320, tie_word_embeddings=False,
                         layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2)),
}


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _build_checkpoint(name: str, directory: Path, **overrides) -> Path:
    import torch
    import transformers

    config_cls, model_cls, extra = {**TINY_ARCHS, **TINY_MOE_ARCHS, **TINY_HYBRID_ARCHS}[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(1234 + sum(map(ord, name)))
    model = getattr(transformers, model_cls)(config).eval()
    perturb_for_loading(model)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> directory of a saved tiny random checkpoint (float32 safetensors, no tokenizer)."""
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {name: str(_build_checkpoint(name, root / name)) for name in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_moe_checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> directory of a saved tiny random MoE checkpoint (per-expert tensor names, as save_pretrained writes)."""
    root = tmp_path_factory.mktemp("tiny_moe_ckpts")
    return {name: str(_build_checkpoint(name, root / name)) for name in TINY_MOE_ARCHS}


@pytest.fixture(scope="session")
def tiny_hybrid_checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> directory of a saved tiny random hybrid (Gated DeltaNet + gated attention) checkpoint."""
    root = tmp_path_factory.mktemp("tiny_hybrid_ckpts")
    return {name: str(_build_checkpoint(name, root / name)) for name in TINY_HYBRID_ARCHS}


@pytest.fixture(scope="session")
def fp8_groups_checkpoint(tmp_path_factory) -> str:
    """The qwen3 shape with hidden and intermediate sizes of whole 128-channel groups: FP8 rows fuse into
    the norms and SiLU, and cuBLAS's blockwise GEMM can take the layers (K in groups of 4 x 128; the tiny
    fixtures' 64 do neither)."""
    root = tmp_path_factory.mktemp("fp8_groups_ckpt")
    return str(_build_checkpoint("qwen3", root / "qwen3_512", hidden_size=512, intermediate_size=1024,
                                 initializer_range=0.1))


@pytest.fixture(scope="session")
def sampling_checkpoint(tmp_path_factory) -> str:
    """The qwen3 shape with smaller weights (initializer 0.1): flatter distributions to sample from,
    and float32 noise in logprobs between batch layouts stays well under 1e-5 (~2e-6; ~1e-5 at 0.4)."""
    root = tmp_path_factory.mktemp("sampling_ckpt")
    return str(_build_checkpoint("qwen3", root / "qwen3_soft", initializer_range=0.1))


@pytest.fixture(scope="session", params=sorted(TINY_ARCHS))
def arch(request, tiny_checkpoints) -> tuple[str, str]:
    """(name, checkpoint directory), once per architecture."""
    return request.param, tiny_checkpoints[request.param]


@pytest.fixture
def with_eos(tmp_path):
    """with_eos(model_dir, eos_id) -> a copy of the checkpoint whose config and generation config name that eos."""

    def make(src: str, eos_token_id: int) -> str:
        dst = tmp_path / f"eos_{eos_token_id}"
        shutil.copytree(src, dst)
        for fname in ("config.json", "generation_config.json"):
            path = dst / fname
            if path.is_file():
                data = json.loads(path.read_text())
                data["eos_token_id"] = eos_token_id
                path.write_text(json.dumps(data))
        return str(dst)

    return make


class HFReference:
    """HF transformers on the same checkpoint: greedy generate and teacher-forced logprobs (memoized)."""

    def __init__(self):
        self._models = {}
        self._greedy = {}

    def model(self, model_dir: str):
        if model_dir not in self._models:
            import torch
            from transformers import AutoModelForCausalLM

            self._models[model_dir] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, local_files_only=True).eval()
        return self._models[model_dir]

    def greedy(self, model_dir: str, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
        key = (model_dir, tuple(prompt), max_new_tokens, str(eos_token_id))
        if key not in self._greedy:
            import torch

            model = self.model(model_dir)
            ids = torch.tensor([prompt])
            # None means no eos at all, not the checkpoint's default: an id argmax never picks
            eos = model.config.vocab_size if eos_token_id is None else eos_token_id
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
            self._greedy[key] = out[0, len(prompt):].tolist()
        return self._greedy[key]

    def logprobs(self, model_dir: str, prompt: list[int], response: list[int], temperature: float = 1.0):
        """log_softmax(logits / temperature) of each response token, from one full forward."""
        import torch

        model = self.model(model_dir)
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        rows = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        return logp[rows, torch.tensor(response)].tolist()


@pytest.fixture(scope="session")
def hf_ref() -> HFReference:
    return HFReference()


@pytest.fixture(scope="session")
def example_model_dir() -> str:
    path = REPO_ROOT / "recipes" / "example_model"
    assert (path / "config.json").is_file(), f"{path} is missing; run recipes/make_example_model.py"
    return str(path)


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory) -> dict:
    from hub_cache import make_hub_cache  # tests/hub_cache.py: tests/ is on sys.path once this file loads

    return make_hub_cache(tmp_path_factory.mktemp("hf_hub_cache"))
