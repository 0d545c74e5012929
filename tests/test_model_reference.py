"""offload's forward against transformers in fp32: max |diff| <= 1e-4 x logit range on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits, save_hf_model, write_config
from offload.weights.sources import load_model
from offload.spec import load_spec
from offload.weights.loader import Checkpoint

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-explicit-head-dim": ("llama", dict(head_dim=32)),
    "llama-attention-and-mlp-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-rope-linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-rope-dynamic": ("llama", dict(max_position_embeddings=16,
                                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama-rope-llama3": ("llama", dict(rope_theta=50000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "qwen2-qkv-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=5)),
}


def _prompt(n: int, vocab: int = 160, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _ours(folder):
    spec = load_spec(folder)
    return load_model(Checkpoint(folder), spec)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    arch, overrides = CASES[case]
    hf = make_hf_model(arch, **overrides)
    folder = save_hf_model(hf, tmp_path / case)
    ids = _prompt(24)  # longer than 16, so dynamic and llama3 scaling and the window all act
    assert_logits_close(offload_logits(_ours(folder), ids), hf_logits(hf, ids))


def test_sharded_checkpoint_matches(tmp_path):
    hf = make_hf_model("llama", num_hidden_layers=3)
    folder = save_hf_model(hf, tmp_path / "sharded", max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    ids = _prompt(12)
    assert_logits_close(offload_logits(_ours(folder), ids), hf_logits(hf, ids))


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_transformers_v4_config_layout(tmp_path, key):
    """rope_theta + rope_scaling (v4) gives the same model as rope_parameters (v5)."""
    hf = make_hf_model("llama", rope_scaling={"rope_type": "linear", "factor": 3.0}, rope_theta=20000.0)
    folder = save_hf_model(hf, tmp_path / "v4")
    write_config(folder, rope_parameters=None, rope_theta=20000.0, rope_scaling={key: "linear", "factor": 3.0})
    spec = load_spec(folder)
    assert (spec.rope.type, spec.rope.factor, spec.rope.theta) == ("linear", 3.0, 20000.0)
    ids = _prompt(20)
    assert_logits_close(offload_logits(_ours(folder), ids), hf_logits(hf, ids))


def test_bf16_checkpoint_loads(tmp_path):
    """A bf16 checkpoint computes in fp32 like transformers upcasting the same bf16 weights."""
    from transformers import LlamaForCausalLM

    folder = save_hf_model(make_hf_model("llama").to(torch.bfloat16), tmp_path / "bf16")
    config = json.loads((folder / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"  # transformers 4 writes torch_dtype
    reference = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = _prompt(10)
    assert_logits_close(offload_logits(_ours(folder), ids), hf_logits(reference, ids))


def test_default_model_logits_match(default_llm, default_hf):
    ids = default_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert_logits_close(offload_logits(default_llm.model, ids), hf_logits(default_hf, ids))


def test_bf16_linear_with_bias_through_the_cpu_kernel():
    """A row or two of bf16 activations go through offload's kernel (linear()'s half path): a bf16 bias (Qwen2's
    q/k/v) is added in fp32 there, as F.linear adds it; the result matches F.linear to bf16 rounding."""
    from offload.kernels.ops import linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    out = linear(x, w, b)
    assert out.dtype == torch.bfloat16 and float((out.float() - ref).abs().max()) <= 0.02 * float(ref.abs().max())
