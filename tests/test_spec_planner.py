"""ModelSpec arithmetic the planner relies on, by hand, and the shipped model configs."""

from pathlib import Path

import pytest

from offload.spec import load_spec, spec_from_config

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"


def tiny_config(**overrides) -> dict:
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256, "torch_dtype": "bfloat16"}
    return {**config, **overrides}


def test_layer_bytes_per_format_by_hand():
    spec = spec_from_config(tiny_config())
    layer = spec.units()[1]
    # q 64x64=4096, k and v 32x64=2048 each, o 4096, gate/up 128x64=8192 each, down 64x128=8192
    # -> linear 36864 weights; two norms of 64.
    assert layer.linear_numel == 36864
    assert layer.nbytes("bf16") == 2 * (36864 + 128)  # 73984
    assert layer.nbytes("q8_0") == 36864 // 32 * 34 + 128 * 4  # 39168 + 512 fp32 norms = 39680
    assert layer.nbytes("q4_0") == 36864 // 32 * 18 + 128 * 4  # 20736 + 512 = 21248
    assert layer.matmul_flops(3) == 2 * 36864 * 3


def test_embed_stays_in_the_compute_format_and_lm_head_quantizes():
    units = {u.name: u for u in spec_from_config(tiny_config()).units()}
    assert units["embed"].nbytes("q4_0", "fp16") == 256 * 64 * 2  # 32768: lookups stay in the compute format
    assert units["embed"].nbytes("q4_0", "fp32") == 256 * 64 * 4  # what the executor holds on the CPU
    assert units["lm_head"].nbytes("q4_0") == 256 * 64 // 32 * 18  # 9216
    assert units["embed"].linear_numel == 0


def test_buffer_bytes_align_every_plane():
    """A unit's flat buffer starts each plane at a multiple of 64 bytes: what a staging slot must hold."""
    spec = spec_from_config(tiny_config(intermediate_size=40))
    layer = spec.units()[1]
    # gate_proj [40, 64] in q4_0: 80 blocks -> 1280 quant bytes (aligned already) + 160 scale bytes -> 192
    gate = next(t for t in layer.tensors if t.name.endswith("gate_proj.weight"))
    assert gate.nbytes("q4_0") == 1280 + 160 and gate.buffer_bytes("q4_0") == 1280 + 192
    down = next(t for t in layer.tensors if t.name.endswith("down_proj.weight"))  # [64, 40]: not quantizable
    assert down.buffer_bytes("q4_0", "fp32") == 64 * 40 * 4
    assert layer.buffer_bytes("q4_0") >= layer.nbytes("q4_0") and layer.buffer_bytes("q4_0") % 64 == 0


def test_kv_attention_and_activation_by_hand():
    spec = spec_from_config(tiny_config())
    assert spec.kv_size == 32  # 2 kv heads x head_dim 16
    assert spec.layer_kv_bytes(2, 10, 2) == 2 * 2 * 10 * 32 * 2  # K and V, 2 seqs, 10 positions: 2560
    assert spec.attention_flops(3, 5) == 4 * 3 * 5 * 64  # QK^T and PV: 3840
    # per token: 3*64 + 64 (q) + 2*32 (k, v) + 2*128 (gate, up) = 576 elements. Attention: 8 tokens of one sequence
    # read the cache in place: one split (8 keys) for each of 2 KV heads, its 2 query heads x 8 queries of
    # head_dim 16 + max and sum in fp32: 4 * 2 * 16 * 18 = 2304
    assert spec.activation_bytes(8, 8, 2) == 8 * 576 * 2 + 2304  # 11520
    # 16 tokens of one sequence, a prefill chunk over 24 keys: the bool mask for the 2 heads of a group and its
    # own (3 x 16 x 24 = 1152), each query row's fp32 log-sum-exp (4 heads x 16 x 4 = 256); nothing gathered
    assert spec.activation_bytes(16, 24, 2) == 16 * 576 * 2 + 1152 + 256
    # 2 sequences' chunks: their K and V gathered too (2 x 2 sequences x 24 keys x 32 x 2 bytes = 6144)
    assert spec.activation_bytes(32, 24, 2, n_seqs=2) == 32 * 576 * 2 + 3 * 32 * 24 + 4 * 32 * 4 + 6144
    # decode at batch 32 over 4096 keys, Llama-70B's heads: the kernel's partials (decode_partials_bytes)
    from offload.attention_sizes import decode_partials_bytes

    assert decode_partials_bytes(32, 1, 64, 8, 128, 4096) == 4 * 32 * 8 * 2 * 8 * 130


def test_a_uniform_sliding_window_caps_attention_not_the_cache():
    """A model whose every layer has one window (Mistral 7B v0.1) keeps every position (the fused CPU layer reads a
    sequence's keys as one run; only models whose layers differ in window keep rings, tests/test_ring_kv.py), and
    its queries attend to the window's keys."""
    spec = spec_from_config(tiny_config(model_type="mistral", sliding_window=16))
    assert spec.kv_ring(0) is None and spec.kv_len(100) == 100
    assert spec.keys_seen(100) == 16 and spec.attention_flops(1, 100) == spec.attention_flops(1, 16)


@pytest.mark.parametrize("name, n_params_b, n_layers, vocab, tied", [
    ("llama-2-70b", 68.98, 80, 32000, False),
    ("llama-3.1-70b", 70.55, 80, 128256, False),
    ("llama-3.1-8b", 8.03, 32, 128256, False),
    ("qwen2.5-72b", 72.71, 80, 152064, False),
    ("mistral-7b", 7.24, 32, 32000, False),
    ("smollm2-135m", 0.1345, 30, 49152, True),
    ("mixtral-8x7b", 46.70, 32, 32000, False),
    ("qwen3-30b-a3b", 30.53, 48, 151936, False),
    ("qwen3-235b-a22b", 235.09, 94, 151936, False),
])
def test_shipped_model_configs_match_published_sizes(name, n_params_b, n_layers, vocab, tied):
    spec = load_spec(MODELS / name)
    assert spec.n_layers == n_layers and spec.vocab_size == vocab and spec.tie_word_embeddings == tied
    assert spec.n_params / 1e9 == pytest.approx(n_params_b, rel=2e-3)


def test_llama3_70b_kv_matches_design_reference():
    spec = load_spec(MODELS / "llama-3.1-70b")
    assert spec.kv_bytes_per_token(2) == 320 * 2**10  # 0.31 MiB per token in fp16 (DESIGN.md)
    assert spec.rope.type == "llama3" and spec.rope.factor == 8.0
    assert load_spec(MODELS / "qwen2.5-72b").qkv_bias
    assert load_spec(MODELS / "mistral-7b").sliding_window == 4096


def test_a_moe_layers_workspace_holds_the_grouped_paths_buffers():
    """The grouped expert path (kernels/triton_moe.py) holds per token its picked pairs' activations [top_k x F]
    and their down outputs [top_k x d]: Qwen3-30B-A3B's shape (d 2048, 8 of 128 experts of 768) needs
    6144 + 16384 = 22528 values there, more than gate and up's 2 x 6144."""
    from offload.spec import spec_from_config

    spec = spec_from_config({"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                             "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                             "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
                             "head_dim": 128, "vocab_size": 1000, "max_position_embeddings": 4096})
    d, f = 2048, 8 * 768
    attention = 3 * d + spec.q_size + 2 * spec.kv_size + 2 * d
    partials = 4 * 1 * 4 * 1 * (8 * 1) * (2 + 128)  # one token over 16 keys: one split per KV head
    assert spec.activation_bytes(1, 16, 2) == (attention + f + 8 * d) * 2 + partials
