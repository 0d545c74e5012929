"""Shared fixtures: tiny random Hugging Face models written to disk, and the default model."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The tests neither read nor write the user's offload cache: a calibrated profile or a recorded process baseline
# there would move every plan (each session starts from the estimate and the documented baseline). It goes when the
# session ends (about 100 MB of converted models each run left in /tmp otherwise).
os.environ["OFFLOAD_CACHE"] = __import__("tempfile").mkdtemp(prefix="offload-test-cache-")
atexit.register(shutil.rmtree, os.environ["OFFLOAD_CACHE"], ignore_errors=True)

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False)


# tiny mixtures of experts: 6 experts of width 32 (wide enough to quantize), 2 per token
TINY_MOE = {"mixtral": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=64),
            "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64,
                              shared_expert_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1]),
            "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32,
                              norm_topk_prob=True),
            "gpt_oss": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=64, head_dim=16,
                            sliding_window=6, layer_types=None)}


# the dense families' tiny shapes beyond TINY: Gemma's heads are wider than hidden / heads and its scale differs
TINY_DENSE = {"gemma2": dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=6),
              "gemma3_text": dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=6, sliding_window_pattern=3,
                                  layer_types=None, num_hidden_layers=3),
              "qwen3": dict(head_dim=32), "phi3": dict(pad_token_id=0), "seed_oss": dict(head_dim=32)}
FAMILY_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "mixtral": "Mixtral",
                  "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "qwen3": "Qwen3", "gemma2": "Gemma2",
                  "gemma3_text": "Gemma3Text", "phi3": "Phi3", "gpt_oss": "GptOss", "olmo2": "Olmo2",
                  "seed_oss": "SeedOss"}


def make_hf_model(arch: str = "llama", **overrides):
    """A tiny randomly initialised transformers model in fp32 (weights scaled up so logits spread)."""
    import transformers

    name = FAMILY_CLASSES[arch]
    if not hasattr(transformers, f"{name}Config"):  # a family newer than the transformers floor (scripts/test_floor.sh)
        pytest.skip(f"transformers {transformers.__version__} has no {name} models")
    config_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, "Gemma3ForCausalLM" if arch == "gemma3_text" else f"{name}ForCausalLM")
    torch.manual_seed(overrides.pop("seed", 0))
    config = config_cls(**{**TINY, **TINY_MOE.get(arch, {}), **TINY_DENSE.get(arch, {}), **overrides})
    config._attn_implementation = "eager"
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15)
    return model


def save_hf_model(model, folder: Path, max_shard_size: str | None = None) -> Path:
    """Write a transformers model as safetensors (sharded if max_shard_size is given)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def gpu_profile(name: str = "rtx4090-ddr5"):
    """A GPU preset without its CUDA-context reserve, for plans with a GPU budget of a few KiB or MiB."""
    from offload.hardware import load_hardware

    return load_hardware(name).with_changes(gpu_reserved_bytes=0)


@pytest.fixture(autouse=True)
def no_packed_cache(monkeypatch):
    """Tests load quantized models without the packed-weight cache (tests/test_packed_cache.py turns it on,
    in a folder of its own): it would fill the user's cache with entries of throwaway checkpoints."""
    monkeypatch.setenv("OFFLOAD_PACKED_CACHE", "0")


SLOW_FIXTURES = {"default_model_dir", "default_llm", "default_hf", "default_gguf_llm"}  # the default model (~1 min)


def pytest_collection_modifyitems(items):
    """Tests that use the default model are slow (marker `slow`): `pytest -m "not slow"` skips them."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def tiny_llama(tmp_path) -> tuple[object, Path]:
    model = make_hf_model("llama")
    return model, save_hf_model(model, tmp_path / "tiny-llama")


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The default model as an fp32 safetensors folder (transformers dequantizes its GGUF file): the float
    reference the fp32 paths are held to. offload itself reads the GGUF file (LLM("default"))."""
    from offload.weights.default_model import find_gguf

    folder = tmp_path_factory.mktemp("default-model") / "smollm2-135m-instruct"
    convert_gguf(find_gguf(), folder)
    return folder


def convert_gguf(gguf_path: Path, folder: Path) -> Path:
    """Dequantize a GGUF model with transformers and write config, tokenizer and fp32 safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights are fp32 now; lm-eval's HF backend would load it as GGUF
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def default_gguf_llm():
    """offload on the default model's GGUF file, tensors as stored (Q4_1 linears, Q8_0 embedding)."""
    from offload import LLM

    return LLM("default")


@pytest.fixture(scope="session")
def default_llm(default_model_dir):
    from offload import LLM

    return LLM(str(default_model_dir))


@pytest.fixture(scope="session")
def default_hf(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def offload_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [S, V] of offload's forward over one sequence in a single prefill pass."""
    tokens = torch.tensor([token_ids])
    positions = torch.arange(len(token_ids))[None]
    cache = model.new_cache(1, len(token_ids))
    step = model.make_step(positions, torch.ones_like(positions, dtype=torch.bool), trash_slot=len(token_ids))
    with torch.inference_mode():
        return model.logits(model.forward(tokens, step, cache))[0]


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """Max absolute difference within rel x the reference's logit range."""
    span = float(ref.max() - ref.min())
    diff = float((ours - ref).abs().max())
    assert diff <= rel * span, f"max |diff| {diff:.3g} exceeds {rel} x logit range {span:.3g}"


def write_config(folder: Path, **changes) -> None:
    """Edit a saved model's config.json in place (None removes a key)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python that imports offload from this checkout."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_interpreted(worker: str, inputs: dict, folder: Path) -> dict:
    """The outputs worker writes for inputs, run with TRITON_INTERPRET=1 in a child process (setting it here would
    make every later test's kernels interpreted); worker takes the inputs' and the outputs' .pt paths."""
    torch.save(inputs, folder / "in.pt")
    proc = subprocess.run([sys.executable, "-c", worker, str(folder / "in.pt"), str(folder / "out.pt")],
                          env=child_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreted kernels failed:\n{proc.stderr[-4000:]}"
    return torch.load(folder / "out.pt", weights_only=False)


def assert_thread_count_invariant(linear, x: torch.Tensor, w, bias) -> torch.Tensor:
    """linear(x, w, bias) on one thread and on two gives the same bits (each row is computed whole by one
    thread, in the same order); returns it."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, w, bias)
        torch.set_num_threads(2)
        two = linear(x, w, bias)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)
    return one
