"""The substitute draft (speculative method substitute) loaded beside its model: on a plan with GPU layers, the
model's resident units shared and copies of its far units placed as the planner's SubstituteLayout says
(planner/substitutes.py); checked to keep each layer's KV cache where the model keeps it (or a mirror of it in
VRAM); and its drafter (SubstituteDrafter), which drafts over the model's own cache. draft_runs steps any draft
model's generator over its runs (speculative.ModelDrafter's too)."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from offload.attention_sizes import kv_blocks
from offload.errors import ConfigError
from offload.kv_pool import block_slots
from offload.planner import Placement
from offload.planner.request import plan_weight_format
from offload.planner.substitutes import copy_sizes, draft_placement, gpu_fused, layout_on
from offload.runtime.device_quant import set_gpu_crossover
from offload.sampling import SamplingParams
from offload.sequence import Sequence
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
                       gpu_fused(copy_spec, fmt, compute), priced.mirror)
    if layout is None:
        raise ConfigError(f"speculative method substitute: the {priced.label or fmt} copies of the units the model "
                          f"streams at batch {llm.max_batch_size} do not fit the {format_bytes(room)} of VRAM set "
                          f"aside for them; set batch_size 1, as speculation is priced")
    placement = draft_placement(Placement.from_plan(llm.plan), layout)
    shared = {name: (llm.model.layouts[name], llm.model.resident[name]) for name in layout.shared}
    request = llm.request.with_options(model=path, quantization=options.draft_quantization, dtype=compute)
    draft = type(llm).__new__(type(llm))
    draft._load(request, placement, None, shared=shared, text=False)
    draft.mirrored = tuple(sorted(int(name.split(".")[1]) for name in layout.mirrored))  # SubstituteDrafter's
    set_gpu_crossover(llm.request.profile().gpu_crossover())  # the model's kernels by rows, as its plan measured
    return draft


def check_substitute(draft, llm) -> None:
    """ConfigError where the substitute draft cannot draft over llm's KV cache: a layer whose cache the draft would
    keep on another tier than llm (but for the layers whose host KV it mirrors in VRAM), or another compute format
    than the cache's."""
    mirrored = set(getattr(draft, "mirrored", ()))
    for i in range(llm.spec.n_layers):
        mine, theirs = draft.model.placement[f"layer.{i}"].kv, llm.model.placement[f"layer.{i}"].kv
        if mine != theirs and not (i in mirrored and (mine, theirs) == ("gpu", "cpu")):
            raise ConfigError(SUBSTITUTE_MISMATCH)
    if draft.model.dtype != llm.model.dtype:
        raise ConfigError(SUBSTITUTE_MISMATCH)


class SubstituteDrafter:
    """The model's own weights in a smaller format propose k tokens greedily over the model's own KV cache (SubSpec's
    substitutes, every unit substituted: a CPU plan's units are all far). The draft keeps no cache and prefills
    nothing: a sequence's positions before its last token hold the model's K and V, which the draft attends to; it
    writes its own for the last token and its proposals into the sequence's extent past its length, where the
    verifying step writes the model's over them (as rejected proposals are rolled back)."""

    def __init__(self, draft):
        """draft: an offload LLM of the model's weights in the draft's format, its compute format the model's; its
        mirrored layers (a GPU plan's copies in VRAM of layers whose KV the model keeps in host RAM) attend to a
        copy of that KV in VRAM, refreshed before each drafting round."""
        self.draft, self.generator = draft, draft.generator
        self.cache, self.trash_slot = None, 0  # the engine's, as each step of the model hands them on (attach)
        self.seconds, self.passes = 0.0, 0
        self.alternatives: list[list] = []  # as ModelDrafter's
        self.mirrored: tuple[int, ...] = getattr(draft, "mirrored", ())
        self._mirror: dict[int, object] = {}  # layer -> its LayerKV's twin in VRAM, for the cache attached
        self._synced: dict[int, tuple] = {}  # id(sequence) -> (its blocks copied, positions copied) into the twins

    def attach(self, cache, trash_slot: int) -> None:
        if self.mirrored and cache is not self.cache:
            backend = self.draft.backend
            for kv in self._mirror.values():
                backend.free("gpu", kv.nbytes)
            self._mirror = {i: _device_twin(cache[i], backend.meta_or(backend.device)) for i in self.mirrored}
            self._synced = {}
            for kv in self._mirror.values():
                backend.track("gpu", kv.nbytes)
        self.cache, self.trash_slot = cache, trash_slot

    def _drafts_over(self, seqs: list[tuple[object, int]]) -> list:
        """The cache the draft attends to: the model's, with each mirrored layer's twin in VRAM brought up to date
        for seqs ((sequence, positions the model has cached) each): the positions the model wrote since the last
        round, by the sequence's block table (a ring layer's small cache whole). The draft's own rows past a
        sequence's cached positions are rewritten by the next round's copy."""
        if not self._mirror:
            return self.cache
        slots = []
        for seq, n in seqs:
            table = seq.table(seq.n_blocks)
            done_table, done = self._synced.get(id(seq), ((), 0))
            start = done if table[:len(done_table)] == list(done_table) else 0
            slots.append(block_slots(table)[start:n])
            self._synced[id(seq)] = (tuple(table[:kv_blocks(n)]), n)
        index = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
        on_device = index.to(next(iter(self._mirror.values())).k.device)
        for i, twin in self._mirror.items():
            host = self.cache[i]
            for dst, src in ((twin.k, host.k), (twin.v, host.v)):
                if host.ring is not None:
                    dst.copy_(src)
                elif len(index):
                    dst[0].index_copy_(0, on_device, src[0, index].to(dst.device))
        return [self._mirror.get(i, kv) for i, kv in enumerate(self.cache)]

    def forget(self, seq) -> None:
        self._synced.pop(id(seq), None)

    def propose(self, tokens: list[int], k: int, seq=None) -> list[int]:
        return self.propose_many([(tokens, k, seq)])[0]

    def propose_many(self, asks: list[tuple[list[int], int, object]], alternatives: bool = False) -> list[list[int]]:
        """Proposals for several sequences ((tokens, k, seq) each, seq running in the engine whose cache is
        attached), drafted together: each pass over the draft's weights serves every sequence still drafting."""
        runs = []
        for tokens, k, seq in asks:
            if k <= 0 or seq is None or self.cache is None or not seq.admitted:
                runs.append(None)
                continue
            run = Sequence(seq.request_id, tokens, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
            run.blocks, run.extent, run.ring, run.n_cached = seq.blocks, seq.extent, seq.ring, len(tokens) - 1
            run.shared = seq.shared  # its table: the blocks the prefix cache maps, then its own
            run.generator = torch.Generator()
            runs.append(run)
        start = self.generator.now()  # the mirrors' copy counts as drafting
        cache = self._drafts_over([(seq, len(tokens) - 1) for (tokens, _, seq), run in zip(asks, runs)
                                   if run is not None])
        self.seconds += self.generator.now() - start
        draft_runs(self, runs, cache, self.trash_slot, alternatives)
        return [[] if run is None else run.output_ids for run in runs]


def _device_twin(kv, device):
    """A LayerKV like kv (its ring too) whose K and V are new tensors on device."""
    twin = copy.copy(kv)
    twin.k, twin.v = torch.empty_like(kv.k, device=device), torch.empty_like(kv.v, device=device)
    return twin


def draft_runs(drafter, runs: list, cache, trash_slot: int, alternatives: bool = False) -> None:
    """Step the drafter's generator over its runs (None: a sequence it drafts nothing for) until each has its k
    tokens, one pass over the draft's weights serving every run still drafting; its passes and seconds counted.
    alternatives: each run keeps its next likeliest token at each (drafter.alternatives, by run)."""
    active, start = [r for r in runs if r is not None], drafter.generator.now()  # the draft's clock: a simulated
    # device's own
    for run in active:
        run.alternatives = [] if alternatives else None
    with torch.inference_mode():
        while active:
            drafter.generator.step(active, cache, trash_slot)
            drafter.passes += 1
            active = [r for r in active if not r.finish_reason]
    drafter.seconds += drafter.generator.now() - start
    drafter.alternatives = [(run.alternatives or []) if run is not None else [] for run in runs]
