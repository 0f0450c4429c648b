"""`--kv-cache-dtype fp8` on the CPU (issue 20, item 5): the engine against HF transformers whose
attention reads k and v rounded to e4m3 the same way (scale 1.0), in float32 math: greedy tokens
exact, logprobs to 1e-4, for every tiny architecture, a MoE and a hybrid model, through chunked
prefill and prefix sharing. Then the price against the model-dtype cache, the memory it saves, and
the CLI (the manifest records it; --resume refuses the other cache; bad values get one line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import HFReference
from parity import assert_matches_hf, make_engine, prompts_of
from rollout_cli import Engine, SamplingParams
from rollout_cli.errors import RolloutError
from rollout_kernels.kv_fp8_ref import KV_FP8_DTYPE, KV_FP8_MAX

REPO = Path(__file__).resolve().parents[2]
PROMPTS = prompts_of([5, 17, 9], seed=33)
MAX_NEW = 8
GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
FP8_KV = "rollout_fp8_kv_reference"


def _register_fp8_kv_attention() -> None:
    """An HF attention implementation that rounds every key and value it reads to e4m3 (scale 1.0),
    as the engine's pool holds them, then runs HF's own SDPA attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
        def rounded(x):
            return x.clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8_DTYPE).to(x.dtype)
        return sdpa_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kwargs)

    AttentionInterface.register(FP8_KV, fp8_kv_attention)


class FP8KVHF(HFReference):
    def model(self, model_dir: str):
        if model_dir not in self._models:
            from transformers import AutoModelForCausalLM

            _register_fp8_kv_attention()
            self._models[model_dir] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, local_files_only=True, attn_implementation=FP8_KV).eval()
        return self._models[model_dir]


@pytest.fixture(scope="module")
def fp8_kv_hf() -> FP8KVHF:
    return FP8KVHF()


def _fp8_engine(model_dir, **options):
    return make_engine(model_dir, kv_cache_dtype="fp8", max_batch_tokens=8, **options)  # chunked prefill


def test_fp8_kv_cache_matches_hf_reading_the_same_e4m3_keys(arch, fp8_kv_hf):
    _, model_dir = arch
    engine = _fp8_engine(model_dir)
    assert engine.kv.k.dtype == engine.kv.v.dtype == KV_FP8_DTYPE
    results = engine.generate(PROMPTS + [PROMPTS[1]], GREEDY)  # the repeat hits the prefix cache
    assert_matches_hf(fp8_kv_hf, model_dir, results, PROMPTS + [PROMPTS[1]], MAX_NEW, n=2)
    assert sum(t.cached_prompt_tokens for t in results) > 0  # keys read back from the cache, not recomputed


@pytest.mark.parametrize("family", ["moe", "hybrid"])
def test_fp8_kv_cache_on_moe_and_hybrid_models(family, tiny_moe_checkpoints, tiny_hybrid_checkpoints, fp8_kv_hf):
    checkpoints = tiny_moe_checkpoints if family == "moe" else tiny_hybrid_checkpoints
    model_dir = checkpoints[sorted(checkpoints)[0]]
    results = _fp8_engine(model_dir).generate(PROMPTS, GREEDY)
    assert_matches_hf(fp8_kv_hf, model_dir, results, PROMPTS, MAX_NEW, n=2)


def test_fp8_kv_cache_price_against_the_model_dtype_cache(sampling_checkpoint, hf_ref):
    """The fp8 run's logprobs against the unquantized model's (HF float32 teacher forcing on the same
    sampled tokens): the off-policy gap a trainer corrects for. e4m3 rounds k and v by up to 1/16 of
    their value; the sharper the attention, the more that moves a logprob. Measured here (tiny qwen3,
    weights drawn with std 0.1, 16 tokens x 6 samples): mean 0.035, max 0.13 nats; bound: mean 0.06,
    max 0.3. Larger random weights sharpen attention and widen it (std 0.4: mean 0.14)."""
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=16, ignore_eos=True)
    results = _fp8_engine(sampling_checkpoint).generate(PROMPTS, params)
    gaps = []
    for traj in results:
        exact = hf_ref.logprobs(sampling_checkpoint, PROMPTS[traj.prompt_index], traj.response_token_ids)
        gaps += [abs(a - b) for a, b in zip(traj.response_logprobs, exact, strict=True)]
    mean, worst = sum(gaps) / len(gaps), max(gaps)
    assert 0.0 < mean < 0.06 and worst < 0.3, (mean, worst)


def test_fp8_pool_takes_a_quarter_of_float32_and_half_of_bfloat16_per_token(tiny_checkpoints):
    model_dir = tiny_checkpoints["qwen3"]
    per_token = {(dtype, kv): Engine(model_dir, device="cpu", dtype=dtype, kv_cache_dtype=kv, max_model_len=32,
                                     kv_cache_tokens=64).kv.bytes_per_token_of_pool
                 for dtype in ("float32", "bfloat16") for kv in ("auto", "fp8")}
    assert per_token[("float32", "fp8")] == per_token[("bfloat16", "fp8")]
    assert per_token[("float32", "auto")] == 4 * per_token[("float32", "fp8")]
    assert per_token[("bfloat16", "auto")] == 2 * per_token[("bfloat16", "fp8")]


def test_fp8_kv_cache_refuses_the_on_policy_mode_and_unknown_dtypes(tiny_checkpoints):
    with pytest.raises(RolloutError, match="--deterministic"):
        make_engine(tiny_checkpoints["qwen3"], kv_cache_dtype="fp8", deterministic=True)
    with pytest.raises(RolloutError, match="unknown --kv-cache-dtype 'int4'"):
        make_engine(tiny_checkpoints["qwen3"], kv_cache_dtype="int4")
    assert make_engine(tiny_checkpoints["qwen3"], kv_cache_dtype="fp8_e4m3").config.kv_cache_dtype == "fp8"


def _rollout(*args, cwd):
    return subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_cli_run_records_the_cache_dtype_and_resume_refuses_another(tmp_path):
    data = tmp_path / "prompts.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["What is 2 + 3?", "Name a colour.", "Count to four."]}), data)
    out = tmp_path / "traj"
    common = ["run", "--model", str(REPO / "recipes/example_model"), "--data", str(data), "--out", str(out),
              "--max-new-tokens", "6", "--n", "2"]
    done = _rollout(*common, "--kv-cache-dtype", "fp8", cwd=REPO)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_cache_dtype"] == "fp8" and manifest["status"] == "complete"
    refused = _rollout(*common, "--resume", cwd=REPO)
    assert refused.returncode != 0
    assert "kv_cache_dtype='fp8'" in refused.stderr and "Traceback" not in refused.stderr
    bad = _rollout(*common[:-4], "--out", str(tmp_path / "other"), "--kv-cache-dtype", "fp4", cwd=REPO)
    assert bad.returncode != 0 and "unknown --kv-cache-dtype 'fp4'" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "other" / "manifest.json").exists()


def test_cpu_install_without_triton_runs_the_fp8_kv_cache(tmp_path):
    """triton is a test extra (CPU torch wheels lack it): the torch path, fp8 pools included, must not
    import it. Run with the import blocked, in a fresh interpreter."""
    script = tmp_path / "no_triton.py"
    script.write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('triton is not installed here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from rollout_cli import Engine, SamplingParams\n"
        f"engine = Engine({str(REPO / 'recipes/example_model')!r}, kv_cache_dtype='fp8', max_model_len=64, max_running=2)\n"
        "print(len(engine.generate(['hi'], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].response_token_ids))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "3"
