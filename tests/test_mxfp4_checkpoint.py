"""gpt-oss's Hugging Face release stores its experts as MXFP4 blocks and scales (issue 45): offload reads them as
stored, as GGUF's MXFP4 blocks, and computes with them. The dequantized values are bit for bit transformers' and
gguf-py's. On the CPU the experts run in the fused MXFP4 kernels with int8 activations (as llama.cpp's mxfp4 x q8_0
dot products): the model's logits within KERNEL_TOLERANCE of transformers' in fp32 on the same dequantized weights;
streamed to a GPU they are dequantized there, transformers' math (within 1e-4 of the range)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_logits_close, hf_logits, make_hf_model, offload_logits, save_hf_model
from offload.formats import AS_STORED
from offload.spec import load_spec
from offload.weights import mxfp4
from offload.weights.loader import Checkpoint
from offload.weights.sources import load_model

# The fused kernels' int8 activations against transformers' fp32, of the logit range: as test_formats.py's
# KERNEL_TOLERANCE for the other fused GGUF types (measured 1.2e-2 here; the kernels alone are held to the dequantized
# fp32 matmul in test_kernels_gguf.py, and to int8 activations dequantized and multiplied in fp32 within 2e-7).
KERNEL_TOLERANCE = 5e-2


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks [..., G, 16] and scales [..., G] (exponents near 2^-3, so the weights stay small)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(122, 126, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_the_dequantized_values_are_transformers_and_gguf_pys_bit_for_bit():
    from gguf import GGMLQuantizationType, quants
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 10, 4), seed=0)  # [E, out, G]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out] (4.x: [E, out, in])
    theirs = theirs if theirs.shape[1] == 10 else theirs.transpose(1, 2)
    for e in range(3):
        raw = mxfp4.gguf_blocks(blocks[e], scales[e])
        ours = mxfp4.dequantize(raw)
        assert torch.equal(ours, theirs[e])
        gguf_py = quants.dequantize(raw.numpy(), GGMLQuantizationType.MXFP4).reshape(10, -1)
        assert np.array_equal(ours.numpy(), gguf_py)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A tiny gpt-oss folder laid out as the release is: experts as MXFP4 blocks and scales, quantization_config
    mxfp4; and transformers' model with those experts dequantized."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = make_hf_model("gpt_oss", num_attention_heads=8, num_key_value_heads=2)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    tensors = load_file(folder / "model.safetensors")
    cfg = hf.config
    e, d, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    state = hf.state_dict()
    # transformers 5 dequantizes to the float layout [E, in, out]; 4 to [E, out, in]
    rows_first = convert_moe_packed_tensors(*_random_mxfp4((1, 3, 1), seed=9), dtype=torch.float32).shape[1] == 3
    for i in range(cfg.num_hidden_layers):
        for j, (name, (out, inp)) in enumerate((("gate_up_proj", (2 * f, d)), ("down_proj", (d, f)))):
            key = f"model.layers.{i}.mlp.experts.{name}"
            # a seed of its own per tensor, the same in every process (hash() of a str is salted per process)
            blocks, scales = _random_mxfp4((e, out, inp // 32), seed=2 * i + j)
            del tensors[key]
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            state[key] = dense.transpose(1, 2) if rows_first else dense
    save_file(tensors, folder / "model.safetensors")
    hf.load_state_dict(state)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return hf, folder


def test_the_released_layout_is_read_as_stored_and_matches_transformers(released):
    hf, folder = released
    spec = load_spec(folder)
    model = load_model(Checkpoint(folder), spec)
    w = model.experts[0].gate_up[0]
    assert w.fmt == "mxfp4" and tuple(w.shape) == (2 * hf.config.intermediate_size, hf.config.hidden_size)
    unit = next(u for u in spec.units() if u.kind == "experts")
    assert unit.held_formats(AS_STORED, "fp32") == ("mxfp4",)  # the planner sizes them at 4.25 bits a weight
    ids = torch.randint(0, 160, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_logits_close(offload_logits(model, ids), hf_logits(hf, ids), rel=KERNEL_TOLERANCE)


def test_a_quantization_asked_for_requantizes_the_experts(released):
    hf, folder = released
    model = load_model(Checkpoint(folder), load_spec(folder), quantization="q8_0")
    assert model.experts[0].gate_up[0].fmt == "q8_0"
    ids = torch.randint(0, 160, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_logits_close(offload_logits(model, ids), hf_logits(hf, ids), rel=3e-2)


@pytest.mark.parametrize("weights,compute", [("cpu", "cpu"), ("cpu", "stream"), ("disk", "cpu")])
def test_every_placement_computes_the_stored_experts_as_the_resident_model(released, weights, compute):
    """As stored on the CPU (the fused MXFP4 kernels) and read from disk: the resident model's logits within 1e-5 of
    their range; streamed to the simulated GPU (dequantized there, fp32 matmuls): transformers' within 1e-4. Each way
    is held to its own reference: the CPU kernels' int8 activations can flip a near-tied routing of a random model
    (one draw of these experts moved a logit by 0.19 of the range so), which no tolerance of the kernels covers."""
    from conftest import gpu_profile
    from offload.planner.placement import Placement
    from offload.runtime.backends.cpu import CPUBackend
    from offload.runtime.backends.sim import SimBackend
    from offload.runtime.executor import PlacedModel
    from offload.weights.sources import CheckpointSource

    hf, folder = released
    spec = load_spec(folder)
    backend = SimBackend(gpu_profile()) if compute == "stream" else CPUBackend()
    model = PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, torch.float32),
                        Placement.uniform(spec, weights, compute), backend)
    ids = torch.randint(0, 160, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    if compute == "stream":
        assert_logits_close(offload_logits(model, ids), hf_logits(hf, ids), rel=1e-4)
    else:
        resident = load_model(Checkpoint(folder), spec)
        assert_logits_close(offload_logits(model, ids), offload_logits(resident, ids), rel=1e-5)
