"""The host's seconds to run one decode step of a GPU layer and of a GPU experts unit (the Python that dispatches
their kernels), as `offload calibrate` measures them on a GPU and the planner prices them.

A tiny model (every unit resident on the device, bf16 random weights, shapes far below what keeps a GPU busy) is
decoded at batch 1: its wall time per step is then the host's, spread over its units by their launches (a dense
model's over its layers; a MoE model's, less its layers' share, over its experts units). The device's own seconds
for the same units (the timeline's gpu_block spans, from CUDA events) are reported beside it, so a caller can
check that the device was the idle side.
"""

from __future__ import annotations

import time

import torch

from offload.planner.costs import DENSE_LAYER_LAUNCHES, unit_launches
from offload.planner.placement import Placement
from offload.spec import ModelSpec, spec_from_config

DENSE_CONFIG = dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5, tie_word_embeddings=False)
MOE_CONFIG = dict(DENSE_CONFIG, model_type="qwen3_moe", num_experts=32, num_experts_per_tok=4,
                  moe_intermediate_size=128, head_dim=32, norm_topk_prob=True)
N_STEPS = 20  # decode steps timed (after 3 warm-up steps)


def measure_host_s(backend_factory, log=print) -> dict[str, float]:
    """{"layer": host seconds of one dense decode layer, "experts": of one MoE experts unit, and "*_device_s": the
    device's seconds for each} on backends backend_factory() makes."""
    spec = spec_from_config(DENSE_CONFIG)
    wall, device = _decode_s(spec, backend_factory(), "layer")
    launches = {u.name: unit_launches(spec, u) for u in spec.units()}
    layer = wall / sum(launches.values()) * DENSE_LAYER_LAUNCHES  # the step's few other launches as the layers'
    spec = spec_from_config(MOE_CONFIG)
    wall, experts_device = _decode_s(spec, backend_factory(), "experts")
    layers = sum(layer * unit_launches(spec, u) / DENSE_LAYER_LAUNCHES for u in spec.units() if u.kind == "layer")
    experts = max(wall - layers, 0.0) / sum(u.kind == "experts" for u in spec.units())
    log(f"host: {layer * 1e6:.0f} us per GPU decode layer (device {device * 1e6:.0f} us), "
        f"{experts * 1e6:.0f} us per MoE experts unit (device {experts_device * 1e6:.0f} us)")
    return {"layer": layer, "experts": experts, "layer_device_s": device, "experts_device_s": experts_device}


def _decode_s(spec: ModelSpec, backend, kind: str) -> tuple[float, float]:
    """(wall seconds of one batch-1 decode step, the device's seconds of one unit of kind in it)."""
    from offload.runtime.executor import PlacedModel
    from offload.weights.sources import RandomSource

    model = PlacedModel(spec, RandomSource(spec, torch.bfloat16, "none"), Placement.uniform(spec, "gpu", "gpu"),
                        backend, torch.bfloat16)
    try:
        wall = _decode_wall_s(model)
    finally:
        model.close()
    spans = [s.duration_s for s in model.timeline.spans
             if s.kind == "gpu_block" and s.phase == "decode" and s.unit.startswith(kind)]
    return wall, sum(spans) / max(len(spans), 1)


def _decode_wall_s(model) -> float:
    """Median wall seconds of one batch-1 decode step (forward and logits) after a few warm-up steps."""
    cache = model.new_cache(1, N_STEPS + 8)
    times = []
    with torch.inference_mode():
        for i in range(N_STEPS + 3):
            positions = torch.tensor([[i]])
            step = model.make_step(positions, torch.ones_like(positions, dtype=torch.bool), trash_slot=N_STEPS + 8,
                                   phase="decode")
            start = time.perf_counter()
            model.logits(model.forward(torch.tensor([[i % 200 + 1]]), step, cache))
            times.append(time.perf_counter() - start)
            model.backend.collect()
    model.flush()
    times = sorted(times[3:])
    return times[len(times) // 2]
