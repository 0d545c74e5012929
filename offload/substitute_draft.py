"""The substitute draft (speculative method substitute) loaded beside its model: on a plan with GPU layers, the
model's resident units shared and copies of its far units placed as the planner's SubstituteLayout says
(planner/substitutes.py); checked to keep each layer's KV cache where the model keeps it."""

from __future__ import annotations

from dataclasses import replace

from offload.errors import ConfigError
from offload.planner import Placement
from offload.planner.request import plan_weight_format
from offload.planner.substitutes import copy_sizes, draft_placement, gpu_fused, layout_on
from offload.runtime.device_quant import set_gpu_crossover
from offload.units import format_bytes
from offload.weights.default_model import resolve_model
from offload.weights.model_files import model_spec

SUBSTITUTE_MISMATCH = ("speculative method substitute drafts over the model's KV cache: its layers must keep their "
                       "caches where the model's do, in the model's compute format; with a placement given, leave "
                       "the speculative section out, or let the planner place the model")


def load_substitute(options, llm, priced):
    """The substitute draft of llm on a plan with GPU layers (planner.substitutes): llm's resident units shared
    as they are, copies of the far units in the draft's format in the VRAM priced (the SubstituteLayout the
    planner chose, at batch 1) set aside, placed again on llm's own plan (its batch may be larger), on llm's backend
    kind and compute format."""
    path, compute, room = options.draft_path(str(llm.path)), llm.plan.workload.compute_format, priced.plan_held[0]
    copy_spec = replace(model_spec(resolve_model(path)), split_mlp=llm.spec.split_mlp)
    fmt = plan_weight_format(copy_spec, options.draft_quantization, compute)
    layout = layout_on(llm.plan, copy_sizes(copy_spec, fmt, compute), fmt, room, priced.label,
                       gpu_fused(copy_spec, fmt, compute))
    if layout is None:
        raise ConfigError(f"speculative method substitute: the {priced.label or fmt} copies of the units the model "
                          f"streams at batch {llm.max_batch_size} do not fit the {format_bytes(room)} of VRAM set "
                          f"aside for them; set batch_size 1, as speculation is priced")
    placement = draft_placement(Placement.from_plan(llm.plan), layout)
    shared = {name: (llm.model.layouts[name], llm.model.resident[name]) for name in layout.shared}
    request = llm.request.with_options(model=path, quantization=options.draft_quantization, dtype=compute)
    draft = type(llm).__new__(type(llm))
    draft._load(request, placement, None, shared=shared, text=False)
    set_gpu_crossover(llm.request.profile().gpu_crossover())  # the model's kernels by rows, as its plan measured
    return draft


def check_substitute(draft, llm) -> None:
    """ConfigError where the substitute draft cannot draft over llm's KV cache: a layer whose cache the draft would
    keep on another tier than llm, or another compute format than the cache's."""
    tiers = [[m.model.placement[f"layer.{i}"].kv for i in range(llm.spec.n_layers)] for m in (llm, draft)]
    if tiers[0] != tiers[1] or draft.model.dtype != llm.model.dtype:
        raise ConfigError(SUBSTITUTE_MISMATCH)
