"""Schedule tests on the CPU backend: prefetch order, staging-slot bounds, disk read-ahead bounds, peak memory."""

from __future__ import annotations

import pytest

from offload.planner.costs import read_ahead_bytes
import torch

from conftest import gpu_profile, make_hf_model, save_hf_model
from offload import LLM, SamplingParams
from offload.weights.sources import CheckpointSource
from offload.runtime.backends.cpu import CPUBackend
from offload.runtime.executor import PlacedModel
from offload.planner.placement import Placement
from offload.runtime.staging import StagingRing
from offload.spec import load_spec
from offload.weights.loader import Checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = make_hf_model("llama", num_hidden_layers=8, hidden_size=128, intermediate_size=256)
    return save_hf_model(hf, tmp_path_factory.mktemp("m") / "tiny8")


def run_placed(folder, placement, n_prompts=3, max_tokens=4):
    spec = load_spec(folder)
    model = PlacedModel(spec, CheckpointSource(Checkpoint(folder), spec, torch.float32), placement, CPUBackend())
    llm_like = LLMOver(model)
    llm_like.generate(n_prompts, max_tokens)
    return model


class LLMOver:
    """Just enough of a generator run over a PlacedModel."""

    def __init__(self, model):
        from offload.generate import Generator

        self.model, self.gen = model, Generator(model, max_batch_size=4)

    def generate(self, n_prompts: int, max_tokens: int):
        from offload.engine import run_to_end
        from offload.sequence import Sequence

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        seqs = [Sequence(i, [3 + i, 9, 27, 81, 5][: 2 + i], params) for i in range(n_prompts)]
        run_to_end(self.gen, seqs)
        return seqs


def forward_passes(log):
    """The backend's event log cut into forward passes (each ends when lm_head releases its slot)."""
    passes, current = [], []
    for event in log:
        current.append(event)
        if event[0] == "release" and event[1] == "lm_head":
            passes.append(current)
            current = []
    return passes


@pytest.mark.parametrize("k", [1, 2, 3])
def test_copy_of_block_j_plus_k_is_issued_as_block_j_is_released(model_dir, k):
    spec = load_spec(model_dir)
    model = run_placed(model_dir, Placement.uniform(spec, "cpu", "stream", prefetch_depth=k))
    order, log = model.order, model.backend.log
    passes = forward_passes(log)
    assert len(passes) >= 4 and all([u for e, u, _ in p if e == "compute"] == order for p in passes)
    # Across steps too (the next step's first blocks are copied ahead): the n-th block computed is the n-th
    # copied; blocks n+1 .. n+k-1 were being copied when block n computed, and block n+k's copy is issued
    # into block n's slot as soon as n is released, before block n+1 computes.
    copies = [i for i, (e, _, _) in enumerate(log) if e == "copy"]
    computes = [i for i, (e, _, _) in enumerate(log) if e == "compute"]
    releases = [i for i, (e, _, _) in enumerate(log) if e == "release"]
    assert [log[i][1] for i in copies[:len(computes)]] == [log[i][1] for i in computes]
    for n in range(len(computes) - 1):
        assert all(copies[m] < computes[n] for m in range(n + 1, min(n + k, len(copies))))
        if n + k < len(copies):
            assert releases[n] < copies[n + k] < computes[n + 1]
    assert model.ring.n_slots == k and model.ring.max_in_use <= k


def test_slot_never_overwritten_while_in_use(model_dir):
    spec = load_spec(model_dir)
    model = run_placed(model_dir, Placement.random(spec, 5, prefetch_depth=2))
    state = {}  # slot -> unit currently held, until released
    for event, unit, slot in model.backend.log:
        if event == "copy":
            assert slot not in state, f"slot {slot} overwritten by {unit} while {state.get(slot)} used it"
            state[slot] = unit
        elif event == "compute":
            assert state.get(slot) == unit
        elif event in ("release", "discard"):  # discard: copied ahead for a step that did not use it
            assert state.pop(slot) == unit


def test_ring_refuses_to_overwrite_a_slot_in_use():
    ring = StagingRing(CPUBackend(), n_slots=1, slot_bytes=16)
    ring.load("layer.0", torch.zeros(16, dtype=torch.uint8), "prefill")
    with pytest.raises(RuntimeError, match="still in use"):
        ring.load("layer.1", torch.zeros(16, dtype=torch.uint8), "prefill")


@pytest.mark.parametrize("read_ahead", [1, 2])
def test_disk_read_ahead_stays_within_its_bound(model_dir, read_ahead):
    spec = load_spec(model_dir)
    for compute in ("cpu", "stream"):
        # the page cache keeps nothing: every unit is read ahead (kept ones the CPU computes are mapped instead)
        placement = Placement.uniform(spec, "disk", compute, read_ahead=read_ahead, page_cache=frozenset())
        model = run_placed(model_dir, placement)
        reader = model.reader
        assert 1 <= reader.max_in_use <= read_ahead and reader.max_bytes_in_use <= reader.arena_bytes
        read = [model.layouts[n].n_bytes for n in model.order if n not in model._embed_rows]
        assert reader.arena_bytes == read_ahead_bytes(read, read_ahead)  # sized per unit, not by the largest
        ring = model.ring.n_slots * model.ring.slot_bytes if model.ring else 0
        assert model.backend.memory.peak_bytes["cpu"] <= reader.arena_bytes + _kv_bytes(model, "cpu")
        assert model.backend.memory.peak_bytes["gpu"] <= ring + _kv_bytes(model, "gpu")
        reads = [s for s in model.timeline.spans if s.kind == "disk_read"]
        assert len(reads) >= len(model.order)


def _kv_bytes(model, tier: str) -> int:
    return model._kv_bytes.get(tier, 0)


def test_peak_memory_stays_within_the_plan(model_dir):
    """A planned mix of resident, streamed and CPU blocks on a simulated 24 GB-class profile."""
    llm = LLM(str(model_dir), hardware=gpu_profile(), gpu_memory="6000KiB", cpu_memory="1GiB", backend="cpu", host_baseline=0,
              batch_size=8, max_model_len=64)
    modes = {(u.weight_tier, u.prefill, u.decode) for u in llm.plan.units}
    assert ("gpu", "gpu", "gpu") in modes and any("stream" in m for m in modes) and ("cpu", "cpu", "cpu") in modes
    prompts = [[(7 * i + j) % 160 for j in range(40 + i)] for i in range(8)]
    out = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for tier in ("gpu", "cpu"):
        usage = llm.plan.tier(tier)
        assert llm.backend.memory.peak_bytes[tier] <= usage.total_bytes <= usage.budget_bytes
    reference = LLM(str(model_dir), placement=Placement.uniform(llm.spec, "cpu", "cpu"), backend="cpu")
    ref = reference.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def _host_ram_only(placement: Placement) -> Placement:
    """The placement with its disk units held in host RAM instead (a copy then never waits for a read)."""
    from dataclasses import replace

    units = {n: replace(p, weights="cpu") if p.weights == "disk" else p for n, p in placement.units.items()}
    return replace(placement, units=units)


@pytest.mark.parametrize("seed,k", [(0, 1), (1, 2), (2, 3), (3, 2), (4, 4)])
def test_the_executor_replays_the_schedules_copies_step_after_step(model_dir, seed, k):
    """The schedule the plan carries is what the executor does: for a random mix of streamed and CPU units, a decode
    step's copies and releases come in the order of the schedule's actions, the next step's first units copied as
    this step's last ones are released."""
    from offload.planner.schedule import AHEAD, phase_schedule

    spec = load_spec(model_dir)
    placement = _host_ram_only(Placement.random(spec, seed, prefetch_depth=k))
    model = run_placed(model_dir, placement, n_prompts=1, max_tokens=6)
    units = [(n, placement[n].mode("decode"), placement[n].weights) for n in model.order]
    schedule = phase_schedule("decode", units, k, steady=True)
    planned = [(a.op, a.unit) for a in schedule.actions if a.op in ("copy", "release") and a.issued != AHEAD]
    issued = [(event, unit) for event, unit, _ in model.backend.log if event in ("copy", "release")]
    if not planned:
        pytest.skip("this mix streams nothing in decode")
    # the last decode steps replay the schedule exactly (the first decode step follows a prefill step)
    assert issued[-2 * len(planned):] == planned + planned, (issued[-2 * len(planned):], planned)
